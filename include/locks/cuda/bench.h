// `locks bench --device cuda`: per-layer decode-attention latency and bytes read on the GPU, LOCKS
// step (score + select + sparse attention + merge) against our dense paged kernel, summary build
// throughput, and the measured read bandwidth of the device, all in one process.
#pragma once

#include <string>
#include <vector>

namespace locks::cuda {

struct BenchShape {
  std::string name;  // e.g. "llama3.1-8b"
  int n_head_kv = 8;
  int group = 4;  // query heads per KV head
  int head_dim = 128;
  std::vector<int> contexts;  // tokens per sequence
};

struct BenchOptions {
  std::vector<BenchShape> shapes;  // empty: default_bench_shapes()
  std::vector<int> batches = {1, 2, 4, 8};
  int budget_tokens = 2048;  // LOCKS budget b (multiple of 16)
  int runs = 30;             // timed runs per point (median reported)
  int warmup = 5;
  bool bf16 = true;        // KV dtype (bf16 like the torch SDPA comparison; else f16)
  bool pdl = true;         // programmatic dependent launch between the step's kernels
  bool ragged = false;     // sequence b of a batch holds context >> b tokens (else every one holds context)
  bool balance = true;     // make_decode_plan's balance: grids follow the actual lengths at run time
  std::string csv;         // optional CSV output path
  double max_gib = 100.0;  // skip points whose KV cache exceeds this
};

/// The default shapes: Llama-3.1-8B (8 KV heads) and GLM-4-9B-1M with 4 and 2 KV heads.
std::vector<BenchShape> default_bench_shapes();

/// Runs the benchmark, prints a Markdown table; returns a process exit code. Throws
/// std::runtime_error when no usable CUDA device is present.
int run_bench(const BenchOptions& opts);

}  // namespace locks::cuda

namespace locks::cuda {

/// A model shape for the end-to-end benchmark (random bf16 weights made on the GPU).
struct E2eShape {
  std::string name;  // e.g. "glm4-9b-1m-kv4"
  int n_layer = 32, n_head = 32, n_head_kv = 8, head_dim = 128, n_ff = 14336, n_vocab = 128256;
  std::vector<int> contexts;  // tokens per sequence
};

struct E2eOptions {
  std::vector<E2eShape> shapes;  // empty: default_e2e_shapes()
  std::vector<int> batches = {1, 2, 4, 8};
  int budget_tokens = 2048;  // LOCKS budget b (multiple of 16)
  int steps = 24;            // timed decode steps per engine (median)
  int warmup = 3;
  int prefill_max_context = 131072;  // batch-1 rows up to this context also prefill for real (TTFT)
  int prefill_chunk = 4096;          // tokens per prefill call
  bool breakdown = true;             // time the LOCKS step's parts apart
  bool cublas_decode = false;        // decode's weight products through cuBLAS instead of our GEMV
  std::string csv;                   // optional CSV output path
};

/// Llama-3.1-8B (32 layers, 32 / 8 heads, FFN 14336, vocab 128256) and the GLM-4-9B-1M shape
/// (40 layers, 32 query heads with 4 and with 2 KV heads, FFN 13696, vocab 151552), head_dim 128.
std::vector<E2eShape> default_e2e_shapes();

/// Per-token decode latency (TPOT) of whole models on the GPU, dense against LOCKS, alternating in
/// one process, with the dense roofline and the LOCKS step's parts; prints a Markdown table and
/// returns a process exit code. Throws std::runtime_error without a usable CUDA device or cuBLAS.
int run_e2e_bench(const E2eOptions& opts);

}  // namespace locks::cuda
