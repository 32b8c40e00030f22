// Software conversions between fp32 and the narrow float formats the KV cache
// and safetensors files use. All conversions round to nearest, ties to even.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/fp8_e4m3.h"

namespace pdserve::kernels {

inline float Bf16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// IEEE 754 binary16.
float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

// fp8 E4M3 (see kernels/fp8_e4m3.h); decoding goes through a table.
float E4M3ToF32(uint8_t v);
// Saturates to +-448; NaN maps to the NaN code.
uint8_t F32ToE4M3(float f);

// The largest error of rounding a value |x| <= 448 to e4m3: half a unit in
// the last place (2^-4 relative for normals, 2^-10 absolute for subnormals).
inline float E4M3RoundingBound(float abs_x) {
  return abs_x >= 0.015625f ? abs_x * 0.0625f : 0.0009765625f;
}

}  // namespace pdserve::kernels
