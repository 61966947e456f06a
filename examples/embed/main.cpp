// Uses the locks library as an engine would: a paged KV cache, the LOCKS selector and exact attention
// over the pages it keeps (CPU), and, when locks was built with CUDA, the GPU decode-step plan.
// One layer, 2 KV heads x 4 query heads, head_dim 64, 3205 random tokens; the group's queries share a
// direction u, and one token's key lies along it (a "needle" that takes nearly all the attention).
// Prints the pages LOCKS kept and how far its output is from dense attention over every page.
// Exit status 0 when the needle's page is kept and the outputs agree (relative error < 1%).
#include <locks/attention.h>
#include <locks/kv_cache.h>
#include <locks/selector.h>

#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#ifdef LOCKS_WITH_CUDA
#include <locks/cuda/kernels.h>
#endif

int main() {
  using namespace locks;
  const int G = 4, d = 64, T = 16 * 200 + 5, needle = 1234;
  KvCacheConfig cfg;
  cfg.n_head_kv = 2;
  cfg.head_dim = d;
  cfg.n_pages = 256;
  PagedKvCache cache(cfg);
  KvSequence seq;
  cache.append_tokens(seq, T);

  std::mt19937 rng(7);
  std::normal_distribution<float> N(0.0f, 1.0f);
  std::vector<float> u(d), q(size_t(G) * d), k(size_t(cfg.n_head_kv) * d), v(k.size());
  for (float& x : u) x = N(rng);
  for (size_t i = 0; i < q.size(); ++i) q[i] = u[i % d] + 0.3f * N(rng);
  for (int t = 0; t < T; ++t) {
    for (float& x : k) x = N(rng);
    for (float& x : v) x = N(rng);
    if (t == needle)  // both KV heads: a key along u (logits ~16 above the others)
      for (int h = 0; h < cfg.n_head_kv; ++h)
        for (int x = 0; x < d; ++x) k[size_t(h) * d + x] = 2.0f * u[x];
    cache.write(0, seq, t, k.data(), v.data());
  }

  // Summaries of the full pages (an engine does this whenever a page fills), then one decode step.
  auto selector = make_selector("locks", cfg);
  selector->on_pages_filled(cache, 0, std::vector<int32_t>(seq.page_table.begin(), seq.page_table.end() - 1));
  const float scale = 1.0f / std::sqrt(float(d));
  std::vector<int32_t> all(seq.n_pages());
  std::iota(all.begin(), all.end(), 0);
  bool ok = true;
  for (int h = 0; h < cfg.n_head_kv; ++h) {
    SelectionRequest req;
    req.q = q.data();
    req.n_group = G;
    req.kv_head = h;
    req.seq = &seq;
    req.budget_pages = 8;
    Selection sel;
    selector->select(cache, req, sel);
    std::vector<float> o(size_t(G) * d), o_dense(o.size());
    paged_decode_attention(cache, 0, h, seq, sel.pages, q.data(), G, scale, o.data(), nullptr);
    paged_decode_attention(cache, 0, h, seq, all, q.data(), G, scale, o_dense.data(), nullptr);
    double err = 0.0, ref = 0.0;
    for (size_t i = 0; i < o.size(); ++i) {
      err += (o[i] - o_dense[i]) * (o[i] - o_dense[i]);
      ref += o_dense[i] * o_dense[i];
    }
    const double rel = std::sqrt(err / ref);
    bool has_needle = false;
    std::printf("KV head %d: LOCKS kept pages", h);
    for (int32_t j : sel.pages) {
      std::printf(" %d", j);
      has_needle |= j == needle / 16;
    }
    std::printf(" of %d (needle page %d %s); output vs dense: relative error %.2e\n", seq.n_pages(), needle / 16,
                has_needle ? "kept" : "MISSED", rel);
    ok = ok && has_needle && rel < 0.01;
  }

#ifdef LOCKS_WITH_CUDA
  std::string why;
  if (locks::cuda::device_available(&why)) {
    locks::cuda::DecodeShape sh;
    sh.n_head_kv = cfg.n_head_kv;
    sh.group = G;
    sh.head_dim = d;
    sh.max_pages = seq.n_pages();
    sh.budget_pages = 8;
    const auto plan = locks::cuda::make_decode_plan(sh);
    std::printf("CUDA: %s; a decode-step plan needs %zu bytes of workspace\n",
                locks::cuda::device_description().c_str(), plan.workspace_bytes);
  } else {
    std::printf("CUDA: built in, no usable device here (%s)\n", why.c_str());
  }
#endif
  return ok ? 0 : 1;
}
