// The fp8 E5M2 codec of the OCP 8-bit floating point specification (OFP8):
// 1 sign bit, 5 exponent bits (bias 15), 2 mantissa bits; subnormals at
// exponent 0 (steps of 2^-16); exponent 31 holds +-infinity (mantissa 0)
// and NaN (mantissa 1-3), as in IEEE 754. Largest finite value 57344
// (0x7b), smallest normal 2^-14 (0x04), smallest subnormal 2^-16 (0x01).
//
// A building block for an fp8_e5m2 KV cache (issue #20): not a KV dtype yet.
// One definition for host and device code, as kernels/fp8_e4m3.h, so that a
// CUDA backend produces the very bytes the CPU backend does.
#pragma once

#include <cmath>
#include <cstdint>

#ifndef PDSERVE_HOST_DEVICE
#if defined(__CUDACC__)
#define PDSERVE_HOST_DEVICE __host__ __device__
#else
#define PDSERVE_HOST_DEVICE
#endif
#endif

namespace pdserve::kernels {

inline constexpr float kE5M2Max = 57344.0f;
inline constexpr uint8_t kE5M2MaxCode = 0x7b;  // +57344
inline constexpr uint8_t kE5M2InfCode = 0x7c;  // +infinity
inline constexpr uint8_t kE5M2NanCode = 0x7f;  // the NaN the encoder writes

// OFP8's two conversion modes for values beyond the finite range: kSaturate
// clamps to +-57344 (infinities too: a KV cache must stay finite);
// kNonSaturating gives +-infinity for what rounds past 57344 (from 61440 on,
// the tie at 61440 going to the even code, infinity) and keeps infinities.
enum class E5M2Overflow { kSaturate, kNonSaturating };

PDSERVE_HOST_DEVICE inline float E5M2Decode(uint8_t v) {
  const int exp = (v >> 2) & 0x1f;
  const int mant = v & 3;
  float m;
  if (exp == 0x1f) {
    m = mant == 0 ? INFINITY : NAN;
  } else if (exp == 0) {
    m = ldexpf(static_cast<float>(mant), -16);
  } else {
    m = ldexpf(1.0f + mant / 4.0f, exp - 15);
  }
  return (v & 0x80) ? -m : m;
}

// Rounds to nearest, ties to even (the code with an even mantissa); the
// sign of zero is kept; NaN becomes kE5M2NanCode whatever its sign.
PDSERVE_HOST_DEVICE inline uint8_t E5M2Encode(float f,
                                              E5M2Overflow overflow = E5M2Overflow::kSaturate) {
  if (f != f) return kE5M2NanCode;
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const uint8_t too_big = overflow == E5M2Overflow::kSaturate ? kE5M2MaxCode : kE5M2InfCode;
  const float a = fabsf(f);
  if (a == INFINITY) return sign | too_big;
  // Subnormal range: steps of 2^-16; 4 steps is the smallest normal (code 4).
  if (a < 0.00006103515625f) return sign | static_cast<uint8_t>(rintf(a * 65536.0f));
  int e;
  const float frac = frexpf(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  // a = (1 + m/4) * 2^(e-1); the mantissa in quarters, rounded to nearest
  // even (exact: frac has 24 bits, the product only shifts them).
  int m = static_cast<int>(rintf((frac * 2.0f - 1.0f) * 4.0f));
  int biased = e - 1 + 15;
  if (m == 4) {
    m = 0;
    ++biased;
  }
  if (biased > 30) return sign | too_big;  // past 0x7b
  return sign | static_cast<uint8_t>(biased * 4 + m);
}

}  // namespace pdserve::kernels
