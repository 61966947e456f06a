// Host functions of one kernel file that another uses (internal to locks_cuda): the decode plan
// (decode_step.cu) sizes its grids from these occupancy queries and limits, and select_pages runs
// the one-kernel select of select_cluster.cu. Each is defined beside its kernel.
#pragma once

#include <cuda_runtime_api.h>

#include "locks/cuda/kernels.h"

namespace locks::cuda {

// score_pages.cu: resident score CTAs per SM for this head_dim and group.
int score_ctas_per_sm(int head_dim, int group);

// select_pages.cu: raises the select kernel's dynamic shared-memory limit for log_mass_stride
// pages (a host call, outside any graph capture).
cudaError_t prepare_select(int log_mass_stride);
// select_pages.cu: resident share CTAs per SM (merge: the instance that merges lse_total) and the
// pages one share CTA covers.
int share_ctas_per_sm(int group, bool merge);
int share_pages_per_cta();

// select_cluster.cu: clusters of `size` one-kernel select CTAs of pages_per_cta pages that fit at
// once (0: none, or the query failed); the launch of that select (SelectParams::cluster_pages).
int select_max_active_clusters(int group, bool merge, int size, int pages_per_cta);
cudaError_t select_pages_in_clusters(const SelectParams& p, cudaStream_t stream);

// decode_attention.cu: the most splits one (sequence, KV head) may take; resident attention CTAs
// per SM (sparse: the selected-list instance); clusters of `size` sparse-attention CTAs that fit at
// once (0: none, or the query failed).
int attention_max_splits();
int attention_ctas_per_sm(int head_dim, int group, KvType dtype, bool sparse);
int attention_max_active_clusters(int head_dim, KvType dtype, int size);

}  // namespace locks::cuda
