// `locks run`: long-context generation with a selector, then one stats line (or --json).
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "commands.h"
#include "locks/chat.h"
#include "locks/generate.h"
#include "locks/model.h"
#include "locks/text_corpus.h"
#include "paths.h"

namespace locks::cli {

std::string default_model_path() { return resolve_default_path("models/locks-ref-a-q8_0.gguf"); }

void warn_model_defaults(const std::vector<std::string>& notes) {
  for (const std::string& n : notes) diag("[locks] warning: {}\n", n);
}

namespace {

struct RunArgs {
  std::string model;
  std::string prompt;
  std::string prompt_file;
  std::string selector = "locks";
  int budget = 512;
  int rank = 8;
  int basis_bits = 4;
  std::string group_rule = "share-average";
  std::string budget_rule = "fixed";
  int min_budget = 0;
  double rank_bytes = 0;
  int max_tokens = 32;
  float temperature = 0.0f;
  float top_p = 1.0f;
  uint64_t seed = 0;
  int threads = 0;
  int decode_tail = -1;
  int n_ctx = 0;
  std::string kv_dtype;  // default: f16 on the CPU, bf16 on CUDA
  std::string device = "cpu";
  std::string gpu_weights = "auto";
  bool json = false;
  int top_logprobs = 0;
  bool chat = false;
  std::string system;
  bool prompt_given = false;  // -p was passed (an empty prompt then means BOS only)
  bool rank_given = false, basis_bits_given = false, group_rule_given = false, budget_rule_given = false,
       rank_bytes_given = false;
  bool budget_given = false, top_p_given = false, seed_given = false;
};

// A prompt larger than this cannot fit any context the tool supports (16M tokens at ~4 bytes each).
constexpr size_t kMaxPromptBytes = size_t(256) << 20;

constexpr const char* kDefaultPrompt = "examples/needle-8k.txt";
// The default prompt ends with a needle question; its last line goes through decode.
constexpr int kDefaultDecodeTail = 24;

// The LOCKS options -r, --basis-bits, --group-rule, --budget-rule and --min-budget set.
SelectorOptions selector_options(const RunArgs& a) {
  SelectorOptions o;
  o.summary.rank = a.rank;
  o.summary.basis_bits = a.basis_bits;
  o.group_rule = parse_group_rule(a.group_rule);
  o.budget_rule = parse_budget_rule(a.budget_rule);
  o.budget_rule.min_tokens = a.min_budget;
  o.rank_bytes = a.rank_bytes;
  return o;
}

int run(const RunArgs& a) {
  if (a.threads > 0) omp_set_num_threads(a.threads);
  std::string prompt;
  bool default_prompt = false;
  if (a.prompt_given && !a.prompt_file.empty())
    throw CLI::ValidationError("--prompt", "--prompt and --prompt-file are mutually exclusive");
  if (a.prompt_given) {
    prompt = a.prompt;
  } else {
    // -f, or the default prompt (which a local examples/needle-8k.txt may replace: checked alike).
    default_prompt = a.prompt_file.empty();
    const std::string path = default_prompt ? resolve_default_path(kDefaultPrompt) : a.prompt_file;
    const std::string what = default_prompt ? "default prompt file" : "prompt file";
    prompt = read_input(path, kMaxPromptBytes, what);
    // An empty file is more likely a mistake than a request to generate from BOS, which -p "" asks.
    if (prompt.empty())
      throw std::invalid_argument(
          fmt::format("{} is empty (-p \"\" generates from BOS alone)", input_name(path, what)));
    require_text(prompt, path, what);  // as eval's corpus
  }
  const std::string model_path = a.model.empty() ? default_model_path() : a.model;
  const LlamaModel model = LlamaModel::load(model_path);
  warn_model_defaults(model.defaults_used);
  // A prompt far beyond the context is refused before tokenizing it (tens of seconds for ~100 MB),
  // by a lower bound on its token count; one that may fit is tokenized and checked exactly later.
  const int64_t n_ctx = a.n_ctx > 0 ? a.n_ctx : model.hp.n_ctx_train;
  const int64_t min_tokens = int64_t(model.tokenizer.min_tokens(prompt));
  if (min_tokens > 0 && min_tokens + std::max(a.max_tokens - 1, 0) > n_ctx)
    throw std::length_error(
        fmt::format("prompt of {} bytes is at least {} token{} + {} to generate, more than the "
                    "context size of {} token{}",
                    prompt.size(), min_tokens, min_tokens == 1 ? "" : "s", a.max_tokens, n_ctx, n_ctx == 1 ? "" : "s"));

  // Options a selector does not read would silently not apply (eval refuses them in a selector spec).
  auto ignored = [&](bool given, const char* opt, SelectorInput input) {
    if (given && !(selector_inputs(a.selector) & input))
      diag("[locks] warning: {} does not apply to selector '{}': ignored\n", opt, a.selector);
  };
  ignored(a.rank_given, "-r/--rank", kInputRank);
  ignored(a.basis_bits_given, "--basis-bits", kInputBasisBits);
  ignored(a.group_rule_given, "--group-rule", kInputGroupRule);
  ignored(a.budget_rule_given, "--budget-rule/--min-budget", kInputBudgetRule);
  ignored(a.rank_bytes_given, "--rank-bytes", kInputRankBytes);
  ignored(a.budget_given, "-b/--budget", kInputBudget);
  for (auto [given, opt] : {std::pair{a.top_p_given, "--top-p"}, std::pair{a.seed_given, "--seed"}})
    if (given && a.temperature == 0.0f)
      diag("[locks] warning: {} does not apply to greedy decoding (-t 0): ignored\n", opt);

  SessionConfig sc;
  sc.selector = a.selector;
  sc.budget_tokens = a.budget;
  sc.selector_opts = selector_options(a);
  sc.device = parse_device(a.device);
  if (sc.device == Device::kCuda) {
    sc.cuda.kv_bf16 = a.kv_dtype != "f16";
    sc.cuda.weights = a.gpu_weights == "bf16"  ? CudaSessionOptions::Weights::kBF16
                      : a.gpu_weights == "f32" ? CudaSessionOptions::Weights::kF32
                                               : CudaSessionOptions::Weights::kAuto;
  } else {
    sc.kv_dtype = parse_kv_dtype(a.kv_dtype.empty() ? "f16" : a.kv_dtype);
  }
  sc.n_ctx = a.n_ctx;
  if (a.n_ctx > model.hp.n_ctx_train)
    diag("[locks] warning: context {} tokens exceeds the model's training context of {}\n", a.n_ctx,
         model.hp.n_ctx_train);
  Session session(model, sc);  // before tokenizing: a context or budget it refuses is refused at once
  const std::vector<int32_t> ids = a.chat ? chat_prompt(model.tokenizer, prompt, a.system)
                                          : model.tokenizer.encode(prompt, model.tokenizer.add_bos());
  if (ids.empty())
    throw std::invalid_argument("the prompt is empty and this model's vocabulary adds no BOS token: give some text");

  GenerateOptions go;
  go.max_tokens = a.max_tokens;
  go.decode_tail = a.decode_tail >= 0 ? a.decode_tail : (default_prompt ? kDefaultDecodeTail : 0);
  go.sampler = {a.temperature, a.top_p, a.seed};
  go.top_logprobs = a.top_logprobs;
  auto stream = [&](int32_t id) {
    if (!a.json) {
      std::fputs(model.tokenizer.token_to_piece(id).c_str(), stdout);
      std::fflush(stdout);
    }
  };
  const GenerateResult r = generate(session, ids, go, stream);

  const double steps = std::max<double>(1.0, double(r.decode.steps));
  const double bytes_step = r.decode.bytes_read / steps, dense_step = r.decode.dense_bytes / steps;
  const double ratio = dense_step > 0 ? bytes_step / dense_step : 1.0;
  const double prefill_tps = r.prefill_seconds > 0 ? r.prefill_tokens / r.prefill_seconds : 0.0;
  const double decode_tps = r.decode.seconds > 0 ? r.decode.steps / r.decode.seconds : 0.0;
  const bool reads_budget = selector_inputs(a.selector) & kInputBudget;
  // An adaptive budget's outcome: tokens kept per (layer, KV head) selection and targets met.
  const bool adaptive =
      (selector_inputs(a.selector) & kInputBudgetRule) && sc.selector_opts.budget_rule.kind != BudgetRule::Kind::kFixed;
  double kept_sum = 0, kept_n = 0;
  for (size_t k = 0; k < r.decode.pages_kept.size(); ++k)
    kept_sum += double(k) * r.decode.pages_kept[k], kept_n += double(r.decode.pages_kept[k]);
  const double kept_mean = kept_n > 0 ? double(session.cache().page_size()) * kept_sum / kept_n : 0.0;  // (CPU only)
  const double target_met =
      r.decode.mass_target_tried ? double(r.decode.mass_target_met) / double(r.decode.mass_target_tried) : 0.0;
  if (a.json) {
    nlohmann::json j;
    j["text"] = r.text;
    j["prompt_tokens"] = r.prompt_ids.size();
    j["generated_ids"] = r.generated_ids;
    j["selector"] = a.selector;
    j["device"] = a.device;
    j["budget_tokens"] = reads_budget ? nlohmann::json(a.budget) : nlohmann::json();  // full: every page
    if (adaptive) {
      j["budget_rule"] = describe_budget_rule(sc.selector_opts.budget_rule);
      const bool any = r.decode.mass_target_tried > 0;  // null when no step selected
      j["kept_tokens_mean"] = any ? nlohmann::json(kept_mean) : nlohmann::json();
      j["mass_target_met"] = any ? nlohmann::json(target_met) : nlohmann::json();
    }
    if (a.top_logprobs > 0) {
      auto& lists = j["top_logprobs"] = nlohmann::json::array();
      for (const auto& at : r.top_logprobs) {
        auto& list = lists.emplace_back(nlohmann::json::array());
        for (const TokenLogprob& t : at) list.push_back({{"id", t.id}, {"logprob", t.logprob}});
      }
    }
    j["stats"] = {{"prefill_s", r.prefill_seconds},      {"prefill_tokens", r.prefill_tokens},
                  {"prefill_tokens_per_s", prefill_tps}, {"decode_steps", r.decode.steps},
                  {"decode_tokens_per_s", decode_tps},   {"bytes_read_per_step", bytes_step},
                  {"dense_bytes_per_step", dense_step},  {"read_ratio", ratio}};
    // Byte-fallback tokens can split a UTF-8 character: replace invalid bytes, never fail the run.
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::fputs("\n", stdout);
    std::fflush(stdout);
    std::string budget = reads_budget ? fmt::format("{} tokens", a.budget) : std::string("all pages");
    if (adaptive)
      budget =
          r.decode.mass_target_tried == 0
              ? fmt::format("{} ({}: no step selected)", budget, describe_budget_rule(sc.selector_opts.budget_rule))
              : fmt::format("{} ({}: kept {:.0f} tokens per selection on average, target met {:.1f}%)", budget,
                            describe_budget_rule(sc.selector_opts.budget_rule), kept_mean, 100.0 * target_met);
    // No decode step (-n 0 or 1 with no decode tail): no per-step figures to report.
    const std::string decode =
        r.decode.steps == 0 ? std::string("decode 0 steps")
                            : fmt::format(
                                  "decode {} step{}, {:.1f} tok/s | attention read/step {:.1f} KiB vs dense {:.1f} KiB "
                                  "(ratio {:.3f}, {:.1f}x fewer)",
                                  r.decode.steps, r.decode.steps == 1 ? "" : "s", decode_tps, bytes_step / 1024.0,
                                  dense_step / 1024.0, ratio, ratio > 0 ? 1.0 / ratio : 0.0);
    diag("[locks] {}selector={} budget={} | prompt {} token{} | prefill {:.2f} s ({:.0f} tok/s) | {}\n",
         sc.device == Device::kCuda ? "device=cuda " : "", a.selector, budget, r.prompt_ids.size(),
         r.prompt_ids.size() == 1 ? "" : "s", r.prefill_seconds, prefill_tps, decode);
  }
  return 0;
}

}  // namespace

Runner add_run(CLI::App& app) {
  auto a = std::make_shared<RunArgs>();
  app.add_option("-m,--model", a->model, "GGUF model (default: models/locks-ref-a-q8_0.gguf)")->check(non_empty_path());
  CLI::Option* prompt_opt = app.add_option("-p,--prompt", a->prompt, "prompt text (\"\" = generate from BOS)");
  app.add_option("-f,--prompt-file", a->prompt_file, "prompt file, '-' for stdin (default: examples/needle-8k.txt)")
      ->check(non_empty_path());
  app.add_option("-s,--selector", a->selector,
                 "page selector (full = dense, oracle = exact page LSE, locks, baselines)")
      ->check(CLI::Validator(
          [](std::string& name) -> std::string {
            return selector_inputs(name) & kInputGlobalBasis
                       ? name + " needs an offline calibration pass: it runs in `locks eval` only"
                       : "";
          },
          "", "no global basis"))
      ->check(CLI::IsMember([] {
        // A selector of a calibrated global basis needs an offline calibration pass (`locks eval`).
        auto n = selector_names();
        std::erase_if(n, [](const std::string& name) { return selector_inputs(name) & kInputGlobalBasis; });
        return n;
      }()))
      ->capture_default_str();
  CLI::Option* budget_opt =
      app.add_option("-b,--budget", a->budget, "attention budget per KV head in tokens (multiple of 16, >= 32)")
          ->transform(decimal_integer())
          ->check(CLI::Range(32, kMaxContextTokens))
          ->capture_default_str();
  CLI::Option* rank_opt = app.add_option("-r,--rank", a->rank, "LOCKS summary rank r (1..16)")
                              ->transform(decimal_integer())
                              ->check(CLI::Range(1, 16))
                              ->capture_default_str();
  CLI::Option* basis_opt =
      app.add_option("--basis-bits", a->basis_bits, "LOCKS basis precision: 32 (f32), 16 (bf16), 8, 4 or 2 bits")
          ->transform(decimal_integer())
          ->check(CLI::IsMember({32, 16, 8, 4, 2}))
          ->capture_default_str();
  CLI::Option* rule_opt = app.add_option("--group-rule", a->group_rule,
                                         "how the GQA group shares one page set: share-average, max, mass-sum")
                              ->check(CLI::IsMember({"share-average", "max", "mass-sum"}))
                              ->capture_default_str();
  CLI::Option* budget_rule_opt =
      app.add_option("--budget-rule", a->budget_rule,
                     "LOCKS pages per step: fixed (the budget), p=P (the fewest top pages whose estimated group share "
                     "reaches P) or cert=P (until a certified lower bound of it does); -b is then the maximum")
          ->capture_default_str();
  CLI::Option* min_budget_opt =
      app.add_option("--min-budget", a->min_budget, "with --budget-rule p= or cert=: tokens kept at least")
          ->transform(decimal_integer())
          ->check(CLI::Range(0, kMaxContextTokens));
  CLI::Option* rank_bytes_opt =
      app.add_option("--rank-bytes", a->rank_bytes,
                     "LOCKS per-page ranks (<= -r) from each page's spectral tail, F times the fixed rank's summary "
                     "bytes on average, F in (0, 1) (default: every page at -r)")
          ->check(number_text());
  app.add_option("-n,--max-tokens", a->max_tokens, "tokens to generate")
      ->transform(decimal_integer())
      ->check(CLI::Range(0, 1 << 24))
      ->capture_default_str();
  app.add_option("-t,--temperature", a->temperature, "sampling temperature (0 = greedy)")
      ->check(number_text())
      ->check(CLI::Range(0.0, 100.0))
      ->capture_default_str();
  CLI::Option* top_p_opt = app.add_option("--top-p", a->top_p, "nucleus sampling threshold in (0, 1]")
                               ->check(number_text())
                               ->check(CLI::Range(1e-6, 1.0))
                               ->capture_default_str();
  CLI::Option* seed_opt =
      app.add_option("--seed", a->seed, "sampling seed")->transform(decimal_integer(true))->capture_default_str();
  app.add_option("--threads", a->threads, "CPU threads (default: all cores)")
      ->transform(decimal_integer())
      ->check(CLI::Range(1, 1024));
  app.add_option("--decode-tail", a->decode_tail,
                 "the last N prompt tokens go through the decode path (selection runs on them) instead of prefill "
                 "(default: 0; 24 for the default prompt, its question)")
      ->transform(decimal_integer())
      ->check(CLI::Range(0, kMaxContextTokens));
  app.add_option("-c,--ctx", a->n_ctx, "context size in tokens (default: the model's)")
      ->transform(decimal_integer())
      ->check(CLI::Range(1, kMaxContextTokens));
  app.add_option("--kv-dtype", a->kv_dtype,
                 "KV cache storage: f16 or f32 on the CPU (default f16), bf16 or f16 on CUDA "
                 "(default bf16)")
      ->check(CLI::IsMember({"f16", "f32", "bf16"}));
  app.add_option("--device", a->device,
                 "where the model runs: cpu, or cuda (the whole model on the GPU; selectors "
                 "full, locks and oracle)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  CLI::Option* weights_opt =
      app.add_option("--gpu-weights", a->gpu_weights,
                     "matrix weights on the GPU: bf16, f32, or auto (f32 up to 2 GiB of them, else bf16)")
          ->check(CLI::IsMember({"auto", "bf16", "f32"}))
          ->capture_default_str();
  app.add_flag("--json", a->json, "print one JSON object instead of streamed text and a stats line");
  app.add_flag("--chat", a->chat,
               "wrap the prompt in the model's chat format (Llama-3 headers, or ChatML for Qwen) and stop at its "
               "end-of-turn token");
  CLI::Option* system_opt = app.add_option("--system", a->system, "with --chat: a system message before the prompt");
  CLI::Option* logprobs_opt =
      app.add_option("--top-logprobs", a->top_logprobs,
                     "with --json: the N most likely tokens at each generated position, {id, logprob} (natural "
                     "log, temperature 1), most likely first")
          ->transform(decimal_integer())
          ->check(CLI::Range(1, 1000));
  return [a, system_opt, logprobs_opt, prompt_opt, rank_opt, basis_opt, rule_opt, budget_opt, top_p_opt, seed_opt,
          weights_opt, budget_rule_opt, min_budget_opt, rank_bytes_opt] {
    a->prompt_given = prompt_opt->count() > 0;
    a->budget_given = budget_opt->count() > 0;
    a->top_p_given = top_p_opt->count() > 0;
    a->seed_given = seed_opt->count() > 0;
    a->rank_given = rank_opt->count() > 0;
    a->basis_bits_given = basis_opt->count() > 0;
    a->group_rule_given = rule_opt->count() > 0;
    a->budget_rule_given = budget_rule_opt->count() > 0 || min_budget_opt->count() > 0;
    a->rank_bytes_given = rank_bytes_opt->count() > 0;
    if (a->rank_bytes_given && !(a->rank_bytes > 0 && a->rank_bytes < 1))
      throw CLI::ValidationError("--rank-bytes",
                                 fmt::format("{} is not a fraction strictly between 0 and 1", a->rank_bytes));
    try {
      if (parse_budget_rule(a->budget_rule).kind == BudgetRule::Kind::kFixed && min_budget_opt->count() > 0)
        throw CLI::ValidationError("--min-budget", "applies with --budget-rule p= or cert=");
    } catch (const std::invalid_argument& e) {
      throw CLI::ValidationError("--budget-rule", e.what());
    }
    if (parse_budget_rule(a->budget_rule).kind != BudgetRule::Kind::kFixed && a->group_rule != "share-average")
      throw CLI::ValidationError("--group-rule",
                                 "--budget-rule p= and cert= reach a share-average group share (Eq. 5): "
                                 "the group rule must be share-average");
    if (a->min_budget > a->budget)
      throw CLI::ValidationError("--min-budget", fmt::format("{} is above the budget {}", a->min_budget, a->budget));
    if (system_opt->count() > 0 && !a->chat) throw CLI::ValidationError("--system", "applies with --chat");
    if (a->chat && prompt_opt->count() == 0 && a->prompt_file.empty())
      throw CLI::ValidationError("--chat", "give the user's message with -p TEXT or -f FILE");
    if (logprobs_opt->count() > 0 && !a->json) throw CLI::ValidationError("--top-logprobs", "applies with --json");
    if (!std::isfinite(a->temperature)) throw CLI::ValidationError("--temperature", "must be a finite number");
    if (!(a->top_p > 0.0f && a->top_p <= 1.0f)) throw CLI::ValidationError("--top-p", "must be in (0, 1]");
    if (a->budget % 16 != 0)
      throw CLI::ValidationError("--budget", fmt::format("{} is not a multiple of the page size 16", a->budget));
    const bool cuda = a->device == "cuda";
    if (!cuda && a->kv_dtype == "bf16")
      throw CLI::ValidationError("--kv-dtype", "bf16 is the GPU's KV type (--device cuda); the CPU stores f16 or f32");
    if (cuda && a->kv_dtype == "f32")
      throw CLI::ValidationError("--kv-dtype", "f32 is a CPU KV type; --device cuda stores bf16 or f16");
    if (!cuda && weights_opt->count() > 0) throw CLI::ValidationError("--gpu-weights", "applies with --device cuda");
    // What the GPU engine runs, refused before the model loads (Session's own check).
    if (const std::string why = device_refusal(parse_device(a->device), a->selector, selector_options(*a));
        !why.empty())
      throw CLI::ValidationError(a->selector == "locks" ? "--device" : "--selector", why);
    return run(*a);
  };
}

}  // namespace locks::cli
