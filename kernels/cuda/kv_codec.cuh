// Device-side paged-KV element codecs, shared by the CUDA backend's GQA ops
// (cuda_backend.cu) and its MLA ops (mla_attention.cu): bit-identical to the
// CPU backend's (kernels/cpu/kv_codec.h), which the tests hold them to; both
// follow kernels/kv_quant.h. Addresses are within one head region of a block
// (kernels/backend.h) of vectors of `width` values; `micro_at` is the byte
// offset of nvfp4's micro-scales from the region's start (block_size x width
// / 2), unused by other dtypes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/dtype.h"
#include "kernels/kv_quant.h"

namespace pdserve::kernels {

__device__ inline float E4M3ToF32(uint8_t v) { return E4M3Decode(v); }
__device__ inline uint8_t F32ToE4M3(float f) { return E4M3Encode(f); }

// Scales sit at addresses that odd head or block sizes leave unaligned:
// read and written bytewise.
__device__ inline float LoadScaleBytes(const uint8_t* at) {
  float s;
  memcpy(&s, at, 4);
  return s;
}
__device__ inline void StoreScaleBytes(uint8_t* at, float s) { memcpy(at, &s, 4); }

// Element i of a region, decoded (scale: the region's, for scaled dtypes).
__device__ inline float LoadKv(const uint8_t* base, DType dtype, int64_t i, float scale,
                               int64_t micro_at, int64_t width) {
  switch (dtype) {
    case DType::kF32:
      return reinterpret_cast<const float*>(base)[i];
    case DType::kBF16:
      return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16:
      return __half2float(reinterpret_cast<const __half*>(base)[i]);
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
      return Fp8KvDecode(dtype, base[i], scale);
    case DType::kNvFp4:
      return Nvfp4KvDecode(base + i / 2, base[micro_at + Nvfp4MicroIndex(i, width)],
                           static_cast<int>(i % 2), scale);
    default:
      return __int_as_float(0x7fc00000);
  }
}

// Element i of a region of an unscaled dtype (fp32, bf16, fp16).
__device__ inline void StorePlainKv(uint8_t* base, DType dtype, int64_t i, float value) {
  switch (dtype) {
    case DType::kF32:
      reinterpret_cast<float*>(base)[i] = value;
      return;
    case DType::kBF16:
      reinterpret_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(value);
      return;
    case DType::kF16:
      reinterpret_cast<__half*>(base)[i] = __float2half_rn(value);
      return;
    default:
      return;
  }
}

// Block-wide max of non-negative values (all threads get the result).
__device__ inline float BlockMax(float value, float* shared) {
  for (int o = 16; o > 0; o /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  value = lane < blockDim.x / 32 ? shared[lane] : 0.0f;
  for (int o = 16; o > 0; o /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, o));
  return value;
}

// Writes a run of `run` tokens of `width` values into consecutive slots of
// one region of a scaled dtype, from slot `offset` on, with the whole thread
// block (as kernels/cpu/kv_codec.h's StoreRun, byte for byte): the region's
// scale grows to cover the run, the tokens already there are re-expressed
// at the new scale, then the run is encoded. value(i) gives element i of the
// run (token i / width, dimension i % width). `reduce` holds blockDim.x / 32
// floats. A positive `fixed_scale` (calibration) is the region's scale
// instead: nothing grows, values past its range saturate.
template <typename Value>
__device__ void WriteScaledRun(DType dtype, uint8_t* region, int64_t micro_at, uint8_t* scale_at,
                               int64_t offset, int64_t run, int64_t width, Value value,
                               float* reduce, float fixed_scale) {
  float max_abs = 0;
  for (int64_t i = threadIdx.x; i < run * width; i += blockDim.x) {
    max_abs = fmaxf(max_abs, fabsf(value(i)));  // fmaxf skips NaNs, as the host's comparison
  }
  max_abs = BlockMax(max_abs, reduce);
  const float old_scale = offset == 0 ? 0.0f : LoadScaleBytes(scale_at);  // 0: a fresh block
  const float needed = fixed_scale > 0 ? fixed_scale : KvScaleFor(dtype, max_abs);
  const float new_scale = needed > old_scale ? needed : old_scale;
  const int64_t first = offset * width;
  const int64_t groups = MicroScalesPerVector(DType::kNvFp4, width);  // nvfp4, per vector
  if (new_scale != old_scale && old_scale > 0) {
    if (dtype == DType::kNvFp4) {
      const float growth = new_scale / old_scale;
      for (int64_t b = threadIdx.x; b < offset * groups; b += blockDim.x)
        region[micro_at + b] = Nvfp4RescaleMicro(region[micro_at + b], growth);
    } else {
      for (int64_t i = threadIdx.x; i < first; i += blockDim.x)
        region[i] = Fp8KvEncode(dtype, Fp8KvDecode(dtype, region[i], old_scale), new_scale);
    }
  }
  if (dtype == DType::kNvFp4) {
    for (int64_t b = threadIdx.x; b < run * groups; b += blockDim.x) {
      const int64_t token = b / groups, d = b % groups * kNvfp4BlockSize;
      const int n = static_cast<int>(min(static_cast<int64_t>(kNvfp4BlockSize), width - d));
      float x[kNvfp4BlockSize];
      for (int j = 0; j < n; ++j) x[j] = value(token * width + d + j);
      const int64_t at = first + token * width + d;
      Nvfp4KvEncode(x, n, new_scale, region + at / 2,
                    region + micro_at + Nvfp4MicroIndex(at, width));
    }
  } else {
    for (int64_t i = threadIdx.x; i < run * width; i += blockDim.x)
      region[first + i] = Fp8KvEncode(dtype, value(i), new_scale);
  }
  __syncthreads();  // every thread read the old scale before it changes
  if (threadIdx.x == 0) StoreScaleBytes(scale_at, new_scale);
  __syncthreads();
}

}  // namespace pdserve::kernels
