// `locks bench`: decode-attention time of dense vs LOCKS at long context (one layer, synthetic
// f16 KV), summary build throughput, and the reference model's prefill / decode speed with the
// per-step split, beside llama.cpp's llama-bench on the same model and context (--peer).
// Ratios come from one process, alternating the two paths, medians of repeated runs, with the
// CPU caches flushed before every timed run so neither side is helped by the other's reads.
#include <fcntl.h>
#include <fmt/format.h>
#include <omp.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "commands.h"
#include "locks/attention.h"
#include "locks/generate.h"
#include "locks/model.h"
#include "locks/selector.h"
#include "locks/session.h"
#include "locks/text_corpus.h"
#include "paths.h"
// ---- CUDA (`--device cuda`) ----
#ifdef LOCKS_WITH_CUDA
#include "locks/cuda/bench.h"
#endif
// ---- end CUDA ----

namespace locks::cli {

namespace {

struct BenchArgs {
  std::vector<int> contexts = {16384, 65536, 262144};
  int n_head_kv = 2;
  int n_group = 4;
  int head_dim = 64;
  int budget = 512;
  int runs = 15;
  bool skip_model = false;
  bool skip_attention = false;
  std::string model;
  int threads = 0;
  int rounds = 3;
  std::string peer;
  // ---- CUDA (`--device cuda`) ----
  std::string device = "cpu";
  std::vector<int> batches = {1, 2, 4, 8};
  std::string csv;
  bool f16 = false;
  bool no_pdl = false;
  bool ragged = false;
  bool no_balance = false;
  bool e2e = false;
  bool cublas_decode = false;
  std::vector<std::string> shapes;
  // ---- end CUDA ----
};

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Evict the caches (larger than any LLC here) so each timed step reads KV from DRAM.
void flush_caches() {
  static std::vector<char> junk(size_t(256) << 20, 1);
  volatile char sink = 0;
  for (size_t i = 0; i < junk.size(); i += 64) junk[i] = char(junk[i] + 1);
  sink = junk[12345];
  (void)sink;
}

// Keys with the structure real pages have: a slowly drifting direction per page plus noise, so
// summaries see realistic (not white) spectra. Values are noise.
void fill_cache(PagedKvCache& cache, KvSequence& seq, int n_tokens, uint64_t seed) {
  const auto& c = cache.config();
  const int H = c.n_head_kv, d = c.head_dim;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  cache.append_tokens(seq, n_tokens);
  std::vector<float> k(size_t(H) * d), v(size_t(H) * d), base(size_t(H) * d);
  for (int t = 0; t < n_tokens; ++t) {
    if (t % c.page_size == 0)
      for (auto& x : base) x = 2.0f * nd(rng);
    for (int i = 0; i < H * d; ++i) {
      k[i] = base[i] + 0.5f * nd(rng);
      v[i] = nd(rng);
    }
    cache.write(0, seq, t, k.data(), v.data());
  }
}

void bench_attention(const BenchArgs& a) {
  const int H = a.n_head_kv, G = a.n_group, d = a.head_dim, B = 16;
  fmt::print(
      "== decode attention, one layer: {} KV heads, {} query heads each ({} in all), head_dim {}, f16 KV, "
      "LOCKS budget {} tokens (r=8, int4 basis), {} threads, median of {} runs ==\n",
      H, G, H * G, d, a.budget, omp_get_max_threads(), a.runs);
  fmt::print("{:>8} | {:>12} {:>12} {:>7} | {:>10} {:>10} {:>7} | {:>12}\n", "context", "dense us", "locks us",
             "speedup", "dense KiB", "locks KiB", "fewer", "build pg/s");
  for (int ctx : a.contexts) {
    KvCacheConfig cfg;
    cfg.n_layer = 1;
    cfg.n_head_kv = H;
    cfg.head_dim = d;
    cfg.n_pages = (ctx + B - 1) / B;
    PagedKvCache cache(cfg);
    KvSequence seq;
    fill_cache(cache, seq, ctx, 42);
    auto locks = make_selector("locks", cfg);
    const auto tb = Clock::now();
    std::vector<int32_t> full_pages(seq.page_table.begin(), seq.page_table.begin() + ctx / B);
    locks->on_pages_filled(cache, 0, full_pages);
    const double build_s = std::chrono::duration<double>(Clock::now() - tb).count();

    std::mt19937_64 rng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> q(size_t(H) * G * d), o(q.size());
    for (auto& x : q) x = nd(rng);
    const float scale = 1.0f / std::sqrt(float(d));
    std::vector<int32_t> all(seq.n_pages());
    for (int j = 0; j < seq.n_pages(); ++j) all[j] = j;

    double dense_bytes = 0, locks_bytes = 0;
    auto dense_step = [&] {
#pragma omp parallel for schedule(static)
      for (int h = 0; h < H; ++h)
        paged_decode_attention(cache, 0, h, seq, all, &q[size_t(h) * G * d], G, scale, &o[size_t(h) * G * d], nullptr);
      dense_bytes = double(H) * cache.kv_bytes(ctx);
    };
    std::vector<Selection> sel(H);
    auto locks_step = [&] {
#pragma omp parallel for schedule(static)
      for (int h = 0; h < H; ++h) {
        SelectionRequest req;
        req.q = &q[size_t(h) * G * d];
        req.n_group = G;
        req.kv_head = h;
        req.seq = &seq;
        req.budget_pages = a.budget / B;
        locks->select(cache, req, sel[h]);
        paged_decode_attention(cache, 0, h, seq, sel[h].pages, req.q, G, scale, &o[size_t(h) * G * d], nullptr);
      }
      locks_bytes = 0;
      for (int h = 0; h < H; ++h) locks_bytes += double(step_bytes_read(cache, seq, sel[h]));
    };
    std::vector<double> td, tl;
    for (int r = -2; r < a.runs; ++r) {  // two warm-up rounds, then alternate
      flush_caches();
      auto t0 = Clock::now();
      dense_step();
      const double dt = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      flush_caches();
      t0 = Clock::now();
      locks_step();
      const double lt = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      if (r >= 0) {
        td.push_back(dt);
        tl.push_back(lt);
      }
    }
    const double md = median(td), ml = median(tl);
    fmt::print("{:>8} | {:>12.1f} {:>12.1f} {:>6.2f}x | {:>10.1f} {:>10.1f} {:>6.2f}x | {:>12.0f}\n", ctx, md, ml,
               md / ml, dense_bytes / 1024, locks_bytes / 1024, dense_bytes / locks_bytes,
               double(full_pages.size()) * H / build_s);
    std::fflush(stdout);
  }
}

std::vector<int32_t> haystack_tokens(const LlamaModel& model, int n) {
  const std::string path = resolve_default_path("examples/haystack.txt");
  const std::string text = read_input(path, size_t(256) << 20, "haystack file");
  std::vector<int32_t> ids = model.tokenizer.encode(text, model.tokenizer.add_bos());
  if (int(ids.size()) < n)
    throw std::runtime_error(fmt::format("'{}' has {} tokens, the benchmark needs {}", path, ids.size(), n));
  ids.resize(n);
  return ids;
}

// Runs argv (no shell) as a child process and returns its standard output; its standard error goes
// to a temporary file, whose last line a failure quotes. Throws std::runtime_error naming the program
// when it cannot start, exits non-zero or is killed by a signal.
std::string run_child(const std::vector<std::string>& argv) {
  int out[2];
  if (pipe(out) != 0) throw std::runtime_error(fmt::format("cannot create a pipe for '{}'", argv[0]));
  char err_path[] = "/tmp/locks-peer-stderr-XXXXXX";
  const int err_fd = mkstemp(err_path);
  if (err_fd < 0) {
    close(out[0]), close(out[1]);
    throw std::runtime_error(fmt::format("cannot create a file for the standard error of '{}'", argv[0]));
  }
  unlink(err_path);  // the descriptor keeps it until closed
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&fa, out[0]);
  posix_spawn_file_actions_adddup2(&fa, err_fd, STDERR_FILENO);
  std::vector<char*> args;
  for (const auto& x : argv) args.push_back(const_cast<char*>(x.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, argv[0].c_str(), &fa, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(out[1]);
  if (rc != 0) {
    close(out[0]), close(err_fd);
    throw std::runtime_error(fmt::format("cannot run '{}': {}", argv[0], std::strerror(rc)));
  }
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(out[0], buf, sizeof buf)) > 0;) text.append(buf, size_t(n));
  close(out[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) {
    close(err_fd);
    return text;
  }
  // The last non-empty line of its standard error (at most 64 KiB from the end).
  std::string err;
  const off_t size = lseek(err_fd, 0, SEEK_END);
  const off_t from = std::max<off_t>(0, size - 65536);
  if (size > 0 && lseek(err_fd, from, SEEK_SET) == from)
    for (ssize_t n; (n = read(err_fd, buf, sizeof buf)) > 0;) err.append(buf, size_t(n));
  close(err_fd);
  while (!err.empty() && (err.back() == '\n' || err.back() == '\r' || err.back() == ' ')) err.pop_back();
  if (const size_t nl = err.rfind('\n'); nl != std::string::npos) err = err.substr(nl + 1);
  const std::string why =
      WIFSIGNALED(status) ? fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)))
                          : fmt::format("failed (exit status {})", WEXITSTATUS(status));
  throw std::runtime_error(fmt::format("'{}' {}{}", argv[0], why, err.empty() ? "" : ": " + err));
}

// llama.cpp's llama-bench decode speed (tokens/s) on `model` after a `depth`-token context:
// `-p 0 -n <n_gen> -d <depth> -t <threads> -fa <0|1> -r 1 -o json`, its "avg_ts".
double peer_decode_speed(const std::string& peer, const std::string& model, int depth, int n_gen, int threads,
                         bool flash_attn) {
  const std::string out =
      run_child({peer, "-m", model, "-p", "0", "-n", std::to_string(n_gen), "-d", std::to_string(depth), "-t",
                 std::to_string(threads), "-fa", flash_attn ? "1" : "0", "-r", "1", "-o", "json"});
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(out);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(fmt::format("'{}' printed no JSON result ({})", peer, e.what()));
  }
  if (!j.is_array() || j.empty() || !j.back().contains("avg_ts") || !j.back()["avg_ts"].is_number())
    throw std::runtime_error(fmt::format("'{}' printed no \"avg_ts\" in its JSON result", peer));
  const double tps = j.back()["avg_ts"].get<double>();
  if (!(tps > 0.0) || !std::isfinite(tps))
    throw std::runtime_error(fmt::format("'{}' reported a decode speed of {} tokens/s", peer, tps));
  return tps;
}

// Per-step times of one engine over the rounds (seconds per step).
struct StepSplit {
  std::vector<double> step, score, select, attend;
};

void bench_model(const BenchArgs& a) {
  const std::string model_path = a.model.empty() ? default_model_path() : a.model;
  const LlamaModel model = LlamaModel::load(model_path);
  warn_model_defaults(model.defaults_used);
  // A 4096-token prefill, then a long context for the decode comparison.
  constexpr int kMinModelContext = 4096 + 64;
  if (model.hp.n_ctx_train < kMinModelContext)
    throw std::runtime_error(fmt::format(
        "bench's model part needs a model context of at least {} tokens; '{}' has {} (--skip-model runs the "
        "attention part only)",
        kMinModelContext, model.name, model.hp.n_ctx_train));
  const int threads = omp_get_max_threads();
  fmt::print("== model {} ({} layers, d_model {}, {} heads / {} KV heads), {} threads ==\n", model.name,
             model.hp.n_layer, model.hp.n_embd, model.hp.n_head, model.hp.n_head_kv, threads);
  {
    const auto ids = haystack_tokens(model, 4096);
    SessionConfig sc;
    Session s(model, sc);
    const auto t0 = Clock::now();
    s.prefill(ids);
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    fmt::print("prefill 4096 tokens: {:.2f} s, {:.0f} tokens/s\n", sec, 4096 / sec);
  }
  // llama-bench's -n 64 -d ctx fills the model's context exactly (ctx + 64 = n_ctx_train at 16K).
  constexpr int kSteps = 32, kPeerGen = 64;
  const int ctx = std::min(16384 - kPeerGen, model.hp.n_ctx_train - kPeerGen);
  const auto ids = haystack_tokens(model, ctx);
  SessionConfig sc;
  Session base(model, sc);
  const auto t0 = Clock::now();
  base.prefill(ids);
  fmt::print("prefill {} tokens: {:.2f} s\n", ctx, std::chrono::duration<double>(Clock::now() - t0).count());
  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  fmt::print(
      "decode at {} context: medians of {} alternating rounds (each: {} steps per engine after one warm-up step{}); "
      "load average {:.2f} {:.2f} {:.2f} at the start\n",
      ctx, a.rounds, kSteps, a.peer.empty() ? "" : fmt::format(", llama-bench -n {} per setting", kPeerGen), load[0],
      load[1], load[2]);
  const char* names[2] = {"full", "locks"};
  std::unique_ptr<Selector> prepared[2];
  SessionConfig cfgs[2];
  for (int e = 0; e < 2; ++e) {
    cfgs[e].selector = names[e];
    cfgs[e].budget_tokens = a.budget;
    prepared[e] = base.prepare_selector(cfgs[e]);  // summaries built once, outside the timed steps
  }
  StepSplit split[2];
  std::vector<double> peer_tps[2];  // flash-attn off, on
  double kib[2] = {0, 0}, dense_kib = 0;
  for (int round = 0; round < a.rounds; ++round) {
    for (int e = 0; e < 2; ++e) {
      Session s = base.fork(cfgs[e], *prepared[e]);
      int32_t tok = argmax(s.decode(ids.back()));  // first step (warm-up) is excluded below
      const DecodeTotals warm = s.totals();
      for (int i = 0; i < kSteps; ++i) tok = argmax(s.decode(tok));
      const DecodeTotals& t = s.totals();
      const double n = double(t.steps - warm.steps);
      split[e].step.push_back((t.seconds - warm.seconds) / n);
      split[e].score.push_back((t.score_seconds - warm.score_seconds) / n);
      split[e].select.push_back((t.select_seconds - warm.select_seconds) / n);
      split[e].attend.push_back((t.attend_seconds - warm.attend_seconds) / n);
      kib[e] = (t.bytes_read - warm.bytes_read) / n / 1024;
      dense_kib = (t.dense_bytes - warm.dense_bytes) / n / 1024;
    }
    if (!a.peer.empty())
      for (int fa = 0; fa < 2; ++fa)
        peer_tps[fa].push_back(peer_decode_speed(a.peer, model_path, ctx, kPeerGen, threads, fa == 1));
  }
  fmt::print("{:<34} {:>9} {:>9} | {:>8} {:>8} {:>8} {:>8} | {:>10}\n", "engine", "tokens/s", "ms/step", "score",
             "select", "attend", "rest", "read KiB");
  double tps[2];
  for (int e = 0; e < 2; ++e) {
    const double step = median(split[e].step), score = median(split[e].score);
    const double sel = median(split[e].select), att = median(split[e].attend);
    tps[e] = 1.0 / step;
    const std::string label = e == 0 ? "locks, dense" : fmt::format("locks, LOCKS (budget {})", a.budget);
    fmt::print("{:<34} {:>9.1f} {:>9.2f} | {:>8.2f} {:>8.2f} {:>8.2f} {:>8.2f} | {:>10.0f}\n", label, tps[e],
               1e3 * step, 1e3 * score, 1e3 * (sel - score), 1e3 * att, 1e3 * (step - sel - att), kib[e]);
  }
  fmt::print(
      "(ms per step, medians; score = Eq. 4 over every page, select = shares + top-k, attend = decode attention, "
      "rest = matmuls, norms, RoPE, sampling; dense reads {:.0f} KiB/step)\n",
      dense_kib);
  fmt::print("LOCKS / locks dense: {:.2f}x\n", tps[1] / tps[0]);
  if (!a.peer.empty()) {
    const double off = median(peer_tps[0]), on = median(peer_tps[1]), best = std::max(off, on);
    fmt::print("{:<34} {:>9.1f}\n{:<34} {:>9.1f}\n", "llama.cpp, flash-attn off", off, "llama.cpp, flash-attn on", on);
    fmt::print("vs llama.cpp's best dense decode ({:.1f} tokens/s): LOCKS {:.2f}x, locks dense {:.2f}x\n", best,
               tps[1] / best, tps[0] / best);
  }
}

// ---- CUDA (`--device cuda`) ----
// The GPU benchmark (src/cuda/bench_cuda.cu): the paper's model shapes by default; --contexts / --kv-heads /
// --group / --head-dim given explicitly select one custom shape instead.
int bench_cuda(const BenchArgs& a, bool custom_shape, bool budget_given, bool runs_given) {
#ifdef LOCKS_WITH_CUDA
  cuda::BenchOptions o;
  if (custom_shape) o.shapes = {{"custom", a.n_head_kv, a.n_group, a.head_dim, a.contexts}};
  o.batches = a.batches;
  o.budget_tokens = budget_given ? a.budget : 2048;
  if (runs_given) o.runs = a.runs;
  o.csv = a.csv;
  o.bf16 = !a.f16;
  o.pdl = !a.no_pdl;
  o.ragged = a.ragged;
  o.balance = !a.no_balance;
  return cuda::run_bench(o);
#else
  (void)a;
  (void)custom_shape;
  (void)budget_given;
  (void)runs_given;
  throw std::runtime_error(
      "--device cuda: this build of locks has no CUDA backend (nvcc was not found when it was configured, or "
      "-DLOCKS_CUDA=OFF)");
#endif
}

// Whole models on the GPU (src/cuda/bench_e2e.cpp): the default shapes, or those --shapes names, at
// their contexts or at --contexts.
int bench_cuda_e2e(const BenchArgs& a, bool contexts_given, bool budget_given, bool runs_given) {
#ifdef LOCKS_WITH_CUDA
  cuda::E2eOptions o;
  for (cuda::E2eShape sh : cuda::default_e2e_shapes()) {
    if (!a.shapes.empty() && std::find(a.shapes.begin(), a.shapes.end(), sh.name) == a.shapes.end()) continue;
    if (contexts_given) sh.contexts = a.contexts;
    o.shapes.push_back(sh);
  }
  for (const std::string& name : a.shapes)
    if (std::none_of(o.shapes.begin(), o.shapes.end(), [&](const cuda::E2eShape& sh) { return sh.name == name; })) {
      std::string known;
      for (const auto& sh : cuda::default_e2e_shapes()) known += (known.empty() ? "" : ", ") + sh.name;
      throw CLI::ValidationError("--shapes", fmt::format("unknown shape '{}' (known: {})", name, known));
    }
  o.batches = a.batches;
  o.budget_tokens = budget_given ? a.budget : 2048;
  if (runs_given) o.steps = a.runs;
  o.csv = a.csv;
  o.cublas_decode = a.cublas_decode;
  return cuda::run_e2e_bench(o);
#else
  (void)a;
  (void)contexts_given;
  (void)budget_given;
  (void)runs_given;
  return bench_cuda(a, false, false, false);  // the same "built without CUDA" error
#endif
}
// ---- end CUDA ----

}  // namespace

Runner add_bench(CLI::App& app) {
  auto a = std::make_shared<BenchArgs>();
  CLI::Option* o_ctx =
      app.add_option("--contexts", a->contexts, "context lengths in tokens for the attention benchmark (comma list)")
          ->delimiter(',')
          ->transform(decimal_integer())
          ->check(CLI::Range(32, 1 << 24))
          ->capture_default_str();
  CLI::Option* o_kv = app.add_option("--kv-heads", a->n_head_kv, "KV heads")
                          ->transform(decimal_integer())
                          ->check(CLI::Range(1, 64))
                          ->capture_default_str();
  CLI::Option* o_grp = app.add_option("--group", a->n_group, "query heads per KV head (G)")
                           ->transform(decimal_integer())
                           ->check(CLI::Range(1, 64))
                           ->capture_default_str();
  CLI::Option* o_hd = app.add_option("--head-dim", a->head_dim, "head dimension (multiple of 8, <= 256)")
                          ->transform(decimal_integer())
                          ->check(CLI::Range(8, 256))
                          ->capture_default_str();
  CLI::Option* o_bud = app.add_option("-b,--budget", a->budget, "LOCKS budget in tokens (multiple of 16; cuda: 2048)")
                           ->transform(decimal_integer())
                           ->check(CLI::Range(32, 1 << 24))
                           ->capture_default_str();
  CLI::Option* o_runs =
      app.add_option("--runs", a->runs,
                     "timed runs per context (median reported; cuda: 30; cuda --e2e: decode steps, 24)")
          ->transform(decimal_integer())
          ->check(CLI::Range(1, 10000))
          ->capture_default_str();
  // ---- CUDA (`--device cuda`) ----
  app.add_option("--device", a->device,
                 "cpu (default) or cuda: the GPU kernels on Llama-3.1-8B (8 KV heads x 4, d 128; 32K/128K/256K "
                 "tokens) and GLM-4-9B-1M (4 KV heads x 8 and 2 x 16, d 128; 128K/256K/1M tokens) shapes, or "
                 "one custom shape when --contexts/--kv-heads/--group/--head-dim are given")
      ->capture_default_str()
      ->check(CLI::IsMember({"cpu", "cuda"}));
  const std::vector<CLI::Option*> cuda_only = {
      app.add_option("--batches", a->batches, "cuda: batch sizes")
          ->delimiter(',')
          ->transform(decimal_integer())
          ->check(CLI::Range(1, 256))
          ->capture_default_str(),
      app.add_option("--csv", a->csv, "cuda: also write the results as CSV to this path")->check(non_empty_path()),
      app.add_flag("--f16", a->f16, "cuda: f16 KV instead of bf16"),
      app.add_flag("--no-pdl", a->no_pdl, "cuda: launch the step's kernels without programmatic dependent launch"),
      app.add_flag("--ragged", a->ragged,
                   "cuda: sequence b of a batch holds context / 2^b tokens (one long sequence, ever shorter ones) "
                   "instead of context each"),
      app.add_flag("--no-balance", a->no_balance,
                   "cuda: every sequence gets the same share of the GPU, sized by the longest (no run-time "
                   "balancing of the score pass and dense attention; batch-invariant results)"),
      app.add_flag("--e2e", a->e2e,
                   "cuda: whole models (random bf16 weights made on the GPU): per-token decode latency dense vs "
                   "LOCKS, the dense roofline, where a LOCKS step's time goes, TTFT of a real prefill"),
      app.add_flag("--cublas-decode", a->cublas_decode,
                   "cuda --e2e: decode's weight products through cuBLAS instead of our GEMV (to compare them)"),
      app.add_option("--shapes", a->shapes,
                     "cuda --e2e: model shapes (default: all of llama3.1-8b, glm4-9b-1m-kv4, glm4-9b-1m-kv2); "
                     "--contexts then replaces each shape's contexts")
          ->delimiter(',')};
  // ---- end CUDA ----
  const std::vector<CLI::Option*> cpu_only = {
      app.add_option("-m,--model", a->model, "cpu: GGUF model for the engine benchmark")->check(non_empty_path()),
      app.add_flag("--skip-model", a->skip_model, "cpu: only the attention benchmark"),
      app.add_flag("--skip-attention", a->skip_attention, "cpu: only the engine benchmark"),
      app.add_option("--threads", a->threads, "cpu: CPU threads (default: all cores)")
          ->transform(decimal_integer())
          ->check(CLI::Range(1, 1024)),
      app.add_option("--rounds", a->rounds,
                     "cpu: alternating rounds of the engine benchmark's decode comparison (medians reported)")
          ->transform(decimal_integer())
          ->check(CLI::Range(1, 100))
          ->capture_default_str(),
      app.add_option("--peer", a->peer,
                     "cpu: llama.cpp's llama-bench binary; runs it on the same model and context (-p 0 -n 64 -d "
                     "<context> -t <threads>, flash-attn off and on) alternating with our engine, and prints the "
                     "ratios")
          ->check(CLI::ExistingFile)
          ->check(CLI::Validator(
              [](std::string& p) -> std::string {
                return ::access(p.c_str(), X_OK) == 0 ? "" : "'" + p + "' is not an executable file";
              },
              "EXECUTABLE"))};
  return [a, o_ctx, o_kv, o_grp, o_hd, o_bud, o_runs, cuda_only, cpu_only, &app_ref = app] {
    if (a->budget % 16 != 0)
      throw CLI::ValidationError("--budget", fmt::format("{} is not a multiple of the page size 16", a->budget));
    if (const std::string r = first_repeat(a->contexts); !r.empty())
      throw CLI::ValidationError("--contexts", r + " given twice");
    if (const std::string r = first_repeat(a->batches); !r.empty())
      throw CLI::ValidationError("--batches", r + " given twice");
    for (const CLI::Option* o : a->device == "cuda" ? cpu_only : cuda_only)
      if (o->count() > 0)
        throw CLI::ValidationError(o->get_name(), a->device == "cuda" ? "does not apply with --device cuda"
                                                                      : "only applies with --device cuda");
    if (a->skip_model && a->skip_attention)
      throw CLI::ValidationError("--skip-model", "with --skip-attention leaves nothing to run");
    if (a->skip_model && !a->model.empty())
      throw CLI::ValidationError("--model", "does not apply with --skip-model (the model is not loaded)");
    if (a->skip_model && !a->peer.empty())
      throw CLI::ValidationError("--peer", "does not apply with --skip-model (it compares the engine)");
    if (a->skip_attention && a->device != "cuda")  // the engine benchmark has its own shapes and timing
      for (const CLI::Option* o : {o_ctx, o_kv, o_grp, o_hd, o_runs})
        if (o->count() > 0)
          throw CLI::ValidationError(o->get_name(), "applies to the attention benchmark, which --skip-attention skips");
    // ---- CUDA (`--device cuda`) ----
    if (a->device == "cuda") {
      if (a->e2e) {
        for (const CLI::Option* o : {o_kv, o_grp, o_hd})
          if (o->count() > 0) throw CLI::ValidationError(o->get_name(), "does not apply with --e2e (--shapes)");
        for (const char* flag : {"--f16", "--no-pdl", "--ragged", "--no-balance"})
          if (app_ref.count(flag) > 0) throw CLI::ValidationError(flag, "does not apply with --e2e");
        if (const std::string r = first_repeat(a->shapes); !r.empty())
          throw CLI::ValidationError("--shapes", r + " given twice");
        return bench_cuda_e2e(*a, o_ctx->count() > 0, o_bud->count() > 0, o_runs->count() > 0);
      }
      if (!a->shapes.empty()) throw CLI::ValidationError("--shapes", "applies with --e2e");
      if (a->cublas_decode) throw CLI::ValidationError("--cublas-decode", "applies with --e2e");
      // The kernels' shapes, checked before the device is touched (src/cuda: make_decode_plan).
      if (o_hd->count() > 0 && a->head_dim != 64 && a->head_dim != 128)
        throw CLI::ValidationError("--head-dim",
                                   "--device cuda supports 64 and 128, not " + std::to_string(a->head_dim));
      if (o_grp->count() > 0 && a->n_group > 16)
        throw CLI::ValidationError("--group",
                                   "--device cuda supports GQA groups 1 to 16, not " + std::to_string(a->n_group));
      return bench_cuda(*a, o_ctx->count() + o_kv->count() + o_grp->count() + o_hd->count() > 0, o_bud->count() > 0,
                        o_runs->count() > 0);
    }
    // ---- end CUDA ----
    if (a->head_dim % 8 != 0) throw CLI::ValidationError("--head-dim", "must be a multiple of 8");
    if (a->threads > 0) omp_set_num_threads(a->threads);
    if (!a->skip_attention) bench_attention(*a);
    if (!a->skip_model) bench_model(*a);
    return 0;
  };
}

}  // namespace locks::cli
