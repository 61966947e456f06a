// ForwardOps on CUDA (cuda_forward.h).
#include "cuda_forward.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "causal_attention.h"
#include "cuda_check.h"
#include "gemv.h"
#include "model_ops.h"

namespace locks::cuda {

namespace {

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

void check_cuda(cudaError_t e, const char* what) { throw_on_error(e, "CUDA engine", what); }

// Byte offsets of the step buffers inside one allocation.
struct BufferLayout {
  size_t tokens, x, xn, kv, q, att, att_bf, gate_up, ffn, logits, inv_freq, status, total = 0;
  BufferLayout(const LlamaHparams& hp, int rows, int seqs, size_t act) {
    const size_t R = rows, E = hp.n_embd, HD = hp.head_dim, NH = hp.n_head, NKV = hp.n_head_kv, F = hp.n_ff;
    auto take = [&](size_t bytes) {
      const size_t at = total;
      total += align256(bytes);
      return at;
    };
    tokens = take(R * 4);
    x = take(R * E * 4);
    xn = take(R * E * act);
    kv = take(R * 2 * NKV * HD * 4);
    q = take(R * NH * HD * 4);
    att = take(R * NH * HD * 4);
    att_bf = take(act == 4 ? 0 : R * NH * HD * 2);
    gate_up = take(R * 2 * F * 4);
    ffn = take(R * F * act);
    logits = take(size_t(seqs) * hp.n_vocab * 4);
    inv_freq = take(size_t(std::max(1, hp.n_rot / 2)) * 8);
    status = take(4);
  }
};

}  // namespace

void CudaForward::check(cudaError_t e, const char* what) const { check_cuda(e, what); }

// LOCKS_ENGINE_DEBUG=1: after each eager operation, the first non-finite value of its output.
void CudaForward::debug(const char* op, const void* buf, size_t n, bool f32) const {
  static const bool on = std::getenv("LOCKS_ENGINE_DEBUG") != nullptr;
  if (!on || capturing_) return;
  check_cuda(cudaStreamSynchronize(stream_), op);
  std::vector<uint32_t> h(f32 ? n : (n + 1) / 2);
  check_cuda(cudaMemcpy(h.data(), buf, f32 ? n * 4 : n * 2, cudaMemcpyDeviceToHost), op);
  double mx = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = f32 ? h[i] : (i % 2 ? h[i / 2] & 0xffff0000u : h[i / 2] << 16);
    float v;
    std::memcpy(&v, &bits, 4);
    if (!std::isfinite(v)) {
      std::fprintf(stderr, "[engine debug] %s: element %zu of %zu is %g\n", op, i, n, v);
      return;
    }
    mx = std::max(mx, double(std::fabs(v)));
  }
  std::fprintf(stderr, "[engine debug] %s: %zu finite, max |x| %g\n", op, n, mx);
}

CudaForward::CudaForward(std::shared_ptr<const DeviceWeights> weights, const EngineConfig& cfg)
    : w_(std::move(weights)), cfg_(cfg), hp_(w_->hp) {
  const int G = hp_.n_group();
  if (cfg.n_ctx < 1) throw std::invalid_argument("CUDA engine: context must be positive");
  if (cfg.max_seqs < 1 || cfg.max_seqs > 64) throw std::invalid_argument("CUDA engine: batch outside [1, 64]");
  if (cfg.max_rows < cfg.max_seqs) throw std::invalid_argument("CUDA engine: max_rows below the batch");
  if (hp_.head_dim % 2 || hp_.head_dim > 256)
    throw std::invalid_argument(fmt::format("CUDA engine: head_dim {} (even, at most 256)", hp_.head_dim));
  locks_capable_ = (hp_.head_dim == 64 || hp_.head_dim == 128) && G <= kMaxGroup;
  if (cfg.locks && cfg.oracle) throw std::invalid_argument("CUDA engine: decode with LOCKS or the oracle, not both");
  if ((cfg.locks || cfg.oracle) && !locks_capable_)
    throw std::invalid_argument(
        fmt::format("CUDA engine: the {} decode step supports head_dim 64 and 128 with GQA groups up to 16 (the "
                    "model has head_dim {}, group {}); use the dense step (selector full) or --device cpu",
                    cfg.locks ? "LOCKS" : "oracle", hp_.head_dim, G));
  sparse_ = cfg.locks || cfg.oracle;
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
  gemm_ = std::make_unique<Gemm>(stream_);

  f32_ = w_->type == WeightType::kF32;
  const BufferLayout lay(hp_, cfg.max_rows, cfg.max_seqs, f32_ ? 4 : 2);
  if (cudaMalloc(&buffers_, lay.total) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(fmt::format("CUDA engine: no GPU memory for the step buffers ({:.1f} MiB for {} rows)",
                                         double(lay.total) / (1 << 20), cfg.max_rows));
  }
  auto* base = static_cast<unsigned char*>(buffers_);
  tokens_ = reinterpret_cast<int32_t*>(base + lay.tokens);
  x_ = reinterpret_cast<float*>(base + lay.x);
  xn_ = base + lay.xn;
  kv_ = reinterpret_cast<float*>(base + lay.kv);
  q_ = reinterpret_cast<float*>(base + lay.q);
  att_ = reinterpret_cast<float*>(base + lay.att);
  att_in_ = f32_ ? static_cast<void*>(att_) : static_cast<void*>(base + lay.att_bf);
  gate_up_ = reinterpret_cast<float*>(base + lay.gate_up);
  ffn_ = base + lay.ffn;
  logits_ = reinterpret_cast<float*>(base + lay.logits);
  inv_freq_ = reinterpret_cast<double*>(base + lay.inv_freq);
  status_ = reinterpret_cast<uint32_t*>(base + lay.status);
  check(cudaMallocHost(reinterpret_cast<void**>(&tokens_pinned_), size_t(cfg.max_rows) * 4), "pinned tokens");
  check(cudaEventCreateWithFlags(&tokens_copied_, cudaEventDisableTiming), "event");
  check(cudaMemset(status_, 0, 4), "init");
  {  // RoPE frequencies base^(-2i/n_rot) / rope_freqs[i] (Llama-3.1 scaling), as the CPU engine computes them.
    std::vector<double> f(std::max(1, hp_.n_rot / 2), 0.0);
    if (!w_->rope_freqs.empty() && w_->rope_freqs.size() != size_t(hp_.n_rot / 2))
      throw std::invalid_argument("CUDA engine: rope_freqs has the wrong length");
    for (int i = 0; i < hp_.n_rot / 2; ++i)
      f[i] = std::pow(double(hp_.rope_freq_base), -2.0 * i / hp_.n_rot) /
             (w_->rope_freqs.empty() ? 1.0 : double(w_->rope_freqs[i]));
    check(cudaMemcpy(inv_freq_, f.data(), f.size() * 8, cudaMemcpyHostToDevice), "RoPE frequencies");
  }

  const int max_pages = (cfg.n_ctx + kPageSize - 1) / kPageSize;
  if (locks_capable_) {
    DecodeShape sh;
    sh.batch = cfg.max_seqs;
    sh.n_head_kv = hp_.n_head_kv;
    sh.group = G;
    sh.head_dim = hp_.head_dim;
    sh.dtype = cfg.kv_dtype;
    sh.max_pages = max_pages;
    sh.budget_pages = std::max(2, cfg.budget_pages);
    plan_ = std::make_unique<DecodePlan>(make_decode_plan(sh, cfg.device, cfg.balance));
    if (cudaMalloc(&workspace_, plan_->workspace_bytes) != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error(fmt::format("CUDA engine: no GPU memory for the decode workspace ({:.1f} MiB)",
                                           double(plan_->workspace_bytes) / (1 << 20)));
    }
    check(init_decode_workspace(*plan_, workspace_, stream_), "decode workspace");
  }

  DeviceKvConfig kc;
  kc.n_layer = hp_.n_layer;
  kc.n_head_kv = hp_.n_head_kv;
  kc.head_dim = hp_.head_dim;
  kc.dtype = cfg.kv_dtype;
  kc.max_seqs = cfg.max_seqs;
  kc.max_pages_per_seq = max_pages;
  kc.max_rows = cfg.max_rows;
  kc.summaries = cfg.locks;
  kc.n_pages_pool = cfg.n_pages_pool;
  kc.reserve_bytes = size_t(512) << 20;  // cuBLAS, graphs and the driver's own needs
  cache_ = std::make_unique<DeviceKvCache>(kc);
  check(cudaStreamSynchronize(stream_), "init");
}

CudaForward::~CudaForward() {
  abort();
  reset_graphs();
  if (stream_) cudaStreamSynchronize(stream_);
  gemm_.reset();
  cache_.reset();
  if (workspace_) cudaFree(workspace_);
  if (buffers_) cudaFree(buffers_);
  if (tokens_pinned_) cudaFreeHost(tokens_pinned_);
  if (tokens_copied_) cudaEventDestroy(tokens_copied_);
  if (stream_) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

void CudaForward::reset_graphs() {
  for (auto& row : graphs_)
    for (auto& g : row)
      if (g) {
        cudaGraphExecDestroy(g);
        g = nullptr;
      }
}

bool CudaForward::begin(const ForwardStep& step) {
  if (capturing_) throw std::logic_error("CUDA engine: a step began while another was being captured");
  const int n = int(step.tokens.size());
  decode_ = step.decode;
  if (decode_) {
    if (n != cfg_.max_seqs)
      throw std::invalid_argument(
          fmt::format("CUDA engine: a decode step takes one token per sequence ({}), not {}", cfg_.max_seqs, n));
    for (int b = 0; b < n; ++b) cache_->reserve(b, 1, stream_);
  } else {
    if (n < 1 || n > cfg_.max_rows)
      throw std::invalid_argument(
          fmt::format("CUDA engine: a prefill call takes 1 to {} tokens, not {}", cfg_.max_rows, n));
    prefill_seq_ = 0;
    cache_->reserve(prefill_seq_, n, stream_);
  }
  rows_ = n;
  // The pinned staging of the last step's tokens must have reached the device before it is reused.
  check(cudaEventSynchronize(tokens_copied_), "step");
  std::copy(step.tokens.begin(), step.tokens.end(), tokens_pinned_);
  check(cudaMemcpyAsync(tokens_, tokens_pinned_, size_t(n) * 4, cudaMemcpyHostToDevice, stream_), "tokens");
  check(cudaEventRecord(tokens_copied_, stream_), "step");
  if (!decode_) {
    cache_->advance(prefill_seq_, n, stream_);
    return true;
  }
  if (step.totals) account(*step.totals);
  const int fills = cache_->decode_fills_page() ? 1 : 0;
  graph_slot_fill_ = fills;
  if (cudaGraphExec_t g = graphs_[sparse_][fills]) {
    cache_->advance_host(-1, 1);
    check(cudaGraphLaunch(g, stream_), "decode graph");
    return false;
  }
  check(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), "graph capture");
  capturing_ = true;
  cache_->advance(-1, 1, stream_);
  return true;
}

void CudaForward::account(DecodeTotals& t) const {
  // Bytes of the step about to run (the new token included), as the CPU engine counts them: K/V of
  // the attended pages, plus the summaries of the other full pages and the partial page's keys.
  const double el = 2.0, head_dim = hp_.head_dim, per_head = double(hp_.n_layer) * hp_.n_head_kv;
  const double rec = plan_ ? double(summary_record_bytes(hp_.head_dim)) : 0.0;
  for (int b = 0; b < cfg_.max_seqs; ++b) {
    const double n = cache_->length(b) + 1.0;
    const double pages = std::ceil(n / kPageSize), last = n - (pages - 1) * kPageSize;
    const double dense = n * head_dim * el * 2;
    double read = dense;
    const double attended = (double(cfg_.budget_pages - 1) * kPageSize + last) * head_dim * el * 2;
    if (sparse_ && pages > cfg_.budget_pages)  // the oracle reads every key to score the pages
      read = (cfg_.oracle ? n * head_dim * el : (pages - 1) * rec + last * head_dim * el) + attended;
    t.dense_bytes += per_head * dense;
    t.bytes_read += per_head * read;
  }
}

void CudaForward::abort() noexcept {
  if (!capturing_) return;
  capturing_ = false;
  cudaGraph_t g = nullptr;
  cudaStreamEndCapture(stream_, &g);
  if (g) cudaGraphDestroy(g);
  cudaGetLastError();
}

void CudaForward::end() {
  if (!capturing_) return;
  capturing_ = false;
  cudaGraph_t graph = nullptr;
  check(cudaStreamEndCapture(stream_, &graph), "graph capture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(e, "graph instantiate");
  graphs_[sparse_][graph_slot_fill_] = exec;
  check(cudaGraphLaunch(exec, stream_), "decode graph");
}

void CudaForward::gemm(const void* x, const void* w, float* y, int rows, int n_out, int n_in, bool accumulate,
                       float* y2, int split) {
  if (!on(kPartGemm)) return;
  // Batch-1 decode: our GEMV streams the weights 5% faster than cuBLAS's GEMV (H200, GLM-4-9B shape);
  // at batch 4 cuBLAS's kernels are 8% faster than it, so larger batches stay with cuBLAS.
  if (!f32_ && cfg_.decode_gemv && rows == 1 && gemv_applies(rows, n_out, n_in)) {
    GemvParams g;
    g.x = static_cast<const uint16_t*>(x);
    g.w = static_cast<const uint16_t*>(w);
    g.rows = rows;
    g.n_out = n_out;
    g.n_in = n_in;
    g.split = y2 ? split : n_out;
    g.y = y;
    g.ldy = g.split;
    g.y2 = y2;
    g.ldy2 = n_out - g.split;
    g.accumulate = accumulate;
    check(gemv_bf16(g, stream_), "GEMV");
    return;
  }
  const size_t el = f32_ ? 4 : 2;
  const int n1 = y2 ? split : n_out;
  if (!gemm_->run(x, w, f32_, y, rows, n1, n_in, accumulate)) throw std::runtime_error(gemm_->error());
  if (y2 && !gemm_->run(x, static_cast<const char*>(w) + size_t(n1) * n_in * el, f32_, y2, rows, n_out - n1, n_in,
                        accumulate))
    throw std::runtime_error(gemm_->error());
}

void CudaForward::set_parts(unsigned parts) {
  reset_graphs();
  parts_ = parts;
}

void CudaForward::embed() {
  if (!on(kPartOther)) return;
  EmbedParams p;
  p.tokens = tokens_;
  p.table = w_->tok_embd;
  p.f32 = f32_;
  p.n_vocab = hp_.n_vocab;
  p.n_embd = hp_.n_embd;
  p.n_rows = rows_;
  p.x = x_;
  p.status = status_;
  check(embed_rows(p, stream_), "embedding");
  debug("embedding", x_, size_t(rows_) * hp_.n_embd, true);
}

void CudaForward::rmsnorm(int il, NormWeight which) {
  const bool out = which == NormWeight::kOutput;
  const float* w =
      out ? w_->output_norm : (which == NormWeight::kAttention ? w_->layers[il].attn_norm : w_->layers[il].ffn_norm);
  if (!on(kPartOther)) return;
  // The output norm of a prefill call needs the last row only.
  const int first = out && !decode_ ? rows_ - 1 : 0;
  RmsNormParams p;
  p.x = x_ + size_t(first) * hp_.n_embd;
  p.weight = w;
  p.n_rows = rows_ - first;
  p.n = hp_.n_embd;
  p.eps = hp_.rms_eps;
  p.out = xn_;
  p.out_f32 = f32_;
  check(rmsnorm_rows(p, stream_), "RMSNorm");
  debug("RMSNorm", xn_, size_t(rows_ - first) * hp_.n_embd, f32_);
}

void CudaForward::qkv(int il) {
  // Q and K|V into their own buffers (the attention kernels read q rows unstrided), one launch at batch 1.
  const int E = hp_.n_embd, nq = hp_.n_head * hp_.head_dim, nkv = 2 * hp_.n_head_kv * hp_.head_dim;
  gemm(xn_, w_->layers[il].w_qkv, q_, rows_, nq + nkv, E, false, kv_, nq);
  if (hp_.attn_bias) {  // qwen2: q += bq, k|v += bk|bv (the bias rows follow the fused weight rows)
    const float* b = w_->layers[il].b_qkv;
    AddBiasParams bq;
    bq.y = q_;
    bq.b = b;
    bq.n_rows = rows_;
    bq.n = nq;
    check(add_bias_rows(bq, stream_), "Q bias");
    AddBiasParams bkv;
    bkv.y = kv_;
    bkv.b = b + nq;
    bkv.n_rows = rows_;
    bkv.n = nkv;
    check(add_bias_rows(bkv, stream_), "K/V bias");
  }
  debug("Q", q_, size_t(rows_) * nq, true);
  debug("K|V", kv_, size_t(rows_) * nkv, true);
}

void CudaForward::rope_append(int il) {
  const PagedKvView kv = cache_->view(il);
  const int NKV = hp_.n_head_kv, HD = hp_.head_dim;
  if (on(kPartOther)) {
    if (hp_.attn_qk_norm) {  // qwen3: each head of q and of k RMSNormed over head_dim before RoPE
      RmsNormParams nq;
      nq.x = q_;
      nq.weight = w_->layers[il].q_norm;
      nq.n_rows = rows_ * hp_.n_head;
      nq.n = HD;
      nq.eps = hp_.rms_eps;
      nq.out = q_;
      nq.out_f32 = true;
      check(rmsnorm_rows(nq, stream_), "Q norm");
      RmsNormParams nk = nq;  // the K half of each K|V row: NKV heads, rows 2 NKV head_dim apart
      nk.x = kv_;
      nk.weight = w_->layers[il].k_norm;
      nk.n_rows = rows_ * NKV;
      nk.out = kv_;
      nk.group = NKV;
      nk.group_stride = 2 * NKV * HD;
      check(rmsnorm_rows(nk, stream_), "K norm");
    }
    RopeParams r;
    r.q = q_;
    r.n_head_q = hp_.n_head;
    r.k = kv_;
    r.n_head_k = NKV;
    r.k_stride = 2 * NKV * HD;
    r.n_rows = rows_;
    r.head_dim = HD;
    r.n_rot = hp_.n_rot;
    r.mode = hp_.rope_style == RopeStyle::kNeox ? RopeMode::kNeox : RopeMode::kNormal;
    r.positions = cache_->row_pos();
    r.inv_freq = inv_freq_;
    check(rope_rows(r, stream_), "RoPE");
    AppendKvParams a;
    a.k = kv_;
    a.v = kv_ + size_t(NKV) * HD;
    a.k_stride = a.v_stride = 2 * NKV * HD;
    a.n_rows = rows_;
    a.n_head_kv = NKV;
    a.head_dim = HD;
    a.row_seq = cache_->row_seq();
    a.row_pos = cache_->row_pos();
    a.batch = kv.batch;
    a.indptr = kv.indptr;
    a.indices = kv.indices;
    a.n_pages_pool = kv.n_pages_pool;
    a.k_pool = const_cast<void*>(kv.k);
    a.v_pool = const_cast<void*>(kv.v);
    a.dtype = cfg_.kv_dtype;
    a.status = status_;
    check(append_kv(a, stream_), "K/V append");
    debug("RoPE k|v", kv_, size_t(rows_) * 2 * NKV * HD, true);
  }
  // Alg. 1 on the pages this step filled (decode: one entry per sequence, -1 where none filled).
  const int n_filled = decode_ ? (graph_slot_fill_ ? cache_->n_filled() : 0) : cache_->n_filled();
  if (cfg_.locks && n_filled > 0 && on(kPartSummary)) {
    SummaryBuildParams s;
    s.k = kv.k;
    s.dtype = cfg_.kv_dtype;
    s.n_head_kv = NKV;
    s.head_dim = HD;
    s.pages = cache_->filled();
    s.n_pages = n_filled;
    s.n_pages_pool = cache_->n_pages_pool();
    s.records = cache_->records(il);
    s.status = status_;
    check(summary_build(s, stream_), "summary build");
  }
}

void CudaForward::attention(int il) {
  const float scale = 1.0f / std::sqrt(float(hp_.head_dim));
  const PagedKvView kv = cache_->view(il);
  if (decode_ && locks_capable_) {
    DecodeStepParams p;
    p.q = q_;
    p.kv = kv;
    p.summaries = cache_->records(il);
    p.n_pages_pool = cache_->n_pages_pool();
    p.scale = scale;
    p.o = att_;
    p.workspace = workspace_;
    if (parts_ == kPartAll || cfg_.oracle) {
      check(!sparse_      ? dense_decode_step(*plan_, p, stream_)
            : cfg_.oracle ? oracle_decode_step(*plan_, p, stream_)
                          : locks_decode_step(*plan_, p, stream_),
            "decode attention");
    } else if (sparse_) {  // the step's launches one by one, as locks_decode_step makes them
      if (on(kPartScoreSelect)) {
        check(score_pages(step_score_params(*plan_, p, true), stream_), "score pass");
        check(select_pages(step_select_params(*plan_, p, true), stream_), "select");
      }
      if (on(kPartAttention))
        check(paged_decode_attention(step_attention_params(*plan_, p, true), stream_), "sparse attention");
    } else if (on(kPartAttention)) {
      check(dense_decode_step(*plan_, p, stream_), "dense attention");
    }
  } else if (on(kPartAttention)) {
    CausalAttentionParams p;
    p.q = q_;
    p.kv = kv;
    p.row_seq = cache_->row_seq();
    p.row_pos = cache_->row_pos();
    p.n_rows = rows_;
    p.group = hp_.n_group();
    p.scale = scale;
    p.o = att_;
    p.status = status_;
    if (!decode_) {  // consecutive positions of one sequence: the tiled tensor-core path
      p.contiguous = true;
      p.seq = prefill_seq_;
      p.pos0 = cache_->length(prefill_seq_) - rows_;
    }
    check(causal_attention(p, stream_), "attention");
  }
  debug("attention", att_, size_t(rows_) * hp_.n_head * hp_.head_dim, true);
  if (!f32_ && on(kPartOther))
    check(f32_to_bf16(att_, att_in_, size_t(rows_) * hp_.n_head * hp_.head_dim, stream_), "attention output");
}

void CudaForward::project_add(int il, Projection which) {
  const DeviceLayer& L = w_->layers[il];
  if (which == Projection::kOutput)
    gemm(att_in_, L.w_o, x_, rows_, hp_.n_embd, hp_.n_head * hp_.head_dim, true);
  else
    gemm(ffn_, L.w_down, x_, rows_, hp_.n_embd, hp_.n_ff, true);
  debug(which == Projection::kOutput ? "x + att W_o" : "x + ffn W_down", x_, size_t(rows_) * hp_.n_embd, true);
}

void CudaForward::gate_up_swiglu(int il) {
  const int F = hp_.n_ff;
  gemm(xn_, w_->layers[il].w_gate_up, gate_up_, rows_, 2 * F, hp_.n_embd, false);
  if (!on(kPartOther)) return;
  SwigluParams p;
  p.gate = gate_up_;
  p.up = gate_up_ + F;
  p.gate_stride = p.up_stride = 2 * F;
  p.n_rows = rows_;
  p.n_ff = F;
  p.out = ffn_;
  p.out_f32 = f32_;
  check(swiglu_rows(p, stream_), "SwiGLU");
  debug("SwiGLU", ffn_, size_t(rows_) * F, f32_);
}

void CudaForward::logits() {
  gemm(xn_, w_->output, logits_, decode_ ? rows_ : 1, hp_.n_vocab, hp_.n_embd, false);
  debug("logits", logits_, size_t(decode_ ? rows_ : 1) * hp_.n_vocab, true);
}

void CudaForward::read_logits(int seq, std::span<float> out) {
  if (out.size() != size_t(hp_.n_vocab)) throw std::invalid_argument("CUDA engine: logits buffer size");
  check(
      cudaMemcpyAsync(out.data(), logits_ + size_t(seq) * hp_.n_vocab, out.size() * 4, cudaMemcpyDeviceToHost, stream_),
      "logits");
  if (const uint32_t st = take_status(); st != 0) throw std::runtime_error("CUDA engine: " + describe_status(st));
}

void CudaForward::argmax(int32_t* ids) {
  ArgmaxParams p;
  p.logits = logits_;
  p.n_rows = decode_ ? rows_ : 1;
  p.n_vocab = hp_.n_vocab;
  p.ids = ids;
  p.status = status_;
  check(argmax_rows(p, stream_), "argmax");
}

uint32_t CudaForward::take_status() {
  uint32_t st = 0, plan_st = 0;
  check(cudaMemcpyAsync(&st, status_, 4, cudaMemcpyDeviceToHost, stream_), "status");
  check(cudaMemsetAsync(status_, 0, 4, stream_), "status");
  if (plan_) check(read_decode_status(*plan_, workspace_, &plan_st, true, stream_), "status");
  check(cudaStreamSynchronize(stream_), "step");
  return st | plan_st;
}

std::unique_ptr<CudaForward> CudaForward::fork(EngineConfig cfg) const {
  if (capturing_) throw std::logic_error("CUDA engine: fork during a graph capture");
  cfg.n_ctx = cfg_.n_ctx;
  cfg.max_seqs = cfg_.max_seqs;
  cfg.kv_dtype = cfg_.kv_dtype;
  cfg.device = cfg_.device;
  check(cudaStreamSynchronize(stream_), "fork");
  auto f = std::make_unique<CudaForward>(w_, cfg);
  const bool copied = f->cache_->copy_from(*cache_, f->stream_);
  if (cfg.locks && !copied) f->summarize_full_pages();
  check(cudaStreamSynchronize(f->stream_), "fork");
  return f;
}

void CudaForward::summarize_full_pages() {
  std::vector<int32_t> ids;
  for (int b = 0; b < cfg_.max_seqs; ++b) {
    const auto& pages = cache_->page_list(b);
    ids.insert(ids.end(), pages.begin(), pages.begin() + cache_->length(b) / kPageSize);
  }
  if (ids.empty()) return;
  int32_t* d_ids = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&d_ids), ids.size() * 4), "summary build");
  SummaryBuildParams s;
  s.k = cache_->view(0).k;
  s.dtype = cfg_.kv_dtype;
  s.n_head_kv = hp_.n_head_kv;
  s.head_dim = hp_.head_dim;
  s.pages = d_ids;
  s.n_pages = int(ids.size());
  s.n_pages_pool = cache_->n_pages_pool();
  s.records = cache_->records(0);
  s.status = status_;
  s.n_layers = hp_.n_layer;
  s.k_layer_stride = cache_->k_layer_stride();
  s.records_layer_stride = cache_->records_layer_stride();
  cudaError_t e = cudaMemcpyAsync(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice, stream_);
  if (e == cudaSuccess) e = summary_build(s, stream_);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
  cudaFree(d_ids);
  check(e, "summary build");
}

std::unique_ptr<ForwardOps> cuda_fork(const ForwardOps& src, EngineConfig cfg) {
  const auto* f = dynamic_cast<const CudaForward*>(&src);
  if (!f) throw std::invalid_argument("cuda_fork: the source is not a CUDA engine");
  return f->fork(cfg);
}

std::string describe_status(uint32_t status) {
  const uint32_t model_bits = status & ~0xffu;
  std::string s = describe_decode_status(status & 0xffu);
  if (model_bits) s += (s.empty() ? "" : "; ") + describe_model_status(model_bits);
  return s;
}

std::unique_ptr<ForwardOps> make_cuda_forward(const LlamaModel& model, const EngineConfig& cfg) {
  std::string why;
  if (!device_available(&why)) throw std::runtime_error(why);
  if (!cublas_available(&why)) throw std::runtime_error(why);
  if (cfg.device >= 0) check_cuda(cudaSetDevice(cfg.device), "cudaSetDevice");
  const bool tied = model.output.data.empty();
  constexpr size_t kF32Limit = size_t(2) << 30;
  const WeightType type = cfg.weights == EngineWeights::kF32                                        ? WeightType::kF32
                          : cfg.weights == EngineWeights::kBF16                                     ? WeightType::kBF16
                          : DeviceWeights::bytes_for(model.hp, tied, WeightType::kF32) <= kF32Limit ? WeightType::kF32
                                                                                                    : WeightType::kBF16;
  auto weights = std::make_shared<DeviceWeights>(DeviceWeights::upload(model, type));
  return std::make_unique<CudaForward>(std::move(weights), cfg);
}

}  // namespace locks::cuda
