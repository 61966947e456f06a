// `locks eval`, planning: the checks of the configuration, the model and the corpus split, the global
// basis calibration and the contexts, all before the first fork runs.
#include <fmt/format.h>

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "eval/eval_internal.h"
#include "locks/session.h"
#include "locks/text_corpus.h"

namespace locks {

namespace {

// The SelectorOptions input that spec key `k` sets (0 for an unknown key, refused by the parser).
unsigned spec_key_input(const std::string& k) {
  if (k == "r") return kInputRank;
  if (k == "basis") return kInputBasisBits;
  if (k == "coef") return kInputCoefBits;
  if (k == "centroid") return kInputCentroidBits;
  if (k == "rule") return kInputGroupRule;
  if (k == "rho") return kInputSharedRank;
  if (k == "p" || k == "cert" || k == "min" || k == "max") return kInputBudgetRule;
  if (k == "bytes") return kInputRankBytes;
  return 0;
}

}  // namespace

SelectorSpec parse_selector_spec(const std::string& spec, const SummaryFormat& base) {
  SelectorSpec s;
  s.label = spec;
  s.opts.summary = base;
  size_t start = 0;
  bool first = true;
  std::vector<std::string> seen_keys;  // a key given twice would silently keep the last value
  while (start <= spec.size()) {
    size_t end = spec.find('/', start);
    if (end == std::string::npos) end = spec.size();
    const std::string part = spec.substr(start, end - start);
    if (first) {
      if (part.empty()) throw std::invalid_argument(fmt::format("selector '{}': empty selector name", spec));
      s.name = part;
      if (const auto known = selector_names(); std::find(known.begin(), known.end(), s.name) == known.end())
        throw std::invalid_argument(fmt::format("unknown selector '{}' in '{}'", s.name, spec));
      first = false;
    } else {
      const size_t eq = part.find('=');
      if (eq == std::string::npos)
        throw std::invalid_argument(fmt::format("selector '{}': '{}' is not key=value", spec, part));
      const std::string k = part.substr(0, eq), v = part.substr(eq + 1);
      if (std::find(seen_keys.begin(), seen_keys.end(), k) != seen_keys.end())
        throw std::invalid_argument(fmt::format("selector '{}': key '{}' given twice", spec, k));
      seen_keys.push_back(k);
      auto as_int = [&] {
        try {
          size_t used = 0;
          const int x = std::stoi(v, &used);
          if (used != v.size()) throw std::invalid_argument("trailing");
          return x;
        } catch (const std::exception&) {
          throw std::invalid_argument(fmt::format("selector '{}': {}='{}' is not an integer", spec, k, v));
        }
      };
      // Each key only where the selector reads that option (the selector table): a key another
      // selector ignores would only mislabel its rows.
      if (const unsigned input = spec_key_input(k); input != 0 && !(selector_inputs(s.name) & input))
        throw std::invalid_argument(fmt::format("selector '{}': key '{}' does not apply to {}", spec, k, s.name));
      if (k == "r")
        s.opts.summary.rank = as_int();
      else if (k == "basis")
        s.opts.summary.basis_bits = as_int();
      else if (k == "coef")
        s.opts.summary.coef_bits = as_int();
      else if (k == "centroid")
        s.opts.summary.centroid_bits = as_int();
      else if (k == "rho")
        s.opts.shared_rank = as_int();
      else if (k == "p" || k == "cert") {
        if (s.opts.budget_rule.kind != BudgetRule::Kind::kFixed)
          throw std::invalid_argument(fmt::format("selector '{}': give one of p= and cert=, not both", spec));
        const int min_tokens = s.opts.budget_rule.min_tokens;
        try {
          s.opts.budget_rule = parse_budget_rule(part);
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(fmt::format("selector '{}': {}", spec, e.what()));
        }
        s.opts.budget_rule.min_tokens = min_tokens;
      } else if (k == "bytes") {
        try {
          s.opts.rank_bytes = parse_unit_fraction(k, v, "fraction");
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(fmt::format("selector '{}': {}", spec, e.what()));
        }
      } else if (k == "min") {
        s.opts.budget_rule.min_tokens = as_int();
        if (s.opts.budget_rule.min_tokens < 0)
          throw std::invalid_argument(fmt::format("selector '{}': min={} is negative", spec, v));
      } else if (k == "max") {
        s.max_tokens = as_int();
        if (s.max_tokens < 32 || s.max_tokens % 16 != 0)
          throw std::invalid_argument(
              fmt::format("selector '{}': max={} must be a multiple of 16, >= 32 (a budget)", spec, v));
      } else if (k == "rule")
        try {
          s.opts.group_rule = parse_group_rule(v);
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument(fmt::format("selector '{}': {}", spec, e.what()));
        }
      else
        throw std::invalid_argument(fmt::format(
            "selector '{}': unknown key '{}' (r, basis, coef, centroid, rule, rho, p, cert, min, max, bytes)", spec,
            k));
    }
    start = end + 1;
  }
  const bool adaptive = s.opts.budget_rule.kind != BudgetRule::Kind::kFixed;
  if (!adaptive && (s.max_tokens > 0 || s.opts.budget_rule.min_tokens > 0))
    throw std::invalid_argument(
        fmt::format("selector '{}': min= and max= bound an adaptive budget: give p= or cert= too", spec));
  if (adaptive && s.opts.group_rule != GroupRule::kShareAverage)
    throw std::invalid_argument(fmt::format(
        "selector '{}': p= and cert= reach a share-average group share (Eq. 5); rule= must be share-average", spec));
  if (s.max_tokens > 0 && s.opts.budget_rule.min_tokens > s.max_tokens)
    throw std::invalid_argument(
        fmt::format("selector '{}': min={} is above max={}", spec, s.opts.budget_rule.min_tokens, s.max_tokens));
  return s;
}

void check_eval_config(const EvalConfig& cfg) {
  bool continuation = false;
  for (const auto& f : cfg.families) {
    if (f == "continuation")
      continuation = true;
    else
      parse_needle_family(f);
  }
  for (int b : cfg.budgets)
    if (b < 32 || b % 16 != 0)
      throw std::invalid_argument(fmt::format("budget {}: must be a multiple of 16, >= 32", b));
  for (const auto& str : cfg.selectors) {
    const SelectorSpec s = parse_selector_spec(str, cfg.summary);
    if (s.max_tokens == 0)  // the --budgets values are its maximum
      for (int b : cfg.budgets)
        if (s.opts.budget_rule.min_tokens > b)
          throw std::invalid_argument(
              fmt::format("selector '{}': min={} is above budget {} (give max= to run it at one budget of its own)",
                          str, s.opts.budget_rule.min_tokens, b));
  }
  if (cfg.contexts < 1) throw std::invalid_argument("contexts must be >= 1");
  if (cfg.tail_contexts > 0 &&
      std::none_of(cfg.selectors.begin(), cfg.selectors.end(), [](const std::string& x) { return x == "full"; }))
    throw std::invalid_argument(
        "tail contexts: the tail finding rides on full attention's decode steps: add selector full");
  if (cfg.tail_contexts > 0 &&
      std::all_of(cfg.families.begin(), cfg.families.end(), [](const std::string& f) { return f == "continuation"; }))
    throw std::invalid_argument(
        "tail contexts: the tail finding measures the retrieval tasks' decode steps: add single, multikey or "
        "multiquery");
  if (cfg.continuation_tokens < 1) throw std::invalid_argument("continuation tokens must be >= 1");
  for (int len : cfg.lengths) {
    if (len < 256 || len > kMaxContextTokens)
      throw std::invalid_argument(fmt::format("length {}: must be in [256, {}] tokens", len, kMaxContextTokens));
    if (continuation && cfg.continuation_tokens > len / 2)
      throw std::invalid_argument(fmt::format(
          "continuation tokens {} are more than half of the length {}: the prefix the selectors work on would "
          "be shorter than the forced tokens",
          cfg.continuation_tokens, len));
  }
}

EvalPlan plan_eval(const EvalConfig& cfg, const std::function<void(const std::string&)>& warn) {
  // Validate everything before the (long) run starts.
  check_eval_config(cfg);
  EvalPlan plan;
  for (const auto& f : cfg.families) {
    if (f == "continuation")
      plan.continuation = true;
    else
      plan.families.push_back(parse_needle_family(f));
  }
  for (const auto& s : cfg.selectors) plan.specs.push_back(parse_selector_spec(s, cfg.summary));
  for (const auto& s : plan.specs)
    if (const std::string why = device_refusal(cfg.device, s.name, s.opts); !why.empty())
      throw std::invalid_argument(why);

  plan.model = LlamaModel::load(cfg.model_path);
  const LlamaModel& model = plan.model;
  if (warn)
    for (const std::string& n : model.defaults_used) warn(n);
  for (int len : cfg.lengths)
    if (len > model.hp.n_ctx_train)
      throw std::invalid_argument(
          model.hp.n_ctx_train < 256
              ? fmt::format("the model's context of {} tokens is shorter than eval's shortest length, 256",
                            model.hp.n_ctx_train)
              : fmt::format("length {} is longer than the model's context of {} tokens", len, model.hp.n_ctx_train));
  for (const auto& s : plan.specs) {
    KvCacheConfig probe_cfg{model.hp.n_layer, model.hp.n_head_kv, model.hp.head_dim, 16, 1, KvDtype::F16};
    // Throws on bad variants (global-basis waits for the basis plan_contexts calibrates).
    if (!(selector_inputs(s.name) & kInputGlobalBasis)) make_selector(s.name, probe_cfg, s.opts);
  }
  const std::vector<std::string> all_docs = load_documents(cfg.corpus_path);
  // Every tenth document is reserved for calibration (the global basis is fit on other text).
  for (size_t i = 0; i < all_docs.size(); ++i) (i % 10 == 0 ? plan.calib_docs : plan.docs).push_back(all_docs[i]);
  if (plan.docs.empty())
    throw std::invalid_argument(fmt::format(
        "corpus '{}' holds {} document(s); eval needs at least 2 (every tenth, starting with the first, is held "
        "back to calibrate the global basis; documents are separated by the byte 0x1E)",
        cfg.corpus_path, all_docs.size()));
  if (plan.calib_docs.empty()) plan.calib_docs = plan.docs;

  const int matched_rho = matched_bytes_rank(cfg.summary, 16, model.hp.head_dim);
  for (int r : {1, 2, 4, 8, 16, matched_rho})  // ranks above head_dim do not exist (tiny models: head_dim 8)
    if (r <= model.hp.head_dim && std::find(plan.loc_ranks.begin(), plan.loc_ranks.end(), r) == plan.loc_ranks.end())
      plan.loc_ranks.push_back(r);
  // multikey asks the first question of a multiquery context (four needles either way), so with
  // both families one prefill serves two tasks: paired contexts, a third fewer prefills.
  const auto has = [&](NeedleFamily f) {
    return std::find(plan.families.begin(), plan.families.end(), f) != plan.families.end();
  };
  plan.share = cfg.share_contexts && has(NeedleFamily::kMultiKey) && has(NeedleFamily::kMultiQuery);
  for (NeedleFamily f : plan.families)
    if (!(plan.share && f == NeedleFamily::kMultiKey)) {
      plan.loc_family = f;
      break;
    }
  return plan;
}

void plan_contexts(EvalPlan& plan, const EvalConfig& cfg, const EvalProgress& progress) {
  // Loki's scope: one basis per (layer, KV head) from a dense prefill of calibration text.
  const bool need = std::any_of(plan.specs.begin(), plan.specs.end(),
                                [](const auto& s) { return selector_inputs(s.name) & kInputGlobalBasis; });
  if (need || cfg.locality_contexts > 0) {
    if (progress) progress(0, 1, "calibrating the global basis on 4096 tokens of other text");
    std::vector<int32_t> ids;
    try {
      ids = make_text_tokens(plan.calib_docs, plan.model.tokenizer, 4096, cfg.seed + 4242);
    } catch (const std::invalid_argument& e) {  // say what the 4096 tokens are for
      throw std::invalid_argument(fmt::format(
          "calibrating the global basis ({}) on 4096 tokens of the corpus's held-back documents (every tenth): "
          "{}",
          need ? "the global-basis selector" : "--locality-contexts", e.what()));
    }
    SessionConfig sc;
    sc.n_ctx = 4096;
    Session cal(plan.model, sc);
    cal.prefill(ids);
    plan.global =
        std::make_shared<GlobalBasis>(calibrate_global_basis(cal.cache(), cal.sequence(), plan.model.hp.head_dim));
  }
  for (auto& s : plan.specs) s.opts.global_basis = plan.global;

  for (int len : cfg.lengths)
    for (NeedleFamily fam : plan.families)
      if (!(plan.share && fam == NeedleFamily::kMultiKey))
        for (int c = 0; c < cfg.contexts; ++c) (void)build_needle_tasks(plan, cfg, len, fam, c);
}

uint64_t needle_task_seed(const EvalConfig& cfg, int len, NeedleFamily fam, int c) {
  return cfg.seed * 1000003ull + uint64_t(len) * 31ull + uint64_t(fam) * 7919ull + uint64_t(c);
}

std::vector<NeedleTask> build_needle_tasks(const EvalPlan& plan, const EvalConfig& cfg, int len, NeedleFamily fam,
                                           int c) {
  std::vector<NeedleTask> tasks;
  tasks.push_back(make_needle_task(plan.docs, plan.model.tokenizer, fam, len, needle_task_seed(cfg, len, fam, c)));
  if (plan.share && fam == NeedleFamily::kMultiQuery) {  // multikey: the same context, its first question only
    NeedleTask mk = tasks.front();
    mk.family = NeedleFamily::kMultiKey;
    mk.questions.resize(1);
    tasks.insert(tasks.begin(), std::move(mk));
  }
  // The builder adds whole corpus lines; one line longer than the length overshoots it.
  const NeedleTask& task = tasks.back();
  const int n_ctx_train = plan.model.hp.n_ctx_train;
  if (task.total_tokens() > len + 64 || task.total_tokens() > n_ctx_train)
    throw std::runtime_error(fmt::format(
        "{} context {} has {} tokens for length {} (model context {}): a corpus line is longer than the length",
        needle_family_name(fam), c, task.total_tokens(), len, n_ctx_train));
  return tasks;
}

}  // namespace locks
