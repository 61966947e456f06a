// Plan/run of one layer's decode step on the GPU (LOCKS: score -> select -> sparse attention with
// merge; dense: attention over every page), the workspace layout, and device queries.
#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "common.cuh"
#include "kernels_internal.h"
#include "record_layout.h"

namespace locks::cuda {

namespace {

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
int div_up(long a, long b) { return int((a + b - 1) / b); }
// A typed view at a byte offset of the workspace.
template <class T>
T* at(void* ws, size_t off) {
  return reinterpret_cast<T*>(static_cast<char*>(ws) + off);
}

// Makes `device` current for a scope (the occupancy queries and prepare_select act on the current
// device, and a plan is for the device it names), then restores the caller's.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (device != prev_ && cudaSetDevice(device) != cudaSuccess)
      throw std::runtime_error("CUDA decode: cannot use device " + std::to_string(device));
  }
  ~DeviceScope() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int prev_ = -1;
};

__global__ void probe_kernel(int* out) {
  if (threadIdx.x == 0) *out = 42;
}

}  // namespace

bool device_available(std::string* why) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why) {
      // The runtime says "driver version is insufficient" also where there is no driver (no GPU).
      if (e == cudaErrorInsufficientDriver)
        *why = std::string(
                   "no CUDA device: no NVIDIA driver is loaded, or it is older than this build's CUDA "
                   "runtime (") +
               cudaGetErrorString(e) + ")";
      else
        *why = e != cudaSuccess ? std::string("no CUDA device: ") + cudaGetErrorString(e) : "no CUDA device";
    }
    cudaGetLastError();
    return false;
  }
  int* d = nullptr;
  e = cudaMalloc(&d, sizeof(int));
  if (e == cudaSuccess) {
    probe_kernel<<<1, 32>>>(d);
    e = cudaGetLastError();
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    cudaFree(d);
  }
  if (e != cudaSuccess) {
    if (why) *why = std::string("CUDA device not usable by this build (sm_90a kernels): ") + cudaGetErrorString(e);
    cudaGetLastError();
    return false;
  }
  return true;
}

std::string device_description(int device) {
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) return "no CUDA device";
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return "no CUDA device";
  int rt = 0, drv = 0;
  cudaRuntimeGetVersion(&rt);
  cudaDriverGetVersion(&drv);
  char buf[1024];  // room for the longest: a 255-character name and the widest numbers
  snprintf(buf, sizeof buf, "%s (sm_%d%d), %d SMs, %.0f GiB, L2 %d MiB, CUDA runtime %d.%d, driver %d.%d", prop.name,
           prop.major, prop.minor, prop.multiProcessorCount, double(prop.totalGlobalMem) / (1 << 30),
           prop.l2CacheSize >> 20, rt / 1000, (rt % 1000) / 10, drv / 1000, (drv % 1000) / 10);
  return buf;
}

DecodePlan make_decode_plan(const DecodeShape& sh, int device, bool balance) {
  if (sh.head_dim != 64 && sh.head_dim != 128)
    throw std::invalid_argument("CUDA decode: head_dim " + std::to_string(sh.head_dim) + " (supported: 64, 128)");
  if (sh.group < 1 || sh.group > kMaxGroup)
    throw std::invalid_argument("CUDA decode: GQA group " + std::to_string(sh.group) + " outside [1, 16]");
  if (sh.batch < 1 || sh.n_head_kv < 1 || sh.max_pages < 1)
    throw std::invalid_argument("CUDA decode: batch, n_head_kv and max_pages must be positive");
  if (sh.budget_pages < 2) throw std::invalid_argument("CUDA decode: budget below 2 pages");
  if (device < 0 && cudaGetDevice(&device) != cudaSuccess) throw std::runtime_error("CUDA decode: no device");
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess)
    throw std::runtime_error("CUDA decode: no device " + std::to_string(device));
  const DeviceScope on_device(device);

  DecodePlan p;
  p.shape = sh;
  p.score_balance = p.dense_balance = balance;
  p.n_sm = prop.multiProcessorCount;
  const long bh = long(sh.batch) * sh.n_head_kv;
  const int max_splits = attention_max_splits();

  // Score pass (docs/cuda-design.md): persistent CTAs over work items of a multiple of 32 pages (4
  // warps x 8 pages). With equal lengths (and balanced chunks, below, for any lengths) sized so that
  // every CTA gets at most one item while batch * n_head_kv fits in one wave (beyond that, one item
  // per (sequence, KV head), walked round-robin): a CTA's second item would start with an empty
  // pipeline and wait a full (loaded) memory latency, which costs far more than an idle CTA. Every
  // (sequence, KV head) gets the same number of chunks, as many as fit in one wave, so the chunks are
  // equal up to the 32-page rounding (no short last chunk per pair).
  const int score_resident = p.n_sm * score_ctas_per_sm(sh.head_dim, sh.group);
  const long chunks_per_bh = std::max<long>(1, score_resident / bh);
  p.score_chunk_pages = std::max(32, int(align_up(size_t(div_up(long(sh.max_pages), chunks_per_bh)), 32)));
  p.score_chunks = div_up(sh.max_pages, p.score_chunk_pages);
  p.score_equal_chunks = p.score_chunks;
  // Balanced chunks (ScoreParams::balance_chunks): with equal lengths the same chunks as above; a
  // sequence longer than the others may take up to a grid's worth per KV head, so the statistics
  // hold that many (ragged batches: docs/cuda-design.md).
  if (p.score_balance)
    p.score_chunks = std::max(p.score_equal_chunks, std::min(score_resident / sh.n_head_kv, div_up(sh.max_pages, 32)));
  p.score_grid = int(std::min<long>(score_resident, bh * p.score_chunks));
  p.log_mass_stride = int(align_up(size_t(sh.max_pages), 8));
  // Many chunks per (sequence, KV head), i.e. small batches: the share kernel merges lse_total from
  // the chunk statistics, so that the score pass does not end with its last CTA's merge chain while
  // the device idles. With few chunks (batch 8: 12) that merge is short and the share kernel's own
  // costs more.
  p.defer_lse_total = p.score_equal_chunks >= 32;
  // Select from the share kernel's per-CTA candidate lists while that kernel fits in one wave: then
  // its extra pass (a local threshold, the lists) runs beside the others, and select reads ~1/8 of
  // the keys. In several waves it costs more than it saves.
  {
    const long share_ctas = bh * div_up(long(p.log_mass_stride), share_pages_per_cta());
    p.select_candidates = share_ctas <= long(p.n_sm) * share_ctas_per_sm(sh.group, p.defer_lse_total);
  }
  // Shares and selection in one kernel (SelectParams::cluster_pages): the histograms and the threshold
  // bin's keys cross a cluster per (sequence, KV head) through distributed shared memory instead of
  // global memory and a second kernel. It starts on each pair as the score pass completes it
  // (select_per_pair(), below), instead of after the whole pass, where the pass's last CTA of a pair merges
  // lse_total anyway (no deferral): then the selection of early pairs overlaps the pass's tail. With
  // the merge deferred (batch 1-2) the per-item counter this needs costs more than it saves, so those
  // keep the PDL wait.
  // The most CTAs per cluster, from one per 4096 pages (one round of loads) down to one per
  // kClusterSelectPages (eight rounds), such that every cluster fits at once: started per pair,
  // clusters that do not fit at once would only wait for resources, and a second wave costs more
  // than more CTAs per cluster save (in all but one measured shape: docs/cuda-design.md). Where none
  // fits, the two kernels run.
  for (int clusters = std::min(kSelectClusterMaxCtas, div_up(p.log_mass_stride, 4096));
       clusters >= div_up(p.log_mass_stride, kClusterSelectPages) && !p.select_cluster_pages; --clusters) {
    const int per_cta = int(align_up(size_t(div_up(p.log_mass_stride, clusters)), 32));
    if (div_up(p.log_mass_stride, per_cta) == clusters &&
        bh <= select_max_active_clusters(sh.group, p.defer_lse_total, clusters, per_cta))
      p.select_cluster_pages = per_cta;
  }
  if (p.select_cluster_pages) p.select_candidates = false;

  // Attention: one wave of CTAs; at least one page per warp; at most max_splits splits.
  // Sparse attention with G > 8 runs as two CTAs of <= 8 heads per split: twice the CTAs, each with
  // half the MMA chain per page. Dense keeps one CTA per group: there the second half's K/V reads
  // would not come from the L2.
  p.sparse_group_halves = sh.group > 8;
  const long slots = long(p.n_sm) * attention_ctas_per_sm(sh.head_dim, sh.group, sh.dtype, false);
  // The longest list select_pages can write: the score pass accepts up to log_mass_stride pages
  // (max_pages rounded up to 8), and the splits must cover it (a longer list is bad input).
  const int sel = std::min(sh.budget_pages, p.log_mass_stride);
  {
    const long sparse_slots =
        long(p.n_sm) * attention_ctas_per_sm(sh.head_dim, sh.group, sh.dtype, true) / (p.sparse_group_halves ? 2 : 1);
    const int want = std::max(1, int(sparse_slots / bh));
    // At least 8 pages per split (2 per warp); 4 for group halves, whose CTAs run half the MMA chain
    // per page (G <= 8 gains nothing clear from 4).
    const int min_pps = p.sparse_group_halves ? 4 : 8;
    int pps = std::max(min_pps, int(align_up(size_t(div_up(sel, want)), 4)));
    pps = std::max(pps, div_up(sel, max_splits));
    p.sparse_pages_per_split = pps;
    p.sparse_splits = div_up(sel, pps);
    p.sparse_cluster_merge = !p.sparse_group_halves && p.sparse_splits >= 2 && p.sparse_splits <= 16 &&
                             bh <= attention_max_active_clusters(sh.head_dim, sh.dtype, p.sparse_splits);
  }
  // Dense: splits sized for max_pages; with dense_balance (AttentionParams::balance_splits) the
  // n_splits * batch CTAs per KV head are shared by the sequences' actual lengths at run time.
  {
    const int want = std::max(1, int(slots / bh));
    int pps = std::max(4, div_up(sh.max_pages, want));
    pps = std::max(pps, div_up(sh.max_pages, max_splits));
    p.dense_pages_per_split = pps;
    p.dense_splits = div_up(sh.max_pages, pps);
  }

  // Workspace.
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t o = off;
    off = align_up(off + bytes, 256);
    return o;
  };
  const int splits = std::max(p.sparse_splits, p.dense_splits);
  p.off_log_mass = take(sizeof(float) * bh * sh.group * p.log_mass_stride);
  p.off_lse_total = take(sizeof(float) * bh * sh.group);
  p.off_chunk_stats = take(sizeof(float) * 2 * bh * p.score_chunks * 16);
  p.off_keys = take(sizeof(uint32_t) * bh * p.log_mass_stride);
  p.off_candidates = take(p.select_candidates ? sizeof(unsigned long long) * bh * p.log_mass_stride : 0);
  p.off_n_candidates =
      take(p.select_candidates ? sizeof(int32_t) * bh * div_up(p.log_mass_stride, share_pages_per_cta()) : 0);
  p.off_selected = take(sizeof(int32_t) * bh * sh.budget_pages);
  p.off_n_selected = take(sizeof(int32_t) * bh);
  p.off_partial_o = take(sizeof(float) * bh * splits * 16 * sh.head_dim);
  p.off_partial_lse = take(sizeof(float) * bh * splits * 16);
  // Zero-initialised, self-cleaning: histograms and the last-CTA counters (score, sparse, dense).
  p.off_hist = take(0);
  const size_t zero_begin = p.off_hist;
  take(sizeof(uint32_t) * bh * kHistBins);
  p.off_counters = take(sizeof(uint32_t) * score_counters(sh.batch, sh.n_head_kv));
  p.off_counters_sparse = take(sizeof(uint32_t) * bh);
  p.off_counters_dense = take(sizeof(uint32_t) * bh);
  // Per-pair counters (select_per_pair), always there: the plan's fields decide at each step.
  p.off_score_ready = take(sizeof(uint32_t) * bh);
  p.off_ready_seen = take(sizeof(uint32_t) * bh * kSelectClusterMaxCtas);
  p.off_status = take(sizeof(uint32_t));  // sticky: cleared by init_decode_workspace / read_decode_status
  p.counters_bytes = off - zero_begin;
  p.workspace_bytes = off;

  const cudaError_t e = prepare_select(p.log_mass_stride);
  if (e != cudaSuccess) throw std::runtime_error(std::string("CUDA decode: ") + cudaGetErrorString(e));
  return p;
}

cudaError_t init_decode_workspace(const DecodePlan& plan, void* ws, cudaStream_t stream) {
  return cudaMemsetAsync(static_cast<char*>(ws) + plan.off_hist, 0, plan.counters_bytes, stream);
}

cudaError_t read_decode_status(const DecodePlan& plan, void* ws, uint32_t* status, bool clear, cudaStream_t stream) {
  uint32_t* d = at<uint32_t>(ws, plan.off_status);
  cudaError_t e = cudaMemcpyAsync(status, d, sizeof(uint32_t), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess && clear) e = cudaMemsetAsync(d, 0, sizeof(uint32_t), stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  return e;
}

std::string describe_decode_status(uint32_t status) {
  std::string out;
  auto add = [&](uint32_t bit, const char* what) {
    if (!(status & bit)) return;
    if (!out.empty()) out += "; ";
    out += what;
  };
  add(kStatusBadPageCount,
      "page count out of range (indptr descending, or more pages than the plan covers: max_pages)");
  add(kStatusBadLastPageLen, "last_page_len outside 1..16");
  add(kStatusBadPageId, "page id outside [0, n_pages_pool)");
  add(kStatusBadKeys, "a page's keys are not finite (summary build)");
  const uint32_t unknown =
      status & ~uint32_t(kStatusBadPageCount | kStatusBadLastPageLen | kStatusBadPageId | kStatusBadKeys);
  if (unknown) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "unknown status bits 0x%x", unknown);
    if (!out.empty()) out += "; ";
    out += buf;
  }
  return out;
}

float* plan_log_mass(const DecodePlan& plan, void* ws) { return at<float>(ws, plan.off_log_mass); }
float* plan_lse_total(const DecodePlan& plan, void* ws) { return at<float>(ws, plan.off_lse_total); }
int32_t* plan_selected(const DecodePlan& plan, void* ws) { return at<int32_t>(ws, plan.off_selected); }
int32_t* plan_n_selected(const DecodePlan& plan, void* ws) { return at<int32_t>(ws, plan.off_n_selected); }

bool select_per_pair(const DecodePlan& plan) { return plan.select_cluster_pages && plan.pdl && !plan.defer_lse_total; }

ScoreParams step_score_params(const DecodePlan& plan, const DecodeStepParams& p, bool paired) {
  ScoreParams sp;
  sp.q = p.q;
  sp.kv = p.kv;
  sp.summaries = p.summaries;
  sp.n_pages_pool = p.n_pages_pool;
  sp.group = plan.shape.group;
  sp.scale = p.scale;
  sp.chunk_pages = plan.score_chunk_pages;
  sp.n_chunks = plan.score_chunks;
  sp.log_mass = at<float>(p.workspace, plan.off_log_mass);
  sp.log_mass_stride = plan.log_mass_stride;
  sp.lse_total = at<float>(p.workspace, plan.off_lse_total);
  sp.chunk_stats = at<float>(p.workspace, plan.off_chunk_stats);
  sp.counters = at<uint32_t>(p.workspace, plan.off_counters);
  sp.grid = plan.score_grid;
  sp.pdl = plan.pdl;
  sp.status = at<uint32_t>(p.workspace, plan.off_status);
  sp.defer_lse_total = plan.defer_lse_total;
  sp.balance_chunks = plan.score_balance;
  if (paired && select_per_pair(plan)) sp.ready = at<uint32_t>(p.workspace, plan.off_score_ready);
  return sp;
}

SelectParams step_select_params(const DecodePlan& plan, const DecodeStepParams& p, bool paired) {
  const DecodeShape& sh = plan.shape;
  SelectParams se;
  se.batch = sh.batch;
  se.n_head_kv = sh.n_head_kv;
  se.group = sh.group;
  se.indptr = p.kv.indptr;
  se.log_mass = at<float>(p.workspace, plan.off_log_mass);
  se.log_mass_stride = plan.log_mass_stride;
  se.lse_total = at<float>(p.workspace, plan.off_lse_total);
  se.budget_pages = sh.budget_pages;
  se.keys = at<uint32_t>(p.workspace, plan.off_keys);
  if (plan.select_candidates && plan.off_n_candidates > plan.off_candidates) {  // (its workspace exists)
    se.candidates = at<unsigned long long>(p.workspace, plan.off_candidates);
    se.n_candidates = at<int32_t>(p.workspace, plan.off_n_candidates);
  }
  se.hist = at<uint32_t>(p.workspace, plan.off_hist);
  se.selected = at<int32_t>(p.workspace, plan.off_selected);
  se.n_selected = at<int32_t>(p.workspace, plan.off_n_selected);
  se.pdl = plan.pdl;
  se.pdl_early_reads = plan.pdl;  // score_pages does not write the page table
  se.cluster_pages = plan.select_cluster_pages;
  if (paired && select_per_pair(plan)) {
    se.score_ready = at<uint32_t>(p.workspace, plan.off_score_ready);
    se.ready_seen = at<uint32_t>(p.workspace, plan.off_ready_seen);
  }
  if (plan.defer_lse_total) {
    se.chunk_stats = at<float>(p.workspace, plan.off_chunk_stats);
    se.n_chunks = plan.score_chunks;
  }
  return se;
}

// Sparse: the plan's sparse splits over the selection; dense: every page.
AttentionParams step_attention_params(const DecodePlan& plan, const DecodeStepParams& p, bool sparse) {
  AttentionParams ap;
  ap.q = p.q;
  ap.kv = p.kv;
  if (ap.kv.n_pages_pool == 0) ap.kv.n_pages_pool = p.n_pages_pool;
  ap.status = at<uint32_t>(p.workspace, plan.off_status);
  ap.group = plan.shape.group;
  ap.scale = p.scale;
  ap.pages_per_split = sparse ? plan.sparse_pages_per_split : plan.dense_pages_per_split;
  ap.n_splits = sparse ? plan.sparse_splits : plan.dense_splits;
  ap.o = p.o;
  ap.lse = p.lse;
  ap.partial_o = at<float>(p.workspace, plan.off_partial_o);
  ap.partial_lse = at<float>(p.workspace, plan.off_partial_lse);
  ap.counters = at<uint32_t>(p.workspace, sparse ? plan.off_counters_sparse : plan.off_counters_dense);
  ap.pdl = plan.pdl;
  ap.group_halves = sparse && plan.sparse_group_halves;
  ap.cluster_merge = sparse && plan.sparse_cluster_merge;
  ap.balance_splits = !sparse && plan.dense_balance;
  if (sparse) {
    ap.selected = at<int32_t>(p.workspace, plan.off_selected);
    ap.n_selected = at<int32_t>(p.workspace, plan.off_n_selected);
    ap.selected_stride = plan.shape.budget_pages;
    ap.pdl_early_reads = plan.pdl;  // early reads: q and the page table, which select_pages does not write
  }
  return ap;
}

cudaError_t locks_decode_step(const DecodePlan& plan, const DecodeStepParams& p, cudaStream_t stream) {
  cudaError_t e = score_pages(step_score_params(plan, p, /*paired=*/true), stream);
  if (e == cudaSuccess) e = select_pages(step_select_params(plan, p, /*paired=*/true), stream);
  if (e == cudaSuccess) e = paged_decode_attention(step_attention_params(plan, p, /*sparse=*/true), stream);
  return e;
}

cudaError_t oracle_decode_step(const DecodePlan& plan, const DecodeStepParams& p, cudaStream_t stream) {
  ExactScoreParams ex;
  ex.batch = plan.shape.batch;
  ex.q = p.q;
  ex.kv = p.kv;
  if (ex.kv.n_pages_pool == 0) ex.kv.n_pages_pool = p.n_pages_pool;
  ex.group = plan.shape.group;
  ex.scale = p.scale;
  ex.log_mass = at<float>(p.workspace, plan.off_log_mass);
  ex.log_mass_stride = plan.log_mass_stride;
  ex.lse_total = at<float>(p.workspace, plan.off_lse_total);
  ex.status = at<uint32_t>(p.workspace, plan.off_status);
  SelectParams se = step_select_params(plan, p, /*paired=*/false);
  se.chunk_stats = nullptr;  // lse_total comes from exact_page_scores
  se.n_chunks = 0;
  cudaError_t e = exact_page_scores(ex, stream);
  if (e == cudaSuccess) e = select_pages(se, stream);
  if (e == cudaSuccess) e = paged_decode_attention(step_attention_params(plan, p, /*sparse=*/true), stream);
  return e;
}

cudaError_t dense_decode_step(const DecodePlan& plan, const DecodeStepParams& p, cudaStream_t stream) {
  return paged_decode_attention(step_attention_params(plan, p, /*sparse=*/false), stream);
}

}  // namespace locks::cuda
