// Uses the locks library as an engine would: a paged KV cache, the LOCKS selector and exact attention
// over the pages it keeps (CPU), and, when locks was built with CUDA and a GPU is present, the same
// decode step on the GPU (summaries built there, the step captured in a CUDA graph).
// One layer, 2 KV heads x 4 query heads, head_dim 64, 3205 random tokens; the group's queries share a
// direction u, and one token's key lies along it (a "needle" that takes nearly all the attention).
// Prints the pages LOCKS kept and how far its output is from dense attention over every page.
// Exit status 0 when the needle's page is kept and the outputs agree (relative error < 1%).
#include <locks/attention.h>
#include <locks/kv_cache.h>
#include <locks/selector.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

namespace {
// ||a - ref|| / ||ref|| over n values: how far an output is from dense attention.
double relative_error(const float* a, const float* ref, size_t n) {
  double err = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    err += (a[i] - ref[i]) * (a[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  return std::sqrt(err / norm);
}
}  // namespace

#ifdef LOCKS_WITH_CUDA
#include <locks/cuda/kernels.h>

// The same decode step on the GPU: upload layer 0 of the cache (the device pool has the CPU layout),
// build the page summaries there, plan the step, capture it in a CUDA graph, run it, and check the
// status word, the needle's page and the output against dense attention on the CPU.
namespace {

namespace lc = locks::cuda;

#define CUDA_OK(call)                                                               \
  do {                                                                              \
    const cudaError_t e_ = (call);                                                  \
    if (e_ != cudaSuccess) {                                                        \
      std::fprintf(stderr, "CUDA: %s failed: %s\n", #call, cudaGetErrorString(e_)); \
      return false;                                                                 \
    }                                                                               \
  } while (0)

template <class T>
struct DeviceBuffer {  // cudaMalloc'd, freed on scope exit
  T* p = nullptr;
  explicit DeviceBuffer(size_t n) {
    if (cudaMalloc(reinterpret_cast<void**>(&p), std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

bool gpu_decode_step(const locks::PagedKvCache& cache, const locks::KvSequence& seq, const std::vector<float>& q, int G,
                     int needle_page, const std::vector<float>& o_dense) {
  const auto& cfg = cache.config();
  if (cfg.dtype != locks::KvDtype::F16) {  // the device pool takes the CPU pages as they are: f16 here
    std::fprintf(stderr, "CUDA: this example uploads an f16 cache\n");
    return false;
  }
  const int H = cfg.n_head_kv, d = cfg.head_dim, n = seq.n_pages();
  const size_t pool_bytes = size_t(cfg.n_pages) * H * 16 * d * sizeof(uint16_t);  // one layer, f16
  const size_t rec_bytes = lc::summary_record_bytes(d);
  lc::DecodeShape sh;
  sh.n_head_kv = H;
  sh.group = G;
  sh.head_dim = d;
  sh.dtype = lc::KvType::kF16;
  sh.max_pages = n;
  sh.budget_pages = 8;
  const lc::DecodePlan plan = lc::make_decode_plan(sh);

  DeviceBuffer<uint8_t> k(pool_bytes), v(pool_bytes), records(size_t(H) * cfg.n_pages * rec_bytes),
      workspace(plan.workspace_bytes);
  DeviceBuffer<int32_t> indptr(2), indices(n), last_len(1), full(n - 1);
  DeviceBuffer<float> dq(size_t(H) * G * d), o(size_t(H) * G * d);
  if (!k.p || !v.p || !records.p || !workspace.p || !indptr.p || !indices.p || !last_len.p || !full.p || !dq.p ||
      !o.p) {
    std::fprintf(stderr, "CUDA: out of device memory\n");
    return false;
  }
  const int32_t h_indptr[2] = {0, n}, h_last = seq.n_tokens - 16 * (n - 1);
  std::vector<float> h_q;  // [H * G][d]: every KV head's group asks the same queries here
  for (int h = 0; h < H; ++h) h_q.insert(h_q.end(), q.begin(), q.end());
  CUDA_OK(cudaMemcpy(k.p, cache.k_page(0, 0, 0), pool_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(v.p, cache.v_page(0, 0, 0), pool_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(indptr.p, h_indptr, sizeof h_indptr, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(indices.p, seq.page_table.data(), n * sizeof(int32_t), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(last_len.p, &h_last, sizeof h_last, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(full.p, seq.page_table.data(), (n - 1) * sizeof(int32_t), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dq.p, h_q.data(), h_q.size() * sizeof(float), cudaMemcpyHostToDevice));

  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  CUDA_OK(lc::init_decode_workspace(plan, workspace.p, s));
  // Summaries of the full pages (an engine builds a page's summaries once it fills).
  lc::SummaryBuildParams bp;
  bp.k = k.p;
  bp.dtype = lc::KvType::kF16;
  bp.n_head_kv = H;
  bp.head_dim = d;
  bp.pages = full.p;
  bp.n_pages = n - 1;
  bp.n_pages_pool = cfg.n_pages;
  bp.records = records.p;
  CUDA_OK(lc::summary_build(bp, s));

  lc::DecodeStepParams sp;
  sp.q = dq.p;
  sp.kv.k = k.p;
  sp.kv.v = v.p;
  sp.kv.dtype = lc::KvType::kF16;
  sp.kv.n_head_kv = H;
  sp.kv.head_dim = d;
  sp.kv.batch = 1;
  sp.kv.indptr = indptr.p;
  sp.kv.indices = indices.p;
  sp.kv.last_page_len = last_len.p;
  sp.summaries = records.p;
  sp.n_pages_pool = cfg.n_pages;
  sp.scale = 1.0f / std::sqrt(float(d));
  sp.o = o.p;
  sp.workspace = workspace.p;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CUDA_OK(lc::locks_decode_step(plan, sp, s));  // score -> select -> sparse attention
  CUDA_OK(cudaStreamEndCapture(s, &graph));
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  CUDA_OK(cudaGraphLaunch(exec, s));  // an engine replays it every step
  uint32_t status = 0;
  CUDA_OK(lc::read_decode_status(plan, workspace.p, &status, /*clear=*/true, s));  // synchronises
  if (status) {
    std::fprintf(stderr, "CUDA: bad input: %s\n", lc::describe_decode_status(status).c_str());
    return false;
  }
  std::vector<float> h_o(size_t(H) * G * d);
  std::vector<int32_t> sel(size_t(H) * sh.budget_pages), n_sel(H);
  CUDA_OK(cudaMemcpy(h_o.data(), o.p, h_o.size() * sizeof(float), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaMemcpy(sel.data(), lc::plan_selected(plan, workspace.p), sel.size() * sizeof(int32_t),
                     cudaMemcpyDeviceToHost));
  CUDA_OK(
      cudaMemcpy(n_sel.data(), lc::plan_n_selected(plan, workspace.p), H * sizeof(int32_t), cudaMemcpyDeviceToHost));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);

  std::printf("CUDA: %s\n", lc::device_description().c_str());
  bool ok = true;
  for (int h = 0; h < H; ++h) {
    bool has_needle = false;
    std::printf("GPU KV head %d: kept pages", h);
    for (int i = 0; i < n_sel[h]; ++i) {
      const int32_t j = sel[size_t(h) * sh.budget_pages + i];
      std::printf(" %d", j);
      has_needle |= j == needle_page;
    }
    const size_t off = size_t(h) * G * d;
    const double rel = relative_error(h_o.data() + off, o_dense.data() + off, size_t(G) * d);
    std::printf(" (needle page %s); output vs dense on the CPU: relative error %.2e\n", has_needle ? "kept" : "MISSED",
                rel);
    ok = ok && has_needle && rel < 0.01;
  }
  return ok;
}

}  // namespace
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
  std::vector<float> o_dense_all;  // [n_head_kv][G][d]: dense attention, the GPU's reference
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
    o_dense_all.insert(o_dense_all.end(), o_dense.begin(), o_dense.end());
    const double rel = relative_error(o.data(), o_dense.data(), o.size());
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
    ok = gpu_decode_step(cache, seq, q, G, needle / 16, o_dense_all) && ok;
  } else {
    std::printf("CUDA: built in, no usable device here (%s)\n", why.c_str());
  }
#endif
  return ok ? 0 : 1;
}
