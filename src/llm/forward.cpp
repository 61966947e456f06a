// The forward pass, top to bottom (forward.h): embed -> per layer {RMSNorm, QKV, RoPE + append K/V
// (+ Alg. 1 on pages that filled), attention (decode: select -> attend, Alg. 2), output projection,
// RMSNorm, SwiGLU FFN} -> final norm -> logits.
#include "locks/forward.h"

#include "locks/model.h"

namespace locks {

void llama_forward(ForwardOps& ops, const LlamaHparams& hp, const ForwardStep& step) {
  if (!ops.begin(step)) return;  // the device replayed a graph it captured from these same calls
  try {
    ops.embed();
    for (int il = 0; il < hp.n_layer; ++il) {
      ops.rmsnorm(il, NormWeight::kAttention);
      ops.qkv(il);
      ops.rope_append(il);
      ops.attention(il);
      ops.project_add(il, Projection::kOutput);
      ops.rmsnorm(il, NormWeight::kFeedForward);
      ops.gate_up_swiglu(il);
      ops.project_add(il, Projection::kDown);
    }
    ops.rmsnorm(-1, NormWeight::kOutput);
    ops.logits();
  } catch (...) {
    ops.abort();
    throw;
  }
  ops.end();
}

}  // namespace locks
