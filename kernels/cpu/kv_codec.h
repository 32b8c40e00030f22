// The CPU backend's paged-KV element codecs, shared by the GQA ops
// (cpu_backend.cpp, paged_attention.cpp) and the MLA ops (mla_attention.cpp):
// one definition of how a value is stored in and read from a head region of
// the pool (kernels/backend.h) for every KV dtype, with the scale rules of
// kernels/kv_quant.h.
#pragma once

#include <cstdint>

#include "common/dtype.h"

namespace pdserve::kernels {

// A head region of one block: block_size vectors of `width` values (a
// head's K or V, or an MLA latent) of `dtype` from `base` (nvfp4: its
// micro-scales follow the packed codes).
struct KvRegion {
  DType dtype = DType::kF32;
  int64_t block_size = 0;
  int64_t width = 0;
  // Bytes from `base` to nvfp4's micro-scales.
  int64_t micro_scales_at() const { return block_size * width / 2; }
};

// Decodes elements [0, count) of a region to fp32 (`scale`: the region's,
// for scaled dtypes). Aborts on a dtype the pool cannot hold (refused at
// creation).
void LoadKv(const uint8_t* base, const KvRegion& region, float scale, int64_t count, float* dst);

// Writes a run of tokens that land in consecutive slots of ONE block for one
// head (`count` vectors of region.width from `src`, rows `src_stride` floats
// apart), starting at `offset_in_block`. For scaled dtypes the region's
// scale first grows to cover the whole run, so a block filled by one call (a
// prefill chunk) is rounded exactly once; offset 0 starts the block afresh.
// A positive `fixed_scale` (calibration) is the region's scale instead:
// nothing grows, values past its range saturate.
void StoreRun(const float* src, int64_t src_stride, int64_t count, const KvRegion& region,
              int64_t offset_in_block, uint8_t* base, float* scale, float fixed_scale = 0);

}  // namespace pdserve::kernels
