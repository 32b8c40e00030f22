// Device-side paged-KV element codecs, shared by the CUDA backend's GQA ops
// (cuda_backend.cu) and its MLA ops (mla_attention.cu): bit-identical to the
// CPU backend's (kernels/cpu/kv_codec.h), which the tests hold them to.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/dtype.h"
#include "kernels/fp8_e4m3.h"

namespace pdserve::kernels {

__device__ inline float E4M3ToF32(uint8_t v) { return E4M3Decode(v); }
__device__ inline uint8_t F32ToE4M3(float f) { return E4M3Encode(f); }

// Smallest power of two s with max_abs / s <= 448 (0 for all zeros).
__device__ inline float Fp8ScaleFor(float max_abs) {
  if (!(max_abs > 0)) return 0.0f;
  int e;
  const float f = frexpf(max_abs / kE4M3Max, &e);
  return ldexpf(1.0f, f == 0.5f ? e - 1 : e);
}

__device__ inline float LoadKv(const uint8_t* base, DType dtype, int64_t i, float scale) {
  switch (dtype) {
    case DType::kF32:
      return reinterpret_cast<const float*>(base)[i];
    case DType::kBF16:
      return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(base)[i]);
    case DType::kF16:
      return __half2float(reinterpret_cast<const __half*>(base)[i]);
    case DType::kFP8E4M3:
      return E4M3ToF32(base[i]) * scale;
    default:
      return __int_as_float(0x7fc00000);
  }
}

__device__ inline void StoreKv(uint8_t* base, DType dtype, int64_t i, float value, float scale) {
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
    case DType::kFP8E4M3:
      base[i] = F32ToE4M3(value * (scale > 0 ? 1.0f / scale : 0.0f));
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

}  // namespace pdserve::kernels
