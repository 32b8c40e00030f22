// Multi-head latent attention kernels on the device (the CUDA side of
// kernels/backend.h's WriteLatentKv and MlaAttention, same semantics as the
// CPU backend's kernels/cpu/mla_attention.cpp). The CUDA backend queues them
// on its stream; every pointer is device memory, the AttentionBatch arrays
// included.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/backend.h"

namespace pdserve::cuda {

// The widest latent (kv_lora_rank + rope_dim) MlaAttention takes.
inline constexpr int64_t kMaxMlaLatent = 640;

cudaError_t WriteLatentKv(const kernels::KvCacheLayout& layout, void* pool, int64_t layer,
                          const float* c_kv, const float* k_pe, const int64_t* slots,
                          int64_t tokens, cudaStream_t stream);

// One thread block per (query row, head); its warps take every fourth key
// with an online softmax and merge at the end. Returns cudaErrorInvalidValue
// for a latent wider than kMaxMlaLatent.
cudaError_t MlaAttention(const kernels::KvCacheLayout& layout, const void* pool, int64_t layer,
                         const float* q_latent, const float* q_pe, int64_t num_heads,
                         const kernels::AttentionBatch& batch, float scale, float* out,
                         cudaStream_t stream);

}  // namespace pdserve::cuda
