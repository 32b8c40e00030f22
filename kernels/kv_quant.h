// The quantisation rules of the scaled KV dtypes (fp8 e4m3, fp8 e5m2,
// nvfp4), one definition for host and device code: the CUDA backend must
// write the very bytes the CPU backend does (kernels/backend.h describes the
// pool layout; kernels/cpu/kv_codec.h and kernels/cuda/kv_codec.cuh apply
// these rules to it).
//
// Every (block, layer, K|V, head) region has one float32 scale S, a power of
// two: the smallest that keeps the largest magnitude written into the region
// within KvScaleRange(dtype) of S. It grows when a later write needs it;
// fp8 elements are then re-encoded at the new scale, nvfp4 micro-scales are
// divided by the growth (the E2M1 codes stay), both exact except where a
// value falls into the subnormal range.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/fp4_e2m1.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/fp8_e5m2.h"

namespace pdserve::kernels {

// The magnitude a scaled dtype holds at scale 1: the largest finite fp8
// value, or for nvfp4 the largest E4M3 micro-scale times the largest E2M1
// value (448 x 6).
PDSERVE_HOST_DEVICE inline float KvScaleRange(DType dtype) {
  switch (dtype) {
    case DType::kFP8E5M2:
      return kE5M2Max;
    case DType::kNvFp4:
      return kE4M3Max * kE2M1Max;
    default:
      return kE4M3Max;
  }
}

// The bounds of a region scale's exponent. Below 2^-126 the reciprocal the
// encoders multiply by would overflow to inf (and 0 * inf stores a zero as
// NaN); above 2^119 the decoders' scale times the 2^8 of the fp8 widening
// (simd_loads.h) would. Magnitudes under 2^-126 * range become zeros or
// subnormal codes; over 2^119 * range (2.98e38 for e4m3) they saturate.
constexpr int kMinKvScaleExponent = -126;
constexpr int kMaxKvScaleExponent = 119;

// Smallest power of two s with max_abs / s <= KvScaleRange(dtype), within
// 2^kMinKvScaleExponent .. 2^kMaxKvScaleExponent; 0 for an all-zero (or
// NaN-only) region. An infinite max_abs takes the largest scale (frexpf's
// exponent of an infinity is unspecified, on the device as on the host).
PDSERVE_HOST_DEVICE inline float KvScaleFor(DType dtype, float max_abs) {
  if (!(max_abs > 0)) return 0.0f;
  if (max_abs > __FLT_MAX__) return ldexpf(1.0f, kMaxKvScaleExponent);
  int e;
  const float f = frexpf(max_abs / KvScaleRange(dtype), &e);  // = f * 2^e, f in [0.5, 1)
  if (f == 0.0f) return ldexpf(1.0f, kMinKvScaleExponent);    // the quotient underflowed
  e = f == 0.5f ? e - 1 : e;
  e = e < kMinKvScaleExponent ? kMinKvScaleExponent : e;
  return ldexpf(1.0f, e > kMaxKvScaleExponent ? kMaxKvScaleExponent : e);
}

// An fp8 element at scale `scale` (a power of two, or 0 for an empty region).
PDSERVE_HOST_DEVICE inline uint8_t Fp8KvEncode(DType dtype, float value, float scale) {
  const float x = value * (scale > 0 ? 1.0f / scale : 0.0f);  // exact: a power of two
  return dtype == DType::kFP8E5M2 ? E5M2Encode(x) : E4M3Encode(x);
}
PDSERVE_HOST_DEVICE inline float Fp8KvDecode(DType dtype, uint8_t code, float scale) {
  return (dtype == DType::kFP8E5M2 ? E5M2Decode(code) : E4M3Decode(code)) * scale;
}

// One nvfp4 group: n (even, at most kNvfp4BlockSize) consecutive values of a
// cached vector at region scale `scale` into n / 2 bytes of E2M1 codes and
// one E4M3 micro-scale, by NVIDIA's recipe (kernels/fp4_e2m1.h); a group
// shorter than 16 (the end of a vector whose width is not a multiple of 16)
// is quantised as if padded with zeros, which changes neither its amax nor
// its codes.
PDSERVE_HOST_DEVICE inline void Nvfp4KvEncode(const float* x, int n, float scale, uint8_t* packed,
                                              uint8_t* micro) {
  float group[kNvfp4BlockSize];
  uint8_t codes[kNvfp4BlockSize / 2];
  for (int i = 0; i < kNvfp4BlockSize; ++i) group[i] = i < n ? x[i] : 0.0f;
  Nvfp4QuantizeBlock(group, scale > 0 ? 1.0f / scale : 0.0f, codes, micro);
  for (int i = 0; i < n / 2; ++i) packed[i] = codes[i];
}
// Element i of a group (codes from the group's first byte).
PDSERVE_HOST_DEVICE inline float Nvfp4KvDecode(const uint8_t* packed, uint8_t micro, int i,
                                               float scale) {
  return E2M1Decode(packed[i / 2] >> (4 * (i % 2))) * E4M3Decode(micro) * scale;
}
// Element i of an nvfp4 head region of vectors of `width` values (even):
// its code byte is region[i / 2]; its micro-scale region[micro_at + this].
PDSERVE_HOST_DEVICE inline int64_t Nvfp4MicroIndex(int64_t i, int64_t width) {
  return i / width * ((width + kNvfp4BlockSize - 1) / kNvfp4BlockSize) +
         i % width / kNvfp4BlockSize;
}
// A micro-scale after its region scale grew by `growth` (a power of two > 1).
PDSERVE_HOST_DEVICE inline uint8_t Nvfp4RescaleMicro(uint8_t micro, float growth) {
  return E4M3Encode(E4M3Decode(micro) / growth);
}

}  // namespace pdserve::kernels
