// e4m3 weight codes widened exactly on the device, for the kernels that
// read fp8 weights (gemm_fp8.cu, moe.cu). The loader refuses the NaN codes
// (kernels/weights.h), so every code is a finite value.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace pdserve::cuda {

// Two codes (the low byte first).
__device__ inline float2 Fp8PairToFloat2(uint16_t pair) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair), __NV_E4M3);
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

__device__ inline float Fp8ToFloat(uint8_t code) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
  return __half2float(*reinterpret_cast<const __half*>(&h));
}

// Four codes (one 32-bit word, lowest byte first).
__device__ __forceinline__ float4 Fp8QuadToFloat4(uint32_t quad) {
  const float2 lo = Fp8PairToFloat2(static_cast<uint16_t>(quad & 0xffffu));
  const float2 hi = Fp8PairToFloat2(static_cast<uint16_t>(quad >> 16));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

}  // namespace pdserve::cuda
