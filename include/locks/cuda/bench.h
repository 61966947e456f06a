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
