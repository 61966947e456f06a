// `locks bench --device cuda`: LOCKS decode step vs our dense paged kernel on the GPU, per layer.
// Method: synthetic KV with realistic page spectra (a per-page direction plus noise), contiguous page
// ids, summaries built on the GPU; each step captured in a CUDA graph (and, for the last two
// columns, launched into a stream); before every timed run a 200 us device wait (the host enqueues
// ahead of the device) and an L2 flush (a 256 MiB read); CUDA events; warm-up, then the median of
// `runs`; the paths alternate. Bytes are counted once, from the sizes the kernels read (see count_*).
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "common.cuh"
#include "locks/cuda/bench.h"
#include "record_layout.h"

namespace locks::cuda {

namespace {

using namespace detail;

using bench::ck;
using bench::DevMem;
using bench::median;
using bench::Timer;

__global__ void copy_kernel(const uint4* src, uint4* dst, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    __stcs(dst + i, __ldcs(src + i));
}

// Before every timed run: a 200 us wait on the device, so that the host has enqueued the timed work
// before the device reaches it (the time is then the device's alone, without host launch cost, as
// inside a model's captured decode graph), then the L2 flush (a 256 MiB read).
struct Flusher {
  DevMem buf;
  DevMem sink;
  size_t n;
  int grid;
  explicit Flusher(size_t bytes, int n_sm) : buf(bytes), sink(64), n(bytes / 16), grid(n_sm * 8) {
    ck(cudaMemset(buf.p, 1, bytes), "flush init");
  }
  void run(cudaStream_t s) {
    bench::spin(200000, s);
    bench::read_all(buf.p, n * 16, sink.as<uint32_t>(), grid, s);
  }
};

// Microseconds of one run of `fn` (enqueue on stream s), after the wait and L2 flush.
template <class Fn>
double time_once(Flusher& fl, cudaStream_t s, Timer& t, Fn fn) {
  fl.run(s);
  ck(cudaEventRecord(t.a, s), "record");
  fn();
  ck(cudaEventRecord(t.b, s), "record");
  ck(cudaEventSynchronize(t.b), "sync");
  float ms = 0.0f;
  ck(cudaEventElapsedTime(&ms, t.a, t.b), "elapsed");
  return 1000.0 * ms;
}

// Median microseconds of `fn` over `runs` runs after `warmup`.
template <class Fn>
double time_us(Flusher& fl, cudaStream_t s, int warmup, int runs, Fn fn) {
  Timer t;
  std::vector<double> v;
  for (int r = -warmup; r < runs; ++r) {
    const double us = time_once(fl, s, t, fn);
    if (r >= 0) v.push_back(us);
  }
  return median(v);
}

cudaGraphExec_t capture(cudaStream_t s, const std::function<void()>& enqueue) {
  cudaGraph_t g;
  cudaGraphExec_t e;
  ck(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "begin capture");
  enqueue();
  ck(cudaStreamEndCapture(s, &g), "end capture");
  ck(cudaGraphInstantiate(&e, g, 0), "instantiate");
  cudaGraphDestroy(g);
  return e;
}

}  // namespace

std::vector<BenchShape> default_bench_shapes() {
  return {
      {"llama3.1-8b", 8, 4, 128, {32768, 131072, 262144}},
      {"glm4-9b-1m-kv4", 4, 8, 128, {131072, 262144, 1048576}},
      {"glm4-9b-1m-kv2", 2, 16, 128, {131072, 262144, 1048576}},
  };
}

int run_bench(const BenchOptions& o) {
  std::string why;
  if (!device_available(&why)) throw std::runtime_error(why);
  std::FILE* csv = bench::open_csv(o.csv);
  int dev = 0;
  ck(cudaGetDevice(&dev), "device");
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, dev), "properties");
  const int n_sm = prop.multiProcessorCount;
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  std::printf("device: %s\n", device_description(dev).c_str());

  // Measured bandwidth ceilings: a plain read of 4 GiB, a 2 GiB -> 2 GiB copy.
  Flusher fl(size_t(256) << 20, n_sm);
  double read_gbs = 0.0, copy_gbs = 0.0;
  {
    const size_t bytes = size_t(4) << 30;
    DevMem a(bytes), sink(64);
    ck(cudaMemset(a.p, 3, bytes), "memset");
    const double us = time_us(fl, s, 3, 10, [&] { bench::read_all(a.p, bytes, sink.as<uint32_t>(), n_sm * 8, s); });
    read_gbs = double(bytes) / us * 1e-3;
    const size_t half = bytes / 2;
    const double us2 = time_us(fl, s, 3, 10, [&] {
      copy_kernel<<<n_sm * 8, 512, 0, s>>>(a.as<uint4>(), reinterpret_cast<uint4*>(a.as<char>() + half), half / 16);
    });
    copy_gbs = 2.0 * double(half) / us2 * 1e-3;
    ck(cudaGetLastError(), "bandwidth kernels");
  }
  std::printf("measured bandwidth: read %.0f GB/s (4 GiB, 16-byte loads), copy %.0f GB/s (read + write)\n", read_gbs,
              copy_gbs);
  std::printf(
      "LOCKS budget %d tokens (%d pages), summaries r=8 int4 basis / int8 coef / int8 centroid, KV %s, "
      "L2 flushed before each run, median of %d runs, CUDA graphs (stream launches: last two columns), PDL %s, "
      "balancing %s\n",
      o.budget_tokens, o.budget_tokens / 16, o.bf16 ? "bf16" : "f16", o.runs, o.pdl ? "on" : "off",
      o.balance ? "on" : "off");

  if (csv)
    std::fprintf(csv,
                 "shape,n_head_kv,group,head_dim,context,batch,dense_us,dense_bytes,locks_us,locks_bytes,score_us,"
                 "score_bytes,select_us,attn_us,attn_bytes,l2_intermediate_bytes,build_pages_per_s,build_batch_us,"
                 "read_gbs,copy_gbs,build_32_layers_us,dense_stream_us,locks_stream_us\n");
  std::printf(
      "\n| shape | context | batch | dense us | dense GB/s | LOCKS step us | score us | score GB/s (%% of read) "
      "| select us | sparse attn us | speedup | dense MB | LOCKS MB | fewer bytes | build Mpage/s | build/step "
      "| build 32 layers us | dense us (stream) | LOCKS us (stream) |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");

  const auto shapes = o.shapes.empty() ? default_bench_shapes() : o.shapes;
  const int budget_pages = o.budget_tokens / 16;
  std::string two_kernel_select;  // rows whose plan selects with the two kernels
  std::string per_pair_select;    // rows whose plan starts the select per (sequence, KV head)
  for (const BenchShape& sh : shapes)
    for (int ctx : sh.contexts)
      for (int B : o.batches) {
        const int H = sh.n_head_kv, G = sh.group, D = sh.head_dim;
        // Sequence b holds ctx - 7 tokens (a partial recent page, as in the middle of decoding), or
        // with ragged, (ctx >> b) - 7 (at least 9): one long sequence and ever shorter ones.
        std::vector<int> tok(B), pg(B), last(B);
        size_t pool = 0;
        double sum_tok = 0.0, sum_pg = 0.0;
        for (int b = 0; b < B; ++b) {
          tok[b] = std::max(16, o.ragged ? ctx >> std::min(b, 30) : ctx) - 7;
          pg[b] = (tok[b] + 15) / 16;
          last[b] = tok[b] - 16 * (pg[b] - 1);
          pool += size_t(pg[b]);
          sum_tok += tok[b];
          sum_pg += pg[b];
        }
        const int pages = pg[0];  // the longest sequence
        const std::string name = o.ragged ? sh.name + "-ragged" : sh.name;
        const size_t kv_elems = pool * H * 16 * D;
        const double kv_gib = 2.0 * kv_elems * 2 / double(1 << 30);
        if (kv_gib > o.max_gib) {
          std::printf("| %s | %d | %d | skipped: KV %.1f GiB > %.0f GiB |\n", name.c_str(), ctx, B, kv_gib, o.max_gib);
          continue;
        }
        DevMem k(kv_elems * 2), v(kv_elems * 2);
        bench::fill_kv(k.p, v.p, kv_elems, D, o.bf16, uint32_t(ctx + B), s);
        std::vector<int32_t> indptr(B + 1, 0), indices(pool);
        for (int b = 0; b < B; ++b) indptr[b + 1] = indptr[b] + pg[b];
        for (size_t i = 0; i < pool; ++i) indices[i] = int32_t(i);
        DevMem d_indptr(indptr.size() * 4), d_indices(indices.size() * 4), d_last(last.size() * 4);
        ck(cudaMemcpy(d_indptr.p, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice), "upload");
        ck(cudaMemcpy(d_indices.p, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice), "upload");
        ck(cudaMemcpy(d_last.p, last.data(), last.size() * 4, cudaMemcpyHostToDevice), "upload");

        PagedKvView kv;
        kv.k = k.p;
        kv.v = v.p;
        kv.dtype = o.bf16 ? KvType::kBF16 : KvType::kF16;
        kv.n_head_kv = H;
        kv.head_dim = D;
        kv.batch = B;
        kv.indptr = d_indptr.as<int32_t>();
        kv.indices = d_indices.as<int32_t>();
        kv.last_page_len = d_last.as<int32_t>();

        // Summaries of every full page (prefill-style batch build): throughput.
        const size_t rb = summary_record_bytes(D);
        DevMem rec(size_t(H) * pool * rb);
        std::vector<int32_t> full;
        for (int b = 0; b < B; ++b)
          for (int j = 0; j < pg[b] - 1; ++j) full.push_back(indptr[b] + j);
        DevMem d_full(full.size() * 4);
        ck(cudaMemcpy(d_full.p, full.data(), full.size() * 4, cudaMemcpyHostToDevice), "upload");
        SummaryBuildParams bp;
        bp.k = k.p;
        bp.dtype = kv.dtype;
        bp.n_head_kv = H;
        bp.head_dim = D;
        bp.pages = d_full.as<int32_t>();
        bp.n_pages = int(full.size());
        bp.n_pages_pool = int(pool);
        bp.records = rec.as<uint8_t>();
        ck(summary_build(bp, s), "summary build");  // warm-up + the real build
        ck(cudaStreamSynchronize(s), "build");
        Timer bt;
        ck(cudaEventRecord(bt.a, s), "record");
        ck(summary_build(bp, s), "summary build");
        ck(cudaEventRecord(bt.b, s), "record");
        ck(cudaEventSynchronize(bt.b), "build");
        float build_ms = 0.0f;
        ck(cudaEventElapsedTime(&build_ms, bt.a, bt.b), "elapsed");
        const double build_pps = double(full.size()) * H / (build_ms * 1e-3);
        // What decoding pays: one new page per sequence every 16 steps (B pages x H heads).
        SummaryBuildParams bp1 = bp;
        bp1.n_pages = B;
        std::vector<int32_t> fresh(B);
        for (int b = 0; b < B; ++b) fresh[b] = indptr[b] + std::max(0, pg[b] - 2);
        DevMem d_fresh(B * 4);
        ck(cudaMemcpy(d_fresh.p, fresh.data(), B * 4, cudaMemcpyHostToDevice), "upload");
        bp1.pages = d_fresh.as<int32_t>();
        const double build_batch_us = time_us(fl, s, 2, 10, [&] { ck(summary_build(bp1, s), "build"); });
        // The same new pages in each of 32 layers, one launch (SummaryBuildParams::n_layers): copies of
        // the fresh pages' keys as 32 pools of B pages, one per layer (distinct memory, as a model's
        // layers are); 32 layers' records.
        double build_layers_us = 0.0;
        {
          constexpr int kLayers = 32;
          const size_t page_elems = size_t(H) * 16 * D;
          DevMem k_small(size_t(kLayers) * B * page_elems * 2), pages_small(size_t(B) * 4),
              rec_small(size_t(kLayers) * H * B * rb);
          std::vector<int32_t> ids(B);
          for (int b = 0; b < B; ++b) ids[b] = b;
          for (int l = 0; l < kLayers; ++l)
            for (int b = 0; b < B; ++b)
              ck(cudaMemcpy(k_small.as<char>() + (size_t(l) * B + b) * page_elems * 2,
                            k.as<char>() + size_t(fresh[b]) * page_elems * 2, page_elems * 2, cudaMemcpyDeviceToDevice),
                 "copy keys");
          ck(cudaMemcpy(pages_small.p, ids.data(), size_t(B) * 4, cudaMemcpyHostToDevice), "upload");
          SummaryBuildParams bl = bp1;
          bl.k = k_small.p;
          bl.pages = pages_small.as<int32_t>();
          bl.n_pages_pool = B;
          bl.records = rec_small.as<uint8_t>();
          bl.n_layers = kLayers;
          bl.k_layer_stride = size_t(B) * page_elems;
          bl.records_layer_stride = size_t(H) * B * rb;
          build_layers_us = time_us(fl, s, 2, 10, [&] { ck(summary_build(bl, s), "build (32 layers)"); });
        }

        DecodeShape ds;
        ds.batch = B;
        ds.n_head_kv = H;
        ds.group = G;
        ds.head_dim = D;
        ds.dtype = kv.dtype;
        ds.max_pages = pages;
        ds.budget_pages = budget_pages;
        DecodePlan plan = make_decode_plan(ds, dev, o.balance);
        plan.pdl = o.pdl;
        // The plan's select, listed below the table: one kernel unless listed; per pair where listed.
        const std::string row = sh.name + " " + std::to_string(ctx / 1024) + "K b" + std::to_string(B);
        if (plan.select_cluster_pages == 0) two_kernel_select += (two_kernel_select.empty() ? "" : ", ") + row;
        if (select_per_pair(plan)) per_pair_select += (per_pair_select.empty() ? "" : ", ") + row;
        DevMem ws(plan.workspace_bytes), q(size_t(B) * H * G * D * 4), out(size_t(B) * H * G * D * 4),
            lse(size_t(B) * H * G * 4);
        ck(init_decode_workspace(plan, ws.p, s), "init");
        bench::fill_normal(q.as<float>(), size_t(B) * H * G * D, 99u, s);
        DecodeStepParams sp;
        sp.q = q.as<float>();
        sp.kv = kv;
        sp.summaries = rec.as<uint8_t>();
        sp.n_pages_pool = int(pool);
        sp.scale = 1.0f / std::sqrt(float(D));
        sp.o = out.as<float>();
        sp.lse = lse.as<float>();
        sp.workspace = ws.p;

        // Graphs: full LOCKS step; score only; score + select; sparse attention only; dense.
        const ScoreParams scp = step_score_params(plan, sp), scp_paired = step_score_params(plan, sp, true);
        const SelectParams sep = step_select_params(plan, sp, true);  // after scp_paired, as in the step
        const AttentionParams atp = step_attention_params(plan, sp, /*sparse=*/true);
        cudaGraphExec_t g_locks = capture(s, [&] { ck(locks_decode_step(plan, sp, s), "locks step"); });
        cudaGraphExec_t g_dense = capture(s, [&] { ck(dense_decode_step(plan, sp, s), "dense step"); });
        // The score pass alone publishes no pairs (select_per_pair): no select consumes them.
        cudaGraphExec_t g_score = capture(s, [&] { ck(score_pages(scp, s), "score"); });
        cudaGraphExec_t g_ss = capture(s, [&] {
          ck(score_pages(scp_paired, s), "score");
          ck(select_pages(sep, s), "select");
        });
        cudaGraphExec_t g_attn = capture(s, [&] { ck(paged_decode_attention(atp, s), "sparse attention"); });

        std::vector<double> t_dense, t_locks, t_score, t_ss, t_attn, t_dense_st, t_locks_st;
        Timer t;
        // The paths alternate within each round: graph launches, then the steps launched into the stream.
        auto timed = [&](auto enqueue, std::vector<double>& acc, bool keep) {
          const double us = time_once(fl, s, t, enqueue);
          if (keep) acc.push_back(us);
        };
        auto graph = [&](cudaGraphExec_t g) { return [&s, g] { ck(cudaGraphLaunch(g, s), "graph"); }; };
        for (int r = -o.warmup; r < o.runs; ++r) {
          timed(graph(g_dense), t_dense, r >= 0);
          timed(graph(g_locks), t_locks, r >= 0);
          timed(graph(g_score), t_score, r >= 0);
          timed(graph(g_ss), t_ss, r >= 0);
          timed(graph(g_attn), t_attn, r >= 0);
          timed([&] { ck(dense_decode_step(plan, sp, s), "dense step"); }, t_dense_st, r >= 0);
          timed([&] { ck(locks_decode_step(plan, sp, s), "locks step"); }, t_locks_st, r >= 0);
        }
        ck(cudaGetLastError(), "timed runs");
        for (cudaGraphExec_t g : {g_locks, g_dense, g_score, g_ss, g_attn}) cudaGraphExecDestroy(g);

        // Sanity: the LOCKS output is finite.
        std::vector<float> ho(size_t(B) * H * G * D);
        ck(cudaMemcpy(ho.data(), out.p, ho.size() * 4, cudaMemcpyDeviceToHost), "download");
        for (float x : ho)
          if (!std::isfinite(x)) throw std::runtime_error("CUDA bench: non-finite attention output");

        // Bytes read (counted once): K/V of every token; summaries of every full page, the partial
        // page's keys, the selected pages' K/V; page-table entries.
        const double tok_bytes = 2.0 * D * 2;  // K + V of one token, one head
        double score_bytes = sum_pg * 4, attn_bytes = 0.0;
        for (int b = 0; b < B; ++b) {
          const int sel_pages = std::min(budget_pages, pg[b]);
          const double sel_tokens = double(sel_pages - 1) * 16 + last[b];
          score_bytes += double(H) * ((pg[b] - 1) * double(rb) + last[b] * D * 2.0);
          attn_bytes += double(H) * (sel_tokens * tok_bytes + sel_pages * 4.0);
        }
        const double dense_bytes = double(H) * sum_tok * tok_bytes + sum_pg * 4;
        const double locks_bytes = score_bytes + attn_bytes;
        const double l2_bytes = double(H) * sum_pg * (G * 4.0 * 2 + 4.0 * 2);  // log-mass, keys (L2-resident)
        const double md = median(t_dense), ml = median(t_locks), msc = median(t_score), mss = median(t_ss),
                     ma = median(t_attn), md_st = median(t_dense_st), ml_st = median(t_locks_st);
        std::printf(
            "| %s | %dK | %d | %.1f | %.0f | %.1f | %.1f | %.0f (%.0f%%) | %.1f | %.1f | %.2fx | %.1f | %.1f | "
            "%.2fx | %.2f | %.3f | %.1f | %.1f | %.1f |\n",
            name.c_str(), ctx / 1024, B, md, dense_bytes / md * 1e-3, ml, msc, score_bytes / msc * 1e-3,
            100.0 * score_bytes / msc * 1e-3 / read_gbs, mss - msc, ma, md / ml, dense_bytes / 1e6, locks_bytes / 1e6,
            dense_bytes / locks_bytes, build_pps * 1e-6, build_batch_us / 16.0 / ml, build_layers_us, md_st, ml_st);
        std::fflush(stdout);
        if (csv) {
          std::fprintf(
              csv,
              "%s,%d,%d,%d,%d,%d,%.3f,%.0f,%.3f,%.0f,%.3f,%.0f,%.3f,%.3f,%.0f,%.0f,%.0f,%.3f,%.1f,%.1f,%.3f,%.3f,"
              "%.3f\n",
              name.c_str(), H, G, D, ctx, B, md, dense_bytes, ml, locks_bytes, msc, score_bytes, mss - msc, ma,
              attn_bytes, l2_bytes, build_pps, build_batch_us, read_gbs, copy_gbs, build_layers_us, md_st, ml_st);
          std::fflush(csv);
        }
      }
  if (csv) std::fclose(csv);
  std::printf("\nselect: one kernel (SelectParams::cluster_pages) in every row but: %s\n",
              two_kernel_select.empty() ? "none" : two_kernel_select.c_str());
  std::printf(
      "select started per (sequence, KV head) as the score pass completes it (select_per_pair) "
      "in: %s\n",
      per_pair_select.empty() ? "none" : per_pair_select.c_str());
  std::printf(
      "\nbuild Mpage/s: (page, KV head) summaries per second, all full pages of the batch in one launch; "
      "build/step: building one new page per sequence (every 16 decode steps), amortised per step, over "
      "the LOCKS step time; build 32 layers: the same new pages in each of 32 layers, one launch "
      "(SummaryBuildParams::n_layers)\n");
  cudaStreamDestroy(s);
  return 0;
}

}  // namespace locks::cuda
