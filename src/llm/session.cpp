// A Session: one sequence, its device's operations (CpuForward or the CUDA engine) and the forward
// pass over them (llama_forward). Checks that do not depend on the device live here.
#include "locks/session.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "cpu_forward.h"
#ifdef LOCKS_WITH_CUDA
#include "locks/cuda/engine.h"
#endif

namespace locks {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPageSize = 16;

#ifdef LOCKS_WITH_CUDA
cuda::EngineConfig engine_config(const SessionConfig& cfg, int n_ctx, int budget_pages, int prefill_chunk) {
  if (const std::string why = device_refusal(Device::kCuda, cfg.selector, cfg.selector_opts); !why.empty())
    throw std::invalid_argument(why);
  cuda::EngineConfig ec;
  ec.n_ctx = n_ctx;
  ec.max_seqs = 1;
  ec.max_rows = prefill_chunk;
  ec.kv_dtype = cfg.cuda.kv_bf16 ? cuda::KvType::kBF16 : cuda::KvType::kF16;
  ec.locks = cfg.selector == "locks";
  ec.oracle = cfg.selector == "oracle";
  ec.budget_pages = budget_pages;
  ec.weights = cfg.cuda.weights == CudaSessionOptions::Weights::kBF16  ? cuda::EngineWeights::kBF16
               : cfg.cuda.weights == CudaSessionOptions::Weights::kF32 ? cuda::EngineWeights::kF32
                                                                       : cuda::EngineWeights::kAuto;
  ec.device = cfg.cuda.gpu;
  return ec;
}
#endif

}  // namespace

std::string device_refusal(Device device, const std::string& selector, const SelectorOptions& opts) {
  if (device != Device::kCuda) return "";
  if (selector != "full" && selector != "locks" && selector != "oracle")
    return fmt::format("selector '{}' runs on the CPU only: --device cuda decodes with full, locks or oracle",
                       selector);
  if (selector == "oracle" && !same_selector("oracle", opts, "oracle", SelectorOptions{}))
    return fmt::format("--device cuda runs the oracle with the share-average rule, not '{}'",
                       describe_selector("oracle", opts));
  if (selector == "locks" && !same_selector("locks", opts, "locks", SelectorOptions{}))
    return fmt::format(
        "--device cuda runs LOCKS with its shipped summary (r=8, int4 basis, int8 coefficients and centroid, "
        "share-average), not '{}'",
        describe_selector("locks", opts));
  return "";
}

std::string device_unavailable(Device device) {
  if (device != Device::kCuda) return "";
#ifdef LOCKS_WITH_CUDA
  std::string why;
  return cuda::device_available(&why) ? "" : "--device cuda: " + why;
#else
  return "--device cuda: this build of locks has no CUDA backend (nvcc was not found when it was configured, or "
         "-DLOCKS_CUDA=OFF)";
#endif
}

std::string device_name(Device d) { return d == Device::kCuda ? "cuda" : "cpu"; }
Device parse_device(const std::string& s) {
  if (s == "cpu") return Device::kCpu;
  if (s == "cuda") return Device::kCuda;
  throw std::invalid_argument(fmt::format("unknown device '{}' (cpu or cuda)", s));
}

Session::Session(const LlamaModel& model, const SessionConfig& cfg)
    : model_(model), cfg_(cfg), n_ctx_(cfg.n_ctx != 0 ? cfg.n_ctx : model.hp.n_ctx_train) {
  if (n_ctx_ <= 0 || n_ctx_ > kMaxContextTokens)
    throw std::invalid_argument(
        cfg.n_ctx != 0 ? fmt::format("context size {} outside [1, 2^26] tokens", n_ctx_)
                       : fmt::format("the model's context length {} is outside [1, 2^26] tokens: set a context "
                                     "size (SessionConfig::n_ctx; `locks run -c`)",
                                     n_ctx_));
  budget_pages_ = check_budget(cfg.budget_tokens, kPageSize);
  if (cfg.prefill_chunk < 0) throw std::invalid_argument("prefill chunk must be positive");
  prefill_chunk_ = cfg.prefill_chunk > 0 ? cfg.prefill_chunk : cfg.device == Device::kCuda ? 4096 : 512;
  if (cfg.device == Device::kCuda) {
#ifdef LOCKS_WITH_CUDA
    ops_ = cuda::make_cuda_forward(model, engine_config(cfg, n_ctx_, budget_pages_, prefill_chunk_));
#else
    throw std::runtime_error(device_unavailable(Device::kCuda));
#endif
  } else {
    KvCacheConfig c;
    c.n_layer = model.hp.n_layer;
    c.n_head_kv = model.hp.n_head_kv;
    c.head_dim = model.hp.head_dim;
    c.page_size = kPageSize;
    c.n_pages = (n_ctx_ + kPageSize - 1) / kPageSize;
    c.dtype = cfg.kv_dtype;
    // The cache first: a context the system cannot map is refused before the selector is made.
    auto cpu = std::make_unique<CpuForward>(model, c, nullptr, budget_pages_);
    cpu->set_selector(make_selector(cfg.selector, cpu->cache().config(), cfg.selector_opts), budget_pages_);
    cpu_ = cpu.get();
    ops_ = std::move(cpu);
  }
}

Session::Session(const Session& o)
    : model_(o.model_),
      cfg_(o.cfg_),
      n_ctx_(o.n_ctx_),
      budget_pages_(o.budget_pages_),
      prefill_chunk_(o.prefill_chunk_),
      logits_(o.logits_),
      totals_(o.totals_) {
  auto cpu = std::make_unique<CpuForward>(o.cpu("a copy of the Session"));
  cpu_ = cpu.get();
  ops_ = std::move(cpu);
}

Session::~Session() = default;

CpuForward& Session::cpu(const char* what) const {
  if (!cpu_)
    throw std::logic_error(
        fmt::format("{}: the sequence is on the GPU (--device cuda); this needs the CPU engine", what));
  return *cpu_;
}

int32_t Session::n_tokens() const { return ops_->n_tokens(0); }

const PagedKvCache& Session::cache() const { return cpu("Session::cache").cache(); }
const KvSequence& Session::sequence() const { return cpu("Session::sequence").sequence(); }
const Selector& Session::selector() const { return cpu("Session::selector").selector(); }

void Session::set_observer(DecodeObserver* observer) {
  if (!cpu_ && !observer) return;
  cpu("an observer (the fidelity probe reads the KV cache)").set_observer(observer);
}

int Session::check_budget(int budget_tokens, int B) {
  if (budget_tokens < 2 * B || budget_tokens % B != 0)
    throw std::invalid_argument(
        fmt::format("budget {} tokens: must be a multiple of the page size {} and at least {} (sink + recent page)",
                    budget_tokens, B, 2 * B));
  return budget_tokens / B;
}

Session Session::fork(const SessionConfig& cfg) const {
  check_budget(cfg.budget_tokens, kPageSize);  // before the (costly) metadata build
  if (!cpu_) return fork_on_gpu(cfg);
  return fork_with(cfg, prepare_selector(cfg));
}

Session::Session(const Session& base, const SessionConfig& cfg, std::unique_ptr<ForwardOps> ops)
    : model_(base.model_),
      cfg_(cfg),
      n_ctx_(base.n_ctx_),
      budget_pages_(check_budget(cfg.budget_tokens, kPageSize)),
      prefill_chunk_(base.prefill_chunk_),
      ops_(std::move(ops)),
      logits_(base.logits_) {}

Session Session::fork_on_gpu(const SessionConfig& cfg) const {
  SessionConfig c = cfg_;
  c.selector = cfg.selector;
  c.budget_tokens = cfg.budget_tokens;
  c.selector_opts = cfg.selector_opts;
#ifdef LOCKS_WITH_CUDA
  const int budget_pages = check_budget(c.budget_tokens, kPageSize);
  return Session(*this, c, cuda::cuda_fork(*ops_, engine_config(c, n_ctx_, budget_pages, prefill_chunk_)));
#else
  throw std::logic_error("Session::fork: a GPU session in a build without CUDA");
#endif
}

Session Session::fork(const SessionConfig& cfg, const Selector& prepared) const {
  if (prepared.name() != cfg.selector)
    throw std::invalid_argument(
        fmt::format("fork: the prepared selector is '{}', the config names '{}'", prepared.name(), cfg.selector));
  if (!same_selector(prepared.name(), prepared.options(), cfg.selector, cfg.selector_opts))
    throw std::invalid_argument(fmt::format("fork: the prepared selector was made as '{}', the config asks for '{}'",
                                            describe_selector(prepared.name(), prepared.options()),
                                            describe_selector(cfg.selector, cfg.selector_opts)));
  return fork_with(cfg, prepared.clone());
}

std::unique_ptr<Selector> Session::prepare_selector(const SessionConfig& cfg) const {
  const CpuForward& c = cpu("Session::prepare_selector");
  std::unique_ptr<Selector> sel = make_selector(cfg.selector, c.cache().config(), cfg.selector_opts);
  const KvSequence& seq = c.sequence();
  const std::vector<int32_t> full(seq.page_table.begin(), seq.page_table.begin() + seq.n_tokens / kPageSize);
  if (!full.empty())
    for (int il = 0; il < model_.hp.n_layer; ++il) sel->on_pages_filled(c.cache(), il, full);
  sel->prepare_for_decode(c.cache(), seq);
  return sel;
}

Session Session::fork_with(const SessionConfig& cfg, std::unique_ptr<Selector> selector) const {
  Session s(*this);
  s.cfg_.selector = cfg.selector;
  s.cfg_.budget_tokens = cfg.budget_tokens;
  s.cfg_.selector_opts = cfg.selector_opts;
  s.budget_pages_ = check_budget(cfg.budget_tokens, kPageSize);
  s.cpu_->set_selector(std::move(selector), s.budget_pages_);
  s.totals_ = {};
  return s;
}

const std::vector<float>& Session::prefill(std::span<const int32_t> tokens) {
  if (tokens.empty()) throw std::invalid_argument("prefill: no tokens");
  for (size_t off = 0; off < tokens.size(); off += size_t(prefill_chunk_))
    forward(tokens.subspan(off, std::min(tokens.size() - off, size_t(prefill_chunk_))), false);
  return logits_;
}

const std::vector<float>& Session::decode(int32_t token) {
  const auto t0 = Clock::now();
  forward(std::span<const int32_t>(&token, 1), true);
  totals_.seconds += std::chrono::duration<double>(Clock::now() - t0).count();
  totals_.steps += 1;
  return logits_;
}

void Session::forward(std::span<const int32_t> tokens, bool decode_step) {
  const LlamaHparams& hp = model_.hp;
  const int T = static_cast<int>(tokens.size());
  if (int64_t(n_tokens()) + T > n_ctx_)
    throw std::length_error(fmt::format("sequence of {} tokens would exceed the context size of {} tokens",
                                        int64_t(n_tokens()) + T, n_ctx_));
  for (int32_t id : tokens)
    if (id < 0 || id >= hp.n_vocab)
      throw std::out_of_range(fmt::format("token id {} outside the vocabulary [0, {})", id, hp.n_vocab));
  llama_forward(*ops_, hp.n_layer, ForwardStep{tokens, decode_step, &totals_});
  logits_.resize(hp.n_vocab);
  ops_->read_logits(0, logits_);
}

}  // namespace locks
