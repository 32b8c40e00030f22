// The fp4 E2M1 codec (OCP Microscaling Formats (MX) v1.0: 1 sign bit, 2
// exponent bits with bias 1, 1 mantissa bit; no infinity, no NaN) and
// NVIDIA's NVFP4 block quantisation on top of it.
//
// E2M1's eight magnitudes, codes 0-7: 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is
// the sign. NVFP4 stores a tensor as blocks of 16 consecutive values, each
// block as 16 E2M1 codes (8 bytes, two per byte, the even element in the low
// nibble) and one fp8 E4M3 scale, plus one fp32 scale for the whole tensor:
// 4.5 bits per value before the per-tensor scale.
//
// Building blocks for an nvfp4 KV cache (issue #20): not a KV dtype yet.
// One definition for host and device code, as kernels/fp8_e4m3.h.
#pragma once

#include <cmath>
#include <cstdint>

#include "kernels/fp8_e4m3.h"

namespace pdserve::kernels {

inline constexpr float kE2M1Max = 6.0f;

// The low 4 bits of `v`.
PDSERVE_HOST_DEVICE inline float E2M1Decode(uint8_t v) {
  const int exp = (v >> 1) & 3;
  const int mant = v & 1;
  // exp 0: subnormal, mant * 0.5; else (1 + mant / 2) * 2^(exp - 1).
  const float m = exp == 0 ? 0.5f * mant : ldexpf(1.0f + 0.5f * mant, exp - 1);
  return (v & 8) ? -m : m;
}

// Rounds to nearest, ties to the even code (mantissa bit 0), and saturates
// at +-6 (infinities too); the sign of zero is kept. E2M1 has no NaN: NaN
// encodes as +0 (a choice of this codec, the format leaves it open; a
// quantised cache then reads a zero rather than a large value).
PDSERVE_HOST_DEVICE inline uint8_t E2M1Encode(float f) {
  if (f != f) return 0;
  const uint8_t sign = std::signbit(f) ? 8 : 0;
  const float a = fabsf(f);
  // The midpoints between neighbouring magnitudes; at a midpoint the even
  // code wins: 0.25 -> 0, 0.75 -> 1 (code 2), 1.25 -> 1, 1.75 -> 2 (code 4),
  // 2.5 -> 2, 3.5 -> 4 (code 6), 5 -> 4.
  uint8_t code;
  if (a <= 0.25f) {
    code = 0;
  } else if (a < 0.75f) {
    code = 1;
  } else if (a <= 1.25f) {
    code = 2;
  } else if (a < 1.75f) {
    code = 3;
  } else if (a <= 2.5f) {
    code = 4;
  } else if (a < 3.5f) {
    code = 5;
  } else if (a <= 5.0f) {
    code = 6;
  } else {
    code = 7;
  }
  return sign | code;
}

inline constexpr int kNvfp4BlockSize = 16;

// NVFP4's per-tensor scale (the "global" encode scale): it maps the
// tensor's largest magnitude to 448 * 6, the largest E4M3 scale times the
// largest E2M1 value, so that block scales use E4M3's whole range. 1 when
// `tensor_amax` is 0 or not finite (nothing to stretch).
PDSERVE_HOST_DEVICE inline float Nvfp4TensorScale(float tensor_amax) {
  if (!(tensor_amax > 0.0f) || tensor_amax == INFINITY) return 1.0f;
  return kE4M3Max * kE2M1Max / tensor_amax;
}

// Quantises kNvfp4BlockSize values `x` by NVIDIA's recipe: the block scale
// is amax / 6 times `tensor_scale`, rounded to nearest-even E4M3 (saturated
// at 448); each value is multiplied by tensor_scale / (decoded block scale)
// and rounded to E2M1 (a value the rounded-down scale pushes past 6
// saturates). A block whose scale rounds to 0 stores zeros. Writes 8 bytes
// to `packed` and the scale's code to `*scale`. NaNs in x are skipped when
// taking amax and encode as 0.
PDSERVE_HOST_DEVICE inline void Nvfp4QuantizeBlock(const float* x, float tensor_scale,
                                                   uint8_t* packed, uint8_t* scale) {
  float amax = 0.0f;
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    // A comparison rather than fmaxf: with fmaxf, blocks holding NaNs got
    // other scales on a GPU than on the host; a comparison skips every NaN
    // on both, so both write the same bytes.
    const float a = fabsf(x[i]);
    if (a > amax) amax = a;
  }
  // amax is brought to tensor units before the division: amax / 6 of a
  // tiny block would be subnormal and lose digits (the two orders agree
  // everywhere else).
  *scale = E4M3Encode(amax * tensor_scale / kE2M1Max);
  const float block_scale = E4M3Decode(*scale);
  const float to_e2m1 = block_scale > 0.0f ? tensor_scale / block_scale : 0.0f;
  // At the largest tensor scales (a KV region scale of 2^-126) that ratio
  // overflows; the values are then brought to tensor units first.
  const bool in_two_steps = to_e2m1 > __FLT_MAX__;
  for (int i = 0; i < kNvfp4BlockSize; i += 2) {
    const float a = in_two_steps ? x[i] * tensor_scale / block_scale : x[i] * to_e2m1;
    const float b = in_two_steps ? x[i + 1] * tensor_scale / block_scale : x[i + 1] * to_e2m1;
    packed[i / 2] = static_cast<uint8_t>(E2M1Encode(a) | (E2M1Encode(b) << 4));
  }
}

// The inverse: value i = E2M1(code i) * E4M3(scale) / tensor_scale.
PDSERVE_HOST_DEVICE inline void Nvfp4DequantizeBlock(const uint8_t* packed, uint8_t scale,
                                                     float tensor_scale, float* out) {
  const float s = E4M3Decode(scale) / tensor_scale;
  for (int i = 0; i < kNvfp4BlockSize; ++i) {
    out[i] = E2M1Decode(packed[i / 2] >> (4 * (i % 2))) * s;
  }
}

}  // namespace pdserve::kernels
