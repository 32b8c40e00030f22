// The fp8 E4M3 ("FN" variant: bias 7, no infinities, 0x7f/0xff are NaN, max
// 448) codec, one definition for host and device code: the CUDA backend must
// produce the very bytes the CPU backend does, so both compile this.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define PDSERVE_HOST_DEVICE __host__ __device__
#else
#define PDSERVE_HOST_DEVICE
#endif

namespace pdserve::kernels {

inline constexpr float kE4M3Max = 448.0f;

PDSERVE_HOST_DEVICE inline float E4M3Decode(uint8_t v) {
  const int exp = (v >> 3) & 0xf;
  const int mant = v & 7;
  float m;
  if (exp == 0xf && mant == 7) {
    m = NAN;
  } else if (exp == 0) {
    m = ldexpf(static_cast<float>(mant), -9);
  } else {
    m = ldexpf(1.0f + mant / 8.0f, exp - 7);
  }
  return (v & 0x80) ? -m : m;
}

// Rounds to nearest, ties to even; saturates to +-448; NaN maps to the NaN code.
PDSERVE_HOST_DEVICE inline uint8_t E4M3Encode(float f) {
  if (f != f) return 0x7f;  // NaN
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = fabsf(f);
  if (a >= kE4M3Max) return sign | 0x7e;
  // Subnormal range: steps of 2^-9; 8 steps is the smallest normal (code 8).
  if (a < 0.015625f) return sign | static_cast<uint8_t>(rintf(a * 512.0f));
  int e;
  const float frac = frexpf(a, &e);  // a = frac * 2^e, frac in [0.5, 1)
  // a = (1 + m/8) * 2^(e-1); the mantissa in eighths, rounded to nearest even.
  int m = static_cast<int>(rintf((frac * 2.0f - 1.0f) * 8.0f));
  int biased = e - 1 + 7;
  if (m == 8) {
    m = 0;
    ++biased;
  }
  const int code = biased * 8 + m;
  return sign | static_cast<uint8_t>(code > 0x7e ? 0x7e : code);
}

}  // namespace pdserve::kernels
