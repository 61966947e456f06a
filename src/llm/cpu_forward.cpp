// ForwardOps on the CPU (cpu_forward.h): each operation of llama_forward on float32 host buffers.
#include "cpu_forward.h"

#include <fmt/format.h>
#include <omp.h>

#include <Eigen/Core>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <initializer_list>
#include <stdexcept>

#include "cpu_gemv.h"
#include "locks/attention.h"
#include "locks/parallel_for.h"

namespace locks {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

using RowMat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MapC = Eigen::Map<const RowMat>;

struct Product {
  const Matrix& W;
  float* y;
};

// y[T][W.rows] = x[T][W.cols] * W^T for each product sharing x, in one OpenMP region (a fork/join
// costs tens of microseconds with passive waiting). Each thread owns a slice of every W's rows, so the
// weights are read once in total; one token (decode) reads Q8_0 codes where the matrix has them.
void matmul(const float* x, int T, std::initializer_list<Product> products) {
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), it = omp_get_thread_num();
    for (const Product& p : products) {
      const Matrix& W = p.W;
      const int chunk = (W.rows + nt - 1) / nt;
      const int r0 = std::min(W.rows, it * chunk), r1 = std::min(W.rows, r0 + chunk);
      if (r1 <= r0) continue;
      if (T == 1 && W.has_q8()) {
        gemv_q8(W, x, r0, r1, p.y + r0);
        continue;
      }
      const MapC X(x, T, W.cols);
      Eigen::Map<RowMat> Y(p.y, T, W.rows);
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

// RoPE on v: [n_heads][head_dim] of one token: pair i of the first n_rot dims of each head turns by
// pos * inv_freq[i]. kNormal pairs dims (2i, 2i+1) (llama.cpp LLAMA_ROPE_TYPE_NORM), kNeox pairs
// (i, i + n_rot/2) (LLAMA_ROPE_TYPE_NEOX).
void rope(float* v, int n_heads, int head_dim, int n_rot, RopeStyle style, int32_t pos,
          const std::vector<double>& inv_freq) {
  const int half = n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const double a = double(pos) * inv_freq[i];
    const float c = float(std::cos(a)), s = float(std::sin(a));
    const int i0 = style == RopeStyle::kNeox ? i : 2 * i, i1 = style == RopeStyle::kNeox ? i + half : 2 * i + 1;
    for (int h = 0; h < n_heads; ++h) {
      float* p = v + size_t(h) * head_dim;
      const float x0 = p[i0], x1 = p[i1];
      p[i0] = x0 * c - x1 * s;
      p[i1] = x0 * s + x1 * c;
    }
  }
}

}  // namespace

CpuForward::CpuForward(const LlamaModel& model, const KvCacheConfig& cache_cfg, std::unique_ptr<Selector> selector,
                       int budget_pages)
    : model_(model), cache_(cache_cfg), selector_(std::move(selector)), budget_pages_(budget_pages) {
  const auto& hp = model.hp;
  // base^(-2i/n_rot), divided by rope_freqs[i] where the model scales its RoPE (Llama-3.1).
  for (int i = 0; i < hp.n_rot / 2; ++i)
    inv_freq_.push_back(std::pow(double(hp.rope_freq_base), -2.0 * i / hp.n_rot) /
                        (model.rope_freqs.empty() ? 1.0 : double(model.rope_freqs[i])));
  logits_.assign(hp.n_vocab, 0.0f);
}

CpuForward::CpuForward(const CpuForward& o)
    : model_(o.model_),
      cache_(o.cache_),
      seq_(o.seq_),
      selector_(o.selector_->clone()),
      budget_pages_(o.budget_pages_),
      inv_freq_(o.inv_freq_),
      logits_(o.logits_) {}

void CpuForward::set_selector(std::unique_ptr<Selector> selector, int budget_pages) {
  selector_ = std::move(selector);
  budget_pages_ = budget_pages;
}

bool CpuForward::begin(const ForwardStep& step) {
  const LlamaHparams& hp = model_.hp;
  const size_t T = step.tokens.size();
  tokens_ = step.tokens;
  decode_ = step.decode;
  totals_ = step.totals;
  const int B = cache_.page_size();
  pos0_ = cache_.append_tokens(seq_, int(T));
  // Pages that this forward completes; their summaries are built per layer once K is written.
  filled_.clear();
  for (int32_t p = pos0_ / B; p < seq_.n_tokens / B; ++p) filled_.push_back(seq_.page_table[p]);
  x_.resize(T * hp.n_embd);
  xn_.resize(T * hp.n_embd);
  q_.resize(T * hp.n_head * hp.head_dim);
  att_.resize(q_.size());
  k_.resize(T * hp.n_head_kv * hp.head_dim);
  v_.resize(k_.size());
  gate_.resize(T * hp.n_ff);
  up_.resize(gate_.size());
  tmp_.resize(x_.size());
  return true;
}

void CpuForward::embed() {
  const int E = model_.hp.n_embd;
  for (size_t t = 0; t < tokens_.size(); ++t) std::copy_n(&model_.tok_embd.data[size_t(tokens_[t]) * E], E, &x_[t * E]);
}

void CpuForward::rmsnorm(int il, NormWeight w) {
  const LlamaHparams& hp = model_.hp;
  const int T = int(tokens_.size()), E = hp.n_embd;
  if (w == NormWeight::kOutput)  // logits of the last token only
    locks::rmsnorm(&x_[size_t(T - 1) * E], model_.output_norm.data(), 1, E, hp.rms_eps, xn_.data());
  else
    locks::rmsnorm(x_.data(),
                   (w == NormWeight::kAttention ? model_.layers[il].attn_norm : model_.layers[il].ffn_norm).data(), T,
                   E, hp.rms_eps, xn_.data());
}

void CpuForward::qkv(int il) {
  const LlamaLayer& L = model_.layers[il];
  const int T = int(tokens_.size());
  matmul(xn_.data(), T, {{L.wq, q_.data()}, {L.wk, k_.data()}, {L.wv, v_.data()}});
  if (model_.hp.attn_bias) {
    auto add_bias = [T](std::vector<float>& y, const std::vector<float>& b) {
      for (int t = 0; t < T; ++t)
        for (size_t i = 0; i < b.size(); ++i) y[size_t(t) * b.size() + i] += b[i];
    };
    add_bias(q_, L.bq);
    add_bias(k_, L.bk);
    add_bias(v_, L.bv);
  }
}

void CpuForward::rope_append(int il) {
  const LlamaHparams& hp = model_.hp;
  const int NH = hp.n_head, NKV = hp.n_head_kv, HD = hp.head_dim;
  for (size_t t = 0; t < tokens_.size(); ++t) {
    const int32_t pos = pos0_ + int32_t(t);
    if (hp.attn_qk_norm) {  // each head's q and k RMSNormed over head_dim before RoPE (qwen3)
      const LlamaLayer& L = model_.layers[il];
      locks::rmsnorm(&q_[t * NH * HD], L.attn_q_norm.data(), NH, HD, hp.rms_eps, &q_[t * NH * HD]);
      locks::rmsnorm(&k_[t * NKV * HD], L.attn_k_norm.data(), NKV, HD, hp.rms_eps, &k_[t * NKV * HD]);
    }
    rope(&q_[t * NH * HD], NH, HD, hp.n_rot, hp.rope_style, pos, inv_freq_);
    rope(&k_[t * NKV * HD], NKV, HD, hp.n_rot, hp.rope_style, pos, inv_freq_);
    try {
      cache_.write(il, seq_, pos, &k_[t * NKV * HD], &v_[t * NKV * HD]);  // append
    } catch (const std::invalid_argument& e) {                            // names the model, not only the cache
      throw std::runtime_error(
          fmt::format("model '{}': the forward pass gave token {} of layer {} a key or value "
                      "the KV cache cannot store (NaN/Inf in the weights?): {}",
                      model_.name, pos, il, e.what()));
    }
  }
  if (!filled_.empty()) selector_->on_pages_filled(cache_, il, filled_);  // Alg. 1, batched
}

void CpuForward::attention(int il) {
  const LlamaHparams& hp = model_.hp;
  const int T = int(tokens_.size());
  const int NH = hp.n_head, NKV = hp.n_head_kv, HD = hp.head_dim, G = hp.n_group();
  const float scale = 1.0f / std::sqrt(float(HD));
  if (!decode_) {
    // The last layer's outputs feed only the last token's logits: its other rows' attention is
    // skipped (those rows of att keep stale values; what follows is row-wise and unused).
    const int first_query = il == hp.n_layer - 1 ? T - 1 : 0;
    paged_prefill_attention(cache_, il, seq_, pos0_, T, q_.data(), NH, scale, att_.data(), first_query);
    return;
  }
  // Alg. 2 per GQA group: select pages from the group's queries, then exact attention over them.
  const bool observed = observer_ && observer_->enabled();
  std::vector<Selection> sel(NKV);
  std::vector<double> sel_seconds(NKV, 0.0), att_seconds(NKV, 0.0);
  const auto t0 = Clock::now();
  // Each KV head selects then attends in one task: its attention needs only its own selection, so
  // there is no barrier between the two.
  parallel_for(NKV, [&](int h) {
    const auto t_h = Clock::now();
    SelectionRequest req;
    req.q = &q_[size_t(h) * G * HD];
    req.n_group = G;
    req.il = il;
    req.kv_head = h;
    req.seq = &seq_;
    req.budget_pages = budget_pages_;
    req.want_estimates = observed;
    if (seq_.n_pages() <= budget_pages_ && !selector_->adaptive_budget()) {
      // The budget covers every page: attention is dense, nothing to score or read twice.
      sel[h].pages.resize(seq_.n_pages());
      for (int32_t j = 0; j < seq_.n_pages(); ++j) sel[h].pages[j] = j;
      sel[h].bytes_read = 0;
      sel[h].all_pages = true;
    } else {
      selector_->select(cache_, req, sel[h]);
    }
    const auto t_att = Clock::now();
    sel_seconds[h] = std::chrono::duration<double>(t_att - t_h).count();
    paged_decode_attention(cache_, il, h, seq_, sel[h].pages, &q_[size_t(h) * G * HD], G, scale,
                           &att_[size_t(h) * G * HD], nullptr);
    att_seconds[h] = seconds_since(t_att);
  });
  if (totals_) {
    // The heads' busy time split into score / select / attend, applied to the wall time.
    const double wall = seconds_since(t0);
    double selecting = 0, attending = 0, scoring = 0;
    for (int h = 0; h < NKV; ++h)
      selecting += sel_seconds[h], attending += att_seconds[h], scoring += sel[h].score_seconds;
    if (const double busy = selecting + attending; busy > 0) {
      totals_->select_seconds += wall * selecting / busy;
      totals_->score_seconds += wall * std::min(selecting, scoring) / busy;
      totals_->attend_seconds += wall * attending / busy;
    }
  }
  if (observed) {
    parallel_for(NKV, [&](int h) {
      observer_->observe(cache_, seq_, *selector_, il, h, &q_[size_t(h) * G * HD], G, budget_pages_, sel[h]);
    });
  }
  if (totals_)
    for (int h = 0; h < NKV; ++h) {
      totals_->bytes_read += double(step_bytes_read(cache_, seq_, sel[h]));
      totals_->dense_bytes += double(cache_.kv_bytes(seq_.n_tokens));
      const size_t kept = sel[h].pages.size();
      if (totals_->pages_kept.size() <= kept) totals_->pages_kept.resize(kept + 1, 0);
      ++totals_->pages_kept[kept];
      if (sel[h].mass_target_met >= 0) {
        ++totals_->mass_target_tried;
        totals_->mass_target_met += sel[h].mass_target_met;
      }
    }
}

void CpuForward::project_add(int il, Projection p) {
  const LlamaLayer& L = model_.layers[il];
  const int T = int(tokens_.size());
  if (p == Projection::kOutput)
    matmul(att_.data(), T, {{L.wo, tmp_.data()}});
  else
    matmul(gate_.data(), T, {{L.w_down, tmp_.data()}});
  for (size_t i = 0; i < x_.size(); ++i) x_[i] += tmp_[i];
}

void CpuForward::gate_up_swiglu(int il) {
  const LlamaLayer& L = model_.layers[il];
  const int T = int(tokens_.size());
  matmul(xn_.data(), T, {{L.w_gate, gate_.data()}, {L.w_up, up_.data()}});
  for (size_t i = 0; i < gate_.size(); ++i) gate_[i] = gate_[i] / (1.0f + std::exp(-gate_[i])) * up_[i];
}

void CpuForward::logits() { matmul(xn_.data(), 1, {{model_.output_matrix(), logits_.data()}}); }

void CpuForward::read_logits(int seq, std::span<float> out) {
  if (seq != 0 || out.size() != logits_.size()) throw std::invalid_argument("CpuForward: one sequence, n_vocab logits");
  std::copy(logits_.begin(), logits_.end(), out.begin());
}

}  // namespace locks
