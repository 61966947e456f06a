// `locks bench --device cuda --e2e`: whole models on the GPU, dense against LOCKS (bench.h).
#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.h"
#include "cuda_forward.h"
#include "locks/cuda/bench.h"

namespace locks::cuda {

using bench::ck;
using bench::DevMem;
using bench::median;
using bench::Timer;

std::vector<E2eShape> default_e2e_shapes() {
  return {
      {"llama3.1-8b", 32, 32, 8, 128, 14336, 128256, {32768, 131072, 262144}},
      {"glm4-9b-1m-kv4", 40, 32, 4, 128, 13696, 151552, {32768, 262144, 1048576}},
      {"glm4-9b-1m-kv2", 40, 32, 2, 128, 13696, 151552, {262144, 1048576}},
  };
}

namespace {

LlamaHparams hparams_of(const E2eShape& s, int n_ctx) {
  LlamaHparams hp;
  hp.n_vocab = s.n_vocab;
  hp.n_ctx_train = n_ctx;
  hp.n_embd = s.n_head * s.head_dim;
  hp.n_layer = s.n_layer;
  hp.n_ff = s.n_ff;
  hp.n_head = s.n_head;
  hp.n_head_kv = s.n_head_kv;
  hp.head_dim = s.head_dim;
  hp.n_rot = s.head_dim;
  hp.rope_freq_base = 10000000.0f;
  return hp;
}

// Microseconds of one decode step (llama_forward on the engine) on the device alone: a wait kernel
// first lets the host enqueue the step before the device reaches it.
double time_step(CudaForward& fwd, const LlamaHparams& hp, const ForwardStep& step, Timer& t) {
  cudaStream_t s = fwd.stream();
  bench::spin(300000, s);
  ck(cudaEventRecord(t.a, s), "record");
  llama_forward(fwd, hp.n_layer, step);
  ck(cudaEventRecord(t.b, s), "record");
  ck(cudaEventSynchronize(t.b), "step");
  return t.elapsed_us();
}

}  // namespace

int run_e2e_bench(const E2eOptions& o) {
  std::string why;
  if (!device_available(&why)) throw std::runtime_error(why);
  if (!cublas_available(&why)) throw std::runtime_error(why);
  std::FILE* csv = bench::open_csv(o.csv);
  int dev = 0;
  ck(cudaGetDevice(&dev), "device");
  cudaDeviceProp prop{};
  ck(cudaGetDeviceProperties(&prop, dev), "properties");
  std::printf("device: %s\n", device_description(dev).c_str());

  double read_gbs = 0.0;  // the roofline's bandwidth: a plain read of 4 GiB
  {
    cudaStream_t s;
    ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    const size_t bytes = size_t(4) << 30;
    DevMem a(bytes), sink(64);
    ck(cudaMemset(a.p, 3, bytes), "memset");
    Timer t;
    std::vector<double> us;
    for (int r = 0; r < 8; ++r) {
      ck(cudaEventRecord(t.a, s), "record");
      bench::read_all(a.p, bytes, sink.as<uint32_t>(), prop.multiProcessorCount * 8, s);
      ck(cudaEventRecord(t.b, s), "record");
      ck(cudaEventSynchronize(t.b), "read");
      if (r >= 2) us.push_back(t.elapsed_us());
    }
    read_gbs = double(bytes) / median(us) * 1e-3;
    cudaStreamDestroy(s);
  }
  std::printf(
      "measured read bandwidth %.0f GB/s; LOCKS budget %d tokens, KV bf16, random bf16 weights, synthetic "
      "KV with per-page dominant directions; TPOT = median of %d replayed steps (CUDA graphs), dense and "
      "LOCKS alternating\n",
      read_gbs, o.budget_tokens, o.steps);
  if (csv)
    std::fprintf(csv,
                 "shape,n_layer,n_head,n_head_kv,head_dim,n_ff,n_vocab,context,batch,tpot_dense_ms,tpot_locks_ms,"
                 "speedup,roofline_dense_ms,weights_bytes,kv_bytes,gemm_ms,score_select_ms,attention_ms,"
                 "summary_ms_per_step,other_ms,ttft_s,read_gbs\n");
  std::printf(
      "\n| shape | context | batch | TPOT dense ms | TPOT LOCKS ms | speedup | dense roofline ms | dense / roofline "
      "| LOCKS: GEMM ms | score+select ms | attention ms | summary ms/step | other ms | TTFT s |\n"
      "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");

  const auto shapes = o.shapes.empty() ? default_e2e_shapes() : o.shapes;
  const int margin = 16 * (o.warmup + o.steps + 8);  // tokens the timed steps add, with room
  for (const E2eShape& sh : shapes) {
    int max_ctx = 0;
    for (int c : sh.contexts) max_ctx = std::max(max_ctx, c);
    const LlamaHparams hp = hparams_of(sh, max_ctx + margin);
    auto weights = std::make_shared<DeviceWeights>(DeviceWeights::random(hp, 1234));
    const size_t weight_bytes = weights->bytes - size_t(hp.n_vocab) * hp.n_embd * 2;  // the embedding is gathered
    for (int ctx : sh.contexts)
      for (int B : o.batches) {
        const int n_ctx = ctx + margin;
        const size_t tok_kv = size_t(hp.n_layer) * hp.n_head_kv * hp.head_dim * 2 * 2;
        const size_t page_bytes = 16 * tok_kv + size_t(hp.n_layer) * hp.n_head_kv * summary_record_bytes(hp.head_dim);
        const size_t pages = size_t(B) * ((n_ctx + 15) / 16);
        size_t free_b = 0, total_b = 0;
        ck(cudaMemGetInfo(&free_b, &total_b), "memory");
        const size_t rows = size_t(std::max(B, o.prefill_chunk));
        const size_t buffers =
            rows * (size_t(hp.n_embd) * 10 + size_t(hp.n_ff) * 10 +
                    size_t(hp.n_head + 2 * hp.n_head_kv) * hp.head_dim * 4 + size_t(hp.n_head) * hp.head_dim * 10);
        if (pages * page_bytes + buffers + (size_t(2) << 30) > free_b) {
          std::printf("| %s | %dK | %d | skipped: KV %.0f GiB + buffers do not fit the %.0f GiB free |\n",
                      sh.name.c_str(), ctx / 1024, B, double(pages * page_bytes) / (1 << 30),
                      double(free_b) / (1 << 30));
          continue;
        }
        EngineConfig cfg;
        cfg.n_ctx = n_ctx;
        cfg.max_seqs = B;
        cfg.max_rows = int(rows);
        cfg.kv_dtype = KvType::kBF16;
        cfg.locks = true;
        cfg.budget_pages = o.budget_tokens / 16;
        cfg.n_pages_pool = int(pages);
        cfg.decode_gemv = !o.cublas_decode;
        CudaForward fwd(weights, cfg);
        cudaStream_t s = fwd.stream();
        DeviceKvCache& cache = fwd.cache();

        // TTFT: a real prefill of the context (batch 1), then the first token.
        double ttft = NAN;
        if (B == 1 && ctx <= o.prefill_max_context) {
          std::vector<int32_t> prompt(ctx);
          for (int i = 0; i < ctx; ++i) prompt[i] = int32_t((i * 2654435761u) % uint32_t(hp.n_vocab));
          ck(cudaStreamSynchronize(s), "sync");
          const auto t0 = std::chrono::steady_clock::now();
          for (int off = 0; off < ctx; off += o.prefill_chunk) {
            const int n = std::min(o.prefill_chunk, ctx - off);
            llama_forward(fwd, hp.n_layer,
                          ForwardStep{std::span<const int32_t>(prompt.data() + off, size_t(n)), false});
          }
          int32_t* d_next = nullptr;
          ck(cudaMallocAsync(reinterpret_cast<void**>(&d_next), 4, s), "alloc");
          fwd.argmax(d_next);
          int32_t next = 0;
          ck(cudaMemcpyAsync(&next, d_next, 4, cudaMemcpyDeviceToHost, s), "token");
          ck(cudaFreeAsync(d_next, s), "free");
          ck(cudaStreamSynchronize(s), "prefill");
          ttft = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          if (const uint32_t st = fwd.take_status())
            throw std::runtime_error("CUDA e2e: prefill raised " + describe_decode_status(st));
          cache.clear(s);
        }

        // Synthetic KV for every sequence: ctx - 7 tokens (a partial recent page), all layers.
        for (int b = 0; b < B; ++b) cache.extend(b, ctx - 7, s);
        const size_t pool_elems = size_t(cache.n_pages_pool()) * hp.n_head_kv * 16 * hp.head_dim;
        bench::fill_kv(cache.k_pool(), cache.v_pool(), pool_elems * hp.n_layer, hp.head_dim, true, uint32_t(ctx + B),
                       s);
        {  // Alg. 1 on every full page of every sequence, all layers in one launch
          std::vector<int32_t> full;
          for (int b = 0; b < B; ++b) {
            const auto& pl = cache.page_list(b);
            full.insert(full.end(), pl.begin(), pl.begin() + (ctx - 7) / 16);
          }
          DevMem d_full(full.size() * 4);
          ck(cudaMemcpyAsync(d_full.p, full.data(), full.size() * 4, cudaMemcpyHostToDevice, s), "pages");
          SummaryBuildParams bp;
          bp.k = cache.k_pool();
          bp.dtype = KvType::kBF16;
          bp.n_head_kv = hp.n_head_kv;
          bp.head_dim = hp.head_dim;
          bp.pages = d_full.as<int32_t>();
          bp.n_pages = int(full.size());
          bp.n_pages_pool = cache.n_pages_pool();
          bp.records = cache.records(0);
          bp.n_layers = hp.n_layer;
          bp.k_layer_stride = cache.k_layer_stride();
          bp.records_layer_stride = cache.records_layer_stride();
          ck(summary_build(bp, s), "summary build");
          ck(cudaStreamSynchronize(s), "summary build");
        }

        const std::vector<int32_t> tokens(B, 1);
        const ForwardStep step{tokens, true};
        Timer t;
        std::vector<double> dense, locks;
        for (int i = -o.warmup; i < o.steps; ++i)
          for (int k = 0; k < 2; ++k) {
            const bool sparse = (k == 0) == (i % 2 == 0);  // the order alternates every step
            fwd.set_sparse(sparse);
            const double us = time_step(fwd, hp, step, t);
            if (i >= 0) (sparse ? locks : dense).push_back(us);
          }
        if (const uint32_t st = fwd.take_status())
          throw std::runtime_error("CUDA e2e: decode raised " + describe_decode_status(st));
        const double md = median(dense) * 1e-3, ml = median(locks) * 1e-3;

        // The LOCKS step's parts, each captured alone (summary build: a step that fills pages, / 16).
        double part_ms[5] = {NAN, NAN, NAN, NAN, NAN};
        if (o.breakdown) {
          fwd.set_sparse(true);
          const unsigned parts[4] = {CudaForward::kPartGemm, CudaForward::kPartScoreSelect, CudaForward::kPartAttention,
                                     CudaForward::kPartSummary};
          for (int p = 0; p < 4; ++p) {
            fwd.set_parts(parts[p]);
            std::vector<double> v;
            for (int i = -2; i < 16 * 2; ++i) {
              const bool fills = cache.decode_fills_page();
              const double us = time_step(fwd, hp, step, t);
              if (i >= 0 && (p != 3 || fills)) v.push_back(us);
            }
            part_ms[p] = median(v) * 1e-3;
          }
          part_ms[3] /= 16.0;  // one page per sequence fills every 16 steps
          part_ms[4] = ml - part_ms[0] - part_ms[1] - part_ms[2] - part_ms[3];
          fwd.set_parts(CudaForward::kPartAll);
        }
        const double kv_bytes = double(B) * ctx * double(tok_kv);
        const double roofline = (double(weight_bytes) + kv_bytes) / read_gbs * 1e-6;
        char ttft_s[32] = "-";
        if (!std::isnan(ttft)) std::snprintf(ttft_s, sizeof ttft_s, "%.2f", ttft);
        std::printf("| %s | %dK | %d | %.2f | %.2f | %.2fx | %.2f | %.2f | %.2f | %.2f | %.2f | %.3f | %.2f | %s |\n",
                    sh.name.c_str(), ctx / 1024, B, md, ml, md / ml, roofline, md / roofline, part_ms[0], part_ms[1],
                    part_ms[2], part_ms[3], part_ms[4], ttft_s);
        std::fflush(stdout);
        if (csv) {
          std::fprintf(csv,
                       "%s,%d,%d,%d,%d,%d,%d,%d,%d,%.4f,%.4f,%.4f,%.4f,%zu,%.0f,%.4f,%.4f,%.4f,%.4f,%.4f,%.3f,%.1f\n",
                       sh.name.c_str(), hp.n_layer, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff, hp.n_vocab, ctx, B,
                       md, ml, md / ml, roofline, weight_bytes, kv_bytes, part_ms[0], part_ms[1], part_ms[2],
                       part_ms[3], part_ms[4], ttft, read_gbs);
          std::fflush(csv);
        }
      }
  }
  if (csv) std::fclose(csv);
  std::printf(
      "\nroofline: (weights + the K/V of every token) / measured read bandwidth; the LOCKS parts are each "
      "captured alone (other = the step - the parts: embedding, norms, RoPE + append, SwiGLU, conversions, "
      "bookkeeping, launch gaps)\n");
  return 0;
}

}  // namespace locks::cuda
