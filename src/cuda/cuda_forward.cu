// ForwardOps on CUDA (cuda_forward.h).
#include "cuda_forward.h"

#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>

#include <fmt/format.h>

#include "causal_attention.h"
#include "model_ops.h"
#include "rope_append.h"

namespace locks::cuda {

namespace {

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

// Byte offsets of the step buffers inside one allocation.
struct BufferLayout {
  size_t tokens, x, xn, qkv, q, att, att_bf, gate_up, ffn, logits, inv_freq, status, total = 0;
  BufferLayout(const LlamaHparams& hp, int rows, int seqs) {
    const size_t R = rows, E = hp.n_embd, HD = hp.head_dim, NH = hp.n_head, NKV = hp.n_head_kv, F = hp.n_ff;
    auto take = [&](size_t bytes) {
      const size_t at = total;
      total += align256(bytes);
      return at;
    };
    tokens = take(R * 4);
    x = take(R * E * 4);
    xn = take(R * E * 2);
    qkv = take(R * (NH + 2 * NKV) * HD * 4);
    q = take(R * NH * HD * 4);
    att = take(R * NH * HD * 4);
    att_bf = take(R * NH * HD * 2);
    gate_up = take(R * 2 * F * 4);
    ffn = take(R * F * 2);
    logits = take(size_t(seqs) * hp.n_vocab * 4);
    inv_freq = take(size_t(std::max(1, hp.n_rot / 2)) * 8);
    status = take(4);
  }
};

}  // namespace

void CudaForward::check(cudaError_t e, const char* what) const {
  if (e == cudaSuccess) return;
  cudaGetLastError();
  throw std::runtime_error(fmt::format("CUDA engine: {}: {}", what, cudaGetErrorString(e)));
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
  if (cfg.locks && !locks_capable_)
    throw std::invalid_argument(
        fmt::format("CUDA engine: the LOCKS decode step supports head_dim 64 and 128 with GQA groups up to 16 (the "
                    "model has head_dim {}, group {}); use the dense step (selector full) or --device cpu",
                    hp_.head_dim, G));
  sparse_ = cfg.locks;
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
  gemm_ = std::make_unique<Gemm>(stream_);

  const BufferLayout lay(hp_, cfg.max_rows, cfg.max_seqs);
  if (cudaMalloc(&buffers_, lay.total) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(fmt::format("CUDA engine: no GPU memory for the step buffers ({:.1f} MiB for {} rows)",
                                         double(lay.total) / (1 << 20), cfg.max_rows));
  }
  auto* base = static_cast<unsigned char*>(buffers_);
  tokens_ = reinterpret_cast<int32_t*>(base + lay.tokens);
  x_ = reinterpret_cast<float*>(base + lay.x);
  xn_ = reinterpret_cast<uint16_t*>(base + lay.xn);
  qkv_ = reinterpret_cast<float*>(base + lay.qkv);
  q_ = reinterpret_cast<float*>(base + lay.q);
  att_ = reinterpret_cast<float*>(base + lay.att);
  att_bf_ = reinterpret_cast<uint16_t*>(base + lay.att_bf);
  gate_up_ = reinterpret_cast<float*>(base + lay.gate_up);
  ffn_ = reinterpret_cast<uint16_t*>(base + lay.ffn);
  logits_ = reinterpret_cast<float*>(base + lay.logits);
  inv_freq_ = reinterpret_cast<double*>(base + lay.inv_freq);
  status_ = reinterpret_cast<uint32_t*>(base + lay.status);
  check(cudaMallocHost(&tokens_pinned_, size_t(cfg.max_rows) * 4), "pinned tokens");
  check(cudaEventCreateWithFlags(&tokens_copied_, cudaEventDisableTiming), "event");
  check(cudaMemset(status_, 0, 4), "init");
  {  // RoPE frequencies base^(-2i/n_rot), as the CPU engine computes them.
    std::vector<double> f(std::max(1, hp_.n_rot / 2), 0.0);
    for (int i = 0; i < hp_.n_rot / 2; ++i) f[i] = std::pow(double(hp_.rope_freq_base), -2.0 * i / hp_.n_rot);
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
      throw std::invalid_argument(fmt::format("CUDA engine: a prefill call takes 1 to {} tokens, not {}", cfg_.max_rows, n));
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

void CudaForward::gemm(const void* x, const uint16_t* w, float* y, int rows, int n_out, int n_in, bool accumulate) {
  if (!on(kPartGemm)) return;
  if (!gemm_->bf16(x, w, y, rows, n_out, n_in, accumulate)) throw std::runtime_error(gemm_->error());
}

void CudaForward::set_parts(unsigned parts) {
  reset_graphs();
  parts_ = parts;
}

void CudaForward::embed() {
  if (!on(kPartOther)) return;
  check(embed_rows(tokens_, rows_, w_->tok_embd, hp_.n_vocab, hp_.n_embd, x_, status_, stream_), "embedding");
}

void CudaForward::rmsnorm(int il, NormWeight which) {
  const bool out = which == NormWeight::kOutput;
  const float* w = out ? w_->output_norm
                       : (which == NormWeight::kAttention ? w_->layers[il].attn_norm : w_->layers[il].ffn_norm);
  if (!on(kPartOther)) return;
  // The output norm of a prefill call needs the last row only.
  const int first = out && !decode_ ? rows_ - 1 : 0;
  check(rmsnorm_rows(x_ + size_t(first) * hp_.n_embd, w, rows_ - first, hp_.n_embd, hp_.rms_eps, xn_, stream_),
        "RMSNorm");
}

void CudaForward::qkv(int il) {
  gemm(xn_, w_->layers[il].w_qkv, qkv_, rows_, (hp_.n_head + 2 * hp_.n_head_kv) * hp_.head_dim, hp_.n_embd, false);
}

void CudaForward::rope_append(int il) {
  const PagedKvView kv = cache_->view(il);
  if (on(kPartOther)) {
  RopeAppendParams p;
  p.qkv = qkv_;
  p.q = q_;
  p.k_pool = const_cast<void*>(kv.k);
  p.v_pool = const_cast<void*>(kv.v);
  p.dtype = cfg_.kv_dtype;
  p.row_seq = cache_->row_seq();
  p.row_pos = cache_->row_pos();
  p.page_list = cache_->page_list_device();
  p.page_stride = cache_->config().max_pages_per_seq;
  p.n_pages_pool = cache_->n_pages_pool();
  p.n_rows = rows_;
  p.n_head = hp_.n_head;
  p.n_head_kv = hp_.n_head_kv;
  p.head_dim = hp_.head_dim;
  p.n_rot = hp_.n_rot;
  p.mode = RopeMode::kNormal;
  p.inv_freq = inv_freq_;
  p.status = status_;
  check(cuda::rope_append(p, stream_), "RoPE + append");
  }
  // Alg. 1 on the pages this step filled (decode: one entry per sequence, -1 where none filled).
  const int n_filled = decode_ ? (graph_slot_fill_ ? cache_->n_filled() : 0) : cache_->n_filled();
  if (cfg_.locks && n_filled > 0 && on(kPartSummary)) {
    SummaryBuildParams s;
    s.k = kv.k;
    s.dtype = cfg_.kv_dtype;
    s.n_head_kv = hp_.n_head_kv;
    s.head_dim = hp_.head_dim;
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
    if (parts_ == kPartAll) {
      check(sparse_ ? locks_decode_step(*plan_, p, stream_) : dense_decode_step(*plan_, p, stream_),
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
  if (on(kPartOther))
    check(f32_to_bf16(att_, size_t(rows_) * hp_.n_head * hp_.head_dim, att_bf_, stream_), "attention output");
}

void CudaForward::project_add(int il, Projection which) {
  const DeviceLayer& L = w_->layers[il];
  if (which == Projection::kOutput)
    gemm(att_bf_, L.w_o, x_, rows_, hp_.n_embd, hp_.n_head * hp_.head_dim, true);
  else
    gemm(ffn_, L.w_down, x_, rows_, hp_.n_embd, hp_.n_ff, true);
}

void CudaForward::gate_up_swiglu(int il) {
  const int F = hp_.n_ff;
  gemm(xn_, w_->layers[il].w_gate_up, gate_up_, rows_, 2 * F, hp_.n_embd, false);
  if (on(kPartOther)) check(swiglu_rows(gate_up_, gate_up_ + F, 2 * F, rows_, F, ffn_, stream_), "SwiGLU");
}

void CudaForward::logits() {
  gemm(xn_, w_->output, logits_, decode_ ? rows_ : 1, hp_.n_vocab, hp_.n_embd, false);
}

void CudaForward::read_logits(int seq, std::span<float> out) {
  if (out.size() != size_t(hp_.n_vocab)) throw std::invalid_argument("CUDA engine: logits buffer size");
  check(cudaMemcpyAsync(out.data(), logits_ + size_t(seq) * hp_.n_vocab, out.size() * 4, cudaMemcpyDeviceToHost,
                        stream_),
        "logits");
  if (const uint32_t st = take_status(); st != 0)
    throw std::runtime_error("CUDA engine: " + describe_decode_status(st));
}

void CudaForward::argmax(int32_t* ids) {
  check(argmax_rows(logits_, decode_ ? rows_ : 1, hp_.n_vocab, ids, status_, stream_), "argmax");
}

uint32_t CudaForward::take_status() {
  uint32_t st = 0, plan_st = 0;
  check(cudaMemcpyAsync(&st, status_, 4, cudaMemcpyDeviceToHost, stream_), "status");
  check(cudaMemsetAsync(status_, 0, 4, stream_), "status");
  if (plan_) check(read_decode_status(*plan_, workspace_, &plan_st, true, stream_), "status");
  check(cudaStreamSynchronize(stream_), "step");
  return st | plan_st;
}

std::unique_ptr<ForwardOps> make_cuda_forward(const LlamaModel& model, const EngineConfig& cfg) {
  std::string why;
  if (!device_available(&why)) throw std::runtime_error(why);
  auto weights = std::make_shared<DeviceWeights>(DeviceWeights::upload(model));
  return std::make_unique<CudaForward>(std::move(weights), cfg);
}

}  // namespace locks::cuda
