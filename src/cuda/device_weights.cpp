// Weight upload (host float32 -> device bf16) and random weights for benchmarks.
#include "device_weights.h"

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "locks/quant.h"
#include "model_ops.h"

namespace locks::cuda {

namespace {

void check(cudaError_t e, const char* what) { throw_on_error(e, "CUDA weights", what); }

size_t align_up(size_t x) { return (x + 255) / 256 * 256; }
size_t elem_bytes(WeightType t) { return t == WeightType::kF32 ? 4 : 2; }
const char* type_name(WeightType t) { return t == WeightType::kF32 ? "float32" : "bf16"; }

// Byte offsets of every tensor inside the one allocation, in upload order.
struct Layout {
  struct LayerOff {
    size_t qkv, o, gate_up, down, attn_norm, ffn_norm, b_qkv, q_norm, k_norm;
  };
  size_t tok_embd = 0, output = 0, output_norm = 0, total = 0;
  std::vector<LayerOff> layers;

  Layout(const LlamaHparams& hp, bool tied, size_t el) {
    const size_t E = hp.n_embd, HD = hp.head_dim, F = hp.n_ff;
    const size_t qkv_rows = (size_t(hp.n_head) + 2 * size_t(hp.n_head_kv)) * HD;
    auto take = [&](size_t bytes) {
      const size_t at = total;
      total += align_up(bytes);
      return at;
    };
    tok_embd = take(size_t(hp.n_vocab) * E * el);
    output = tied ? tok_embd : take(size_t(hp.n_vocab) * E * el);
    output_norm = take(E * 4);
    for (int il = 0; il < hp.n_layer; ++il) {
      LayerOff l;
      l.qkv = take(qkv_rows * E * el);
      l.o = take(E * size_t(hp.n_head) * HD * el);
      l.gate_up = take(2 * F * E * el);
      l.down = take(E * F * el);
      l.attn_norm = take(E * 4);
      l.ffn_norm = take(E * 4);
      l.b_qkv = hp.attn_bias ? take(qkv_rows * 4) : 0;
      l.q_norm = hp.attn_qk_norm ? take(HD * 4) : 0;
      l.k_norm = hp.attn_qk_norm ? take(HD * 4) : 0;
      layers.push_back(l);
    }
  }
};

void allocate(DeviceWeights& w, void*& storage, const Layout& lay, const std::string& what) {
  size_t free_b = 0, total_b = 0;
  check(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  if (lay.total > free_b)
    throw std::runtime_error(
        fmt::format("{} needs {:.1f} GiB of GPU memory for its {} weights; {:.1f} GiB of {:.1f} "
                    "are free",
                    what, double(lay.total) / (1 << 30), type_name(w.type), double(free_b) / (1 << 30),
                    double(total_b) / (1 << 30)));
  if (cudaMalloc(&storage, lay.total) != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(fmt::format("{} needs {:.1f} GiB of GPU memory for its {} weights: cudaMalloc refused it",
                                         what, double(lay.total) / (1 << 30), type_name(w.type)));
  }
  w.bytes = lay.total;
  auto* base = static_cast<unsigned char*>(storage);
  w.tok_embd = base + lay.tok_embd;
  w.output = base + lay.output;
  w.output_norm = reinterpret_cast<const float*>(base + lay.output_norm);
  w.layers.clear();
  for (const auto& l : lay.layers) {
    DeviceLayer d;
    d.w_qkv = base + l.qkv;
    d.w_o = base + l.o;
    d.w_gate_up = base + l.gate_up;
    d.w_down = base + l.down;
    d.attn_norm = reinterpret_cast<const float*>(base + l.attn_norm);
    d.ffn_norm = reinterpret_cast<const float*>(base + l.ffn_norm);
    if (w.hp.attn_bias) d.b_qkv = reinterpret_cast<const float*>(base + l.b_qkv);
    if (w.hp.attn_qk_norm) {
      d.q_norm = reinterpret_cast<const float*>(base + l.q_norm);
      d.k_norm = reinterpret_cast<const float*>(base + l.k_norm);
    }
    w.layers.push_back(d);
  }
}

// Host float32 rows -> the weight type at a device address (an element offset), through a bounded
// staging buffer.
class Uploader {
 public:
  explicit Uploader(WeightType t) : type_(t) {}
  void matrix(const void* dst, size_t at, const std::vector<float>& src) {
    if (type_ == WeightType::kF32) {
      f32(static_cast<const float*>(dst) + at, src.data(), src.size());
      return;
    }
    auto* d = static_cast<uint16_t*>(const_cast<void*>(dst)) + at;
    const size_t n = src.size();
    for (size_t off = 0; off < n; off += kChunk) {
      const size_t m = std::min(kChunk, n - off);
      stage_.resize(m);
      for (size_t i = 0; i < m; ++i) stage_[i] = locks::f32_to_bf16(src[off + i]);
      check(cudaMemcpy(d + off, stage_.data(), m * 2, cudaMemcpyHostToDevice), "upload");
    }
  }
  void f32(const void* dst, const float* src, size_t n) {
    check(cudaMemcpy(const_cast<void*>(dst), src, n * 4, cudaMemcpyHostToDevice), "upload");
  }

 private:
  static constexpr size_t kChunk = size_t(1) << 22;
  WeightType type_;
  std::vector<uint16_t> stage_;
};

}  // namespace

size_t DeviceWeights::bytes_for(const LlamaHparams& hp, bool tied_output, WeightType type) {
  return Layout(hp, tied_output, elem_bytes(type)).total;
}

DeviceWeights DeviceWeights::upload(const LlamaModel& m, WeightType type) {
  const LlamaHparams& hp = m.hp;
  const bool tied = m.output.data.empty();
  const Layout lay(hp, tied, elem_bytes(type));
  DeviceWeights w;
  w.hp = hp;
  w.type = type;
  w.rope_freqs = m.rope_freqs;
  allocate(w, w.storage_, lay, fmt::format("model '{}'", m.name));
  Uploader up(type);
  const size_t E = hp.n_embd;
  up.matrix(w.tok_embd, 0, m.tok_embd.data);
  if (!tied) up.matrix(w.output, 0, m.output.data);
  up.f32(w.output_norm, m.output_norm.data(), E);
  for (int il = 0; il < hp.n_layer; ++il) {
    const LlamaLayer& L = m.layers[il];
    const DeviceLayer& d = w.layers[il];
    // Q, K, V rows stacked: one product gives q | k | v per token.
    up.matrix(d.w_qkv, 0, L.wq.data);
    up.matrix(d.w_qkv, L.wq.data.size(), L.wk.data);
    up.matrix(d.w_qkv, L.wq.data.size() + L.wk.data.size(), L.wv.data);
    up.matrix(d.w_o, 0, L.wo.data);
    up.matrix(d.w_gate_up, 0, L.w_gate.data);
    up.matrix(d.w_gate_up, L.w_gate.data.size(), L.w_up.data);
    up.matrix(d.w_down, 0, L.w_down.data);
    up.f32(d.attn_norm, L.attn_norm.data(), E);
    up.f32(d.ffn_norm, L.ffn_norm.data(), E);
    if (hp.attn_bias) {  // bq | bk | bv, as the fused rows
      up.f32(d.b_qkv, L.bq.data(), L.bq.size());
      up.f32(d.b_qkv + L.bq.size(), L.bk.data(), L.bk.size());
      up.f32(d.b_qkv + L.bq.size() + L.bk.size(), L.bv.data(), L.bv.size());
    }
    if (hp.attn_qk_norm) {
      up.f32(d.q_norm, L.attn_q_norm.data(), L.attn_q_norm.size());
      up.f32(d.k_norm, L.attn_k_norm.data(), L.attn_k_norm.size());
    }
  }
  return w;
}

DeviceWeights DeviceWeights::random(const LlamaHparams& hp, uint64_t seed, bool tied_output) {
  const Layout lay(hp, tied_output, 2);
  DeviceWeights w;
  w.hp = hp;
  allocate(w, w.storage_, lay,
           fmt::format("a {}-layer model of n_embd {} and vocabulary {}", hp.n_layer, hp.n_embd, hp.n_vocab));
  const size_t E = hp.n_embd, HD = hp.head_dim, F = hp.n_ff;
  uint64_t s = seed;
  auto fill = [&](const void* p, size_t n, size_t n_in) {
    check(fill_uniform_bf16(const_cast<void*>(p), n, std::sqrt(3.0f / float(n_in)), ++s, nullptr), "random weights");
  };
  auto ones = [&](const float* p, size_t n) { check(fill_f32(const_cast<float*>(p), n, 1.0f, nullptr), "norms"); };
  fill(w.tok_embd, size_t(hp.n_vocab) * E, 3);  // unit-variance embeddings
  if (!tied_output) fill(w.output, size_t(hp.n_vocab) * E, E);
  ones(w.output_norm, E);
  for (const DeviceLayer& d : w.layers) {
    fill(d.w_qkv, (size_t(hp.n_head) + 2 * size_t(hp.n_head_kv)) * HD * E, E);
    fill(d.w_o, E * size_t(hp.n_head) * HD, size_t(hp.n_head) * HD);
    fill(d.w_gate_up, 2 * F * E, E);
    fill(d.w_down, E * F, F);
    ones(d.attn_norm, E);
    ones(d.ffn_norm, E);
    if (d.b_qkv)
      check(fill_f32(const_cast<float*>(d.b_qkv), (size_t(hp.n_head) + 2 * size_t(hp.n_head_kv)) * HD, 0.0f, nullptr),
            "biases");
    if (d.q_norm) ones(d.q_norm, HD);
    if (d.k_norm) ones(d.k_norm, HD);
  }
  check(cudaGetLastError(), "random weights");
  check(cudaDeviceSynchronize(), "random weights");
  return w;
}

DeviceWeights::DeviceWeights(DeviceWeights&& o) noexcept { *this = std::move(o); }
DeviceWeights& DeviceWeights::operator=(DeviceWeights&& o) noexcept {
  if (this != &o) {
    if (storage_) cudaFree(storage_);
    hp = o.hp;
    type = o.type;
    rope_freqs = std::move(o.rope_freqs);
    tok_embd = o.tok_embd;
    output = o.output;
    output_norm = o.output_norm;
    layers = std::move(o.layers);
    bytes = o.bytes;
    storage_ = std::exchange(o.storage_, nullptr);
  }
  return *this;
}
DeviceWeights::~DeviceWeights() {
  if (storage_) cudaFree(storage_);
}

}  // namespace locks::cuda
