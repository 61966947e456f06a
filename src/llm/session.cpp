// The Llama forward pass, top to bottom: embed -> per layer {RMSNorm, QKV, RoPE, append K/V to the
// paged cache, attention (dense prefill, or select -> attend in decode), output proj, SwiGLU FFN}
// -> final norm -> logits.
#include "locks/session.h"

#include <Eigen/Core>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "locks/attention.h"
#include "locks/parallel_for.h"

namespace locks {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapC = Eigen::Map<const RowMat>;

// y[T][W.rows] = x[T][W.cols] * W^T (Eigen kernels; each thread owns a slice of W's rows, so the
// weights are read once in total and no thread pool other than OpenMP's is involved).
void matmul(const float* x, int T, const Matrix& W, float* y) {
  const MapC X(x, T, W.cols);
  Eigen::Map<RowMat> Y(y, T, W.rows);
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), it = omp_get_thread_num();
    const int chunk = (W.rows + nt - 1) / nt;
    const int r0 = std::min(W.rows, it * chunk), r1 = std::min(W.rows, r0 + chunk);
    if (r1 > r0) {
      const MapC Wt(W.data.data() + size_t(r0) * W.cols, r1 - r0, W.cols);
      if (T == 1)
        Y.row(0).segment(r0, r1 - r0).noalias() = (Wt * X.row(0).transpose()).transpose();
      else
        Y.middleCols(r0, r1 - r0).noalias() = X * Wt.transpose();
    }
  }
}

// RMSNorm: out = x / sqrt(mean(x^2) + eps) * w, per row of n.
void rmsnorm(const float* x, const float* w, int T, int n, float eps, float* out) {
  for (int t = 0; t < T; ++t) {
    const float* xr = x + size_t(t) * n;
    double ss = 0.0;
    for (int i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
    const float inv = float(1.0 / std::sqrt(ss / n + eps));
    float* o = out + size_t(t) * n;
    for (int i = 0; i < n; ++i) o[i] = xr[i] * inv * w[i];
  }
}

// RoPE "normal" (llama.cpp LLAMA): rotate interleaved pairs (2i, 2i+1) of the first n_rot dims of
// each head by pos * base^(-2i/n_rot). v: [n_heads][head_dim] of one token.
void rope(float* v, int n_heads, int head_dim, int n_rot, int32_t pos, const std::vector<double>& inv_freq) {
  for (int i = 0; i < n_rot / 2; ++i) {
    const double a = double(pos) * inv_freq[i];
    const float c = float(std::cos(a)), s = float(std::sin(a));
    for (int h = 0; h < n_heads; ++h) {
      float* p = v + size_t(h) * head_dim + 2 * i;
      const float x0 = p[0], x1 = p[1];
      p[0] = x0 * c - x1 * s;
      p[1] = x0 * s + x1 * c;
    }
  }
}

}  // namespace

Session::Session(const LlamaModel& model, const SessionConfig& cfg)
    : model_(model),
      cfg_(cfg),
      n_ctx_(cfg.n_ctx != 0 ? cfg.n_ctx : model.hp.n_ctx_train),
      cache_([&] {
        KvCacheConfig c;
        c.n_layer = model.hp.n_layer;
        c.n_head_kv = model.hp.n_head_kv;
        c.head_dim = model.hp.head_dim;
        c.page_size = 16;
        if (n_ctx_ <= 0 || n_ctx_ > kMaxContextTokens)
          throw std::invalid_argument(
              cfg.n_ctx != 0 ? fmt::format("context size {} outside [1, 2^26] tokens", n_ctx_)
                            : fmt::format("the model's context length {} is outside [1, 2^26] tokens: set a context "
                                          "size (SessionConfig::n_ctx; `locks run -c`)",
                                          n_ctx_));
        c.n_pages = (n_ctx_ + c.page_size - 1) / c.page_size;
        c.dtype = cfg.kv_dtype;
        return c;
      }()) {
  budget_pages_ = check_budget(cfg.budget_tokens, cache_.page_size());
  if (cfg.prefill_chunk < 1) throw std::invalid_argument("prefill chunk must be positive");
  selector_ = make_selector(cfg.selector, cache_.config(), cfg.selector_opts);
  const auto& hp = model.hp;
  for (int i = 0; i < hp.n_rot / 2; ++i) inv_freq_.push_back(std::pow(double(hp.rope_freq_base), -2.0 * i / hp.n_rot));
}

Session::Session(const Session& o)
    : model_(o.model_),
      cfg_(o.cfg_),
      n_ctx_(o.n_ctx_),
      budget_pages_(o.budget_pages_),
      cache_(o.cache_),
      seq_(o.seq_),
      selector_(o.selector_->clone()),
      inv_freq_(o.inv_freq_),
      logits_(o.logits_),
      totals_(o.totals_),
      observer_(nullptr) {}

int Session::check_budget(int budget_tokens, int B) {
  if (budget_tokens < 2 * B || budget_tokens % B != 0)
    throw std::invalid_argument(fmt::format(
        "budget {} tokens: must be a multiple of the page size {} and at least {} (sink + recent page)",
        budget_tokens, B, 2 * B));
  return budget_tokens / B;
}

Session Session::fork(const SessionConfig& cfg) const {
  check_budget(cfg.budget_tokens, cache_.page_size());  // before the (costly) metadata build
  return fork_with(cfg, prepare_selector(cfg));
}

Session Session::fork(const SessionConfig& cfg, const Selector& prepared) const {
  if (prepared.name() != cfg.selector)
    throw std::invalid_argument(fmt::format("fork: the prepared selector is '{}', the config names '{}'",
                                            prepared.name(), cfg.selector));
  if (!same_selector(prepared.name(), prepared.options(), cfg.selector, cfg.selector_opts))
    throw std::invalid_argument(fmt::format("fork: the prepared selector was made as '{}', the config asks for '{}'",
                                            describe_selector(prepared.name(), prepared.options()),
                                            describe_selector(cfg.selector, cfg.selector_opts)));
  return fork_with(cfg, prepared.clone());
}

std::unique_ptr<Selector> Session::prepare_selector(const SessionConfig& cfg) const {
  std::unique_ptr<Selector> sel = make_selector(cfg.selector, cache_.config(), cfg.selector_opts);
  const int B = cache_.page_size();
  const std::vector<int32_t> full(seq_.page_table.begin(), seq_.page_table.begin() + seq_.n_tokens / B);
  if (!full.empty())
    for (int il = 0; il < model_.hp.n_layer; ++il) sel->on_pages_filled(cache_, il, full);
  sel->prepare_for_decode(cache_, seq_);
  return sel;
}

Session Session::fork_with(const SessionConfig& cfg, std::unique_ptr<Selector> selector) const {
  Session s(*this);
  s.cfg_.selector = cfg.selector;
  s.cfg_.budget_tokens = cfg.budget_tokens;
  s.cfg_.selector_opts = cfg.selector_opts;
  s.budget_pages_ = check_budget(cfg.budget_tokens, cache_.page_size());
  s.selector_ = std::move(selector);
  s.totals_ = {};
  return s;
}

const std::vector<float>& Session::prefill(std::span<const int32_t> tokens) {
  if (tokens.empty()) throw std::invalid_argument("prefill: no tokens");
  for (size_t off = 0; off < tokens.size(); off += size_t(cfg_.prefill_chunk))
    forward(tokens.subspan(off, std::min(tokens.size() - off, size_t(cfg_.prefill_chunk))), false);
  return logits_;
}

const std::vector<float>& Session::decode(int32_t token) {
  const auto t0 = Clock::now();
  forward(std::span<const int32_t>(&token, 1), true);
  totals_.seconds += seconds_since(t0);
  totals_.steps += 1;
  return logits_;
}

void Session::forward(std::span<const int32_t> tokens, bool decode_step) {
  const LlamaHparams& hp = model_.hp;
  const int T = static_cast<int>(tokens.size());
  const int E = hp.n_embd, HD = hp.head_dim, NH = hp.n_head, NKV = hp.n_head_kv, G = hp.n_group();
  const int B = cache_.page_size();
  if (int64_t(seq_.n_tokens) + T > n_ctx_)
    throw std::length_error(fmt::format("sequence of {} tokens would exceed the context size of {} tokens",
                                        int64_t(seq_.n_tokens) + T, n_ctx_));
  for (int32_t id : tokens)
    if (id < 0 || id >= hp.n_vocab)
      throw std::out_of_range(fmt::format("token id {} outside the vocabulary [0, {})", id, hp.n_vocab));

  const int32_t pos0 = cache_.append_tokens(seq_, T);
  // Pages that this forward completes; their summaries are built per layer once K is written.
  std::vector<int32_t> filled;
  for (int32_t p = pos0 / B; p < seq_.n_tokens / B; ++p) filled.push_back(seq_.page_table[p]);

  std::vector<float> x(size_t(T) * E), xn(size_t(T) * E);        // [T][E]
  std::vector<float> q(size_t(T) * NH * HD), att(size_t(T) * NH * HD);  // [T][NH][HD]
  std::vector<float> k(size_t(T) * NKV * HD), v(size_t(T) * NKV * HD);  // [T][NKV][HD]
  std::vector<float> gate(size_t(T) * hp.n_ff), up(size_t(T) * hp.n_ff);  // [T][n_ff]
  std::vector<float> tmp(size_t(T) * E);
  const float scale = 1.0f / std::sqrt(float(HD));

  for (int t = 0; t < T; ++t)  // embed
    std::copy_n(&model_.tok_embd.data[size_t(tokens[t]) * E], E, &x[size_t(t) * E]);

  for (int il = 0; il < hp.n_layer; ++il) {
    const LlamaLayer& L = model_.layers[il];
    // Attention block.
    rmsnorm(x.data(), L.attn_norm.data(), T, E, hp.rms_eps, xn.data());
    matmul(xn.data(), T, L.wq, q.data());
    matmul(xn.data(), T, L.wk, k.data());
    matmul(xn.data(), T, L.wv, v.data());
    for (int t = 0; t < T; ++t) {
      rope(&q[size_t(t) * NH * HD], NH, HD, hp.n_rot, pos0 + t, inv_freq_);
      rope(&k[size_t(t) * NKV * HD], NKV, HD, hp.n_rot, pos0 + t, inv_freq_);
      try {
        cache_.write(il, seq_, pos0 + t, &k[size_t(t) * NKV * HD], &v[size_t(t) * NKV * HD]);  // append
      } catch (const std::invalid_argument& e) {  // names the model, not only the cache
        throw std::runtime_error(fmt::format("model '{}': the forward pass gave token {} of layer {} a key or value "
                                             "the KV cache cannot store (NaN/Inf in the weights?): {}",
                                             model_.name, pos0 + t, il, e.what()));
      }
    }
    if (!filled.empty()) selector_->on_pages_filled(cache_, il, filled);  // Alg. 1, batched

    if (!decode_step) {
      // The last layer's outputs feed only the last token's logits: its other rows' attention is
      // skipped (those rows of att keep stale values; what follows is row-wise and unused).
      const int first_query = il == hp.n_layer - 1 ? T - 1 : 0;
      paged_prefill_attention(cache_, il, seq_, pos0, T, q.data(), NH, scale, att.data(), first_query);
    } else {
      // Alg. 2 per GQA group: select pages from the group's queries, then exact attention over them.
      const bool observed = observer_ && observer_->enabled();
      std::vector<Selection> sel(NKV);
      const auto t_sel = Clock::now();
      parallel_for(NKV, [&](int h) {
        SelectionRequest req;
        req.q = &q[size_t(h) * G * HD];
        req.n_group = G;
        req.il = il;
        req.kv_head = h;
        req.seq = &seq_;
        req.budget_pages = budget_pages_;
        req.want_estimates = observed;
        if (seq_.n_pages() <= budget_pages_) {
          // The budget covers every page: attention is dense, nothing to score or read twice.
          sel[h].pages.resize(seq_.n_pages());
          for (int32_t j = 0; j < seq_.n_pages(); ++j) sel[h].pages[j] = j;
          sel[h].bytes_read = 0;
          sel[h].all_pages = true;
        } else {
          selector_->select(cache_, req, sel[h]);
        }
      });
      const auto t_att = Clock::now();
      totals_.select_seconds += std::chrono::duration<double>(t_att - t_sel).count();
      parallel_for(NKV, [&](int h) {
        paged_decode_attention(cache_, il, h, seq_, sel[h].pages, &q[size_t(h) * G * HD], G, scale,
                               &att[size_t(h) * G * HD], nullptr);
      });
      totals_.attend_seconds += seconds_since(t_att);
      if (observed) {
        parallel_for(NKV, [&](int h) {
          observer_->observe(cache_, seq_, *selector_, il, h, &q[size_t(h) * G * HD], G, budget_pages_, sel[h]);
        });
      }
      for (int h = 0; h < NKV; ++h) {
        totals_.bytes_read += double(step_bytes_read(cache_, seq_, sel[h]));
        totals_.dense_bytes += double(cache_.kv_bytes(seq_.n_tokens));
      }
    }
    matmul(att.data(), T, L.wo, tmp.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];

    // SwiGLU feed-forward block.
    rmsnorm(x.data(), L.ffn_norm.data(), T, E, hp.rms_eps, xn.data());
    matmul(xn.data(), T, L.w_gate, gate.data());
    matmul(xn.data(), T, L.w_up, up.data());
    for (size_t i = 0; i < gate.size(); ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
    matmul(gate.data(), T, L.w_down, tmp.data());
    for (size_t i = 0; i < x.size(); ++i) x[i] += tmp[i];
  }

  // Logits of the last token only.
  rmsnorm(&x[size_t(T - 1) * E], model_.output_norm.data(), 1, E, hp.rms_eps, xn.data());
  logits_.resize(hp.n_vocab);
  matmul(xn.data(), 1, model_.output_matrix(), logits_.data());
}

}  // namespace locks
