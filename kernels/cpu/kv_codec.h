// The CPU backend's paged-KV element codecs, shared by the GQA ops
// (cpu_backend.cpp) and the MLA ops (mla_attention.cpp): one definition of
// how a value is stored in and read from the pool for every KV dtype, and of
// the fp8 block-scale rule (kernels/backend.h, WriteKv).
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace pdserve::kernels {

// Decodes `count` consecutive KV elements of `dtype` to fp32 (scale applies
// to fp8 only). Aborts on a dtype the pool cannot hold (refused at creation).
void LoadKv(const uint8_t* src, DType dtype, float scale, int64_t count, float* dst);
// Encodes `count` values; fp8 divides by `scale` first (exact: a power of two).
void StoreKv(const float* src, DType dtype, float scale, int64_t count, uint8_t* dst);

// Smallest power of two s with max_abs / s <= 448 (0 for an all-zero vector).
float Fp8ScaleFor(float max_abs);

// Writes a run of tokens that land in consecutive slots of ONE block for one
// head (`count` vectors of head_dim from `src`, rows `src_stride` floats
// apart), starting at `offset_in_block`. For fp8 the block's scale first
// grows to cover the whole run, so a block filled by one call (a prefill
// chunk) is rounded exactly once; offset 0 starts the block afresh.
void StoreRun(const float* src, int64_t src_stride, int64_t count, int64_t head_dim, DType dtype,
              int64_t offset_in_block, uint8_t* head_base, float* scale);

}  // namespace pdserve::kernels
