// A float64 forward pass of a LlamaModel for tests, written straight from the architecture
// descriptions (model.h): every product, norm, rotation and softmax in double, causal attention over
// the whole prompt, the logits of its last position. Optionally the input of every matrix product
// is rounded as llama.cpp's Q8_K activation quantization does (blocks of 256, scale max/-128 of the
// signed extreme, codes clamped to 127), to measure that noise.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "locks/model.h"

namespace locks::test {

struct RefForwardOptions {
  bool q8_activations = false;  // round each matrix product's input as ggml's quantize_row_q8_K
  /// Scales each product input by (1 + jitter) before the rounding: another realization of the same
  /// rounding noise (codes near a rounding boundary flip).
  double jitter = 0;
};

/// Logits [n_vocab] at the last of `tokens` (positions 0..T-1), float64.
inline std::vector<double> ref_forward_last_logits(const LlamaModel& m, const std::vector<int32_t>& tokens,
                                                   const RefForwardOptions& opt = {}) {
  const LlamaHparams& hp = m.hp;
  const int T = int(tokens.size()), E = hp.n_embd, HD = hp.head_dim, NH = hp.n_head, NKV = hp.n_head_kv;
  const int G = NH / NKV, F = hp.n_ff;
  using Vec = std::vector<double>;
  auto q8 = [&](Vec x) {
    if (!opt.q8_activations) return x;
    for (size_t b0 = 0; b0 + 256 <= x.size(); b0 += 256) {
      double amax = 0, mx = 0;
      for (size_t i = b0; i < b0 + 256; ++i)
        if (std::abs(x[i]) > amax) amax = std::abs(x[i]), mx = x[i];
      if (amax == 0) continue;
      const float iscale = -128.0f / float(mx);
      for (size_t i = b0; i < b0 + 256; ++i) {
        const int q = std::min(127, int(std::nearbyint(iscale * float(x[i] * (1 + opt.jitter)))));
        x[i] = double(q) * double(1.0f / iscale);
      }
    }
    return x;
  };
  // y = W x for W [rows][cols] float32.
  auto matvec = [&](const Matrix& W, const Vec& xin) {
    const Vec x = q8(xin);
    Vec y(W.rows, 0.0);
    for (int r = 0; r < W.rows; ++r) {
      const float* w = &W.data[size_t(r) * W.cols];
      double acc = 0;
      for (int c = 0; c < W.cols; ++c) acc += double(w[c]) * x[c];
      y[r] = acc;
    }
    return y;
  };
  auto rmsnorm = [&](const double* x, int n, const std::vector<float>& w, double* out) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / n + double(hp.rms_eps));
    for (int i = 0; i < n; ++i) out[i] = x[i] * inv * double(w[i]);
  };
  auto rope = [&](double* head, int pos) {
    for (int i = 0; i < hp.n_rot / 2; ++i) {
      double theta = pos * std::pow(double(hp.rope_freq_base), -2.0 * i / hp.n_rot);
      if (!m.rope_freqs.empty()) theta /= double(m.rope_freqs[i]);
      const int a = hp.rope_style == RopeStyle::kNeox ? i : 2 * i;
      const int b = hp.rope_style == RopeStyle::kNeox ? i + hp.n_rot / 2 : 2 * i + 1;
      const double x0 = head[a], x1 = head[b];
      head[a] = x0 * std::cos(theta) - x1 * std::sin(theta);
      head[b] = x0 * std::sin(theta) + x1 * std::cos(theta);
    }
  };
  std::vector<Vec> x(T, Vec(E));
  for (int t = 0; t < T; ++t)
    for (int i = 0; i < E; ++i) x[t][i] = m.tok_embd.data[size_t(tokens[t]) * E + i];
  for (const LlamaLayer& L : m.layers) {
    std::vector<Vec> q(T), k(T), v(T);
    for (int t = 0; t < T; ++t) {
      Vec xn(E);
      rmsnorm(x[t].data(), E, L.attn_norm, xn.data());
      q[t] = matvec(L.wq, xn), k[t] = matvec(L.wk, xn), v[t] = matvec(L.wv, xn);
      if (hp.attn_bias)
        for (size_t i = 0; i < q[t].size(); ++i) q[t][i] += L.bq[i];
      if (hp.attn_bias)
        for (size_t i = 0; i < k[t].size(); ++i) k[t][i] += L.bk[i], v[t][i] += L.bv[i];
      for (int h = 0; h < NH; ++h) {
        if (hp.attn_qk_norm) rmsnorm(&q[t][size_t(h) * HD], HD, L.attn_q_norm, &q[t][size_t(h) * HD]);
        rope(&q[t][size_t(h) * HD], t);
      }
      for (int h = 0; h < NKV; ++h) {
        if (hp.attn_qk_norm) rmsnorm(&k[t][size_t(h) * HD], HD, L.attn_k_norm, &k[t][size_t(h) * HD]);
        rope(&k[t][size_t(h) * HD], t);
      }
    }
    for (int t = 0; t < T; ++t) {
      Vec att(size_t(NH) * HD, 0.0);
      for (int h = 0; h < NH; ++h) {
        const int kh = h / G;
        Vec s(t + 1);
        double mx = -1e300;
        for (int j = 0; j <= t; ++j) {
          double acc = 0;
          for (int c = 0; c < HD; ++c) acc += q[t][size_t(h) * HD + c] * k[j][size_t(kh) * HD + c];
          s[j] = acc / std::sqrt(double(HD));
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (int j = 0; j <= t; ++j)
          for (int c = 0; c < HD; ++c) att[size_t(h) * HD + c] += s[j] / z * v[j][size_t(kh) * HD + c];
      }
      const Vec o = matvec(L.wo, att);
      for (int i = 0; i < E; ++i) x[t][i] += o[i];
      Vec xn(E);
      rmsnorm(x[t].data(), E, L.ffn_norm, xn.data());
      const Vec g = matvec(L.w_gate, xn), u = matvec(L.w_up, xn);
      Vec act(F);
      for (int i = 0; i < F; ++i) act[i] = g[i] / (1.0 + std::exp(-g[i])) * u[i];
      const Vec d = matvec(L.w_down, act);
      for (int i = 0; i < E; ++i) x[t][i] += d[i];
    }
  }
  Vec xn(E);
  rmsnorm(x[T - 1].data(), E, m.output_norm, xn.data());
  return matvec(m.output_matrix(), xn);
}

}  // namespace locks::test
