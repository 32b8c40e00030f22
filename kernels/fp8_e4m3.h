// The fp8 E4M3 ("FN" variant: bias 7, no infinities, 0x7f/0xff are NaN, max
// 448) codec, one definition for host and device code: the CUDA backend must
// produce the very bytes the CPU backend does, so both compile this.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

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

PDSERVE_HOST_DEVICE inline uint32_t E4M3FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// Rounds to nearest, ties to even; saturates to +-448; NaN maps to the NaN code.
// Bit arithmetic rather than frexpf: it quantises billions of dummy weights
// (`--load-format dummy` of an 8B FP8 config) before every benchmark.
PDSERVE_HOST_DEVICE inline uint8_t E4M3Encode(float f) {
  if (f != f) return 0x7f;  // NaN
  const uint8_t sign = std::signbit(f) ? 0x80 : 0;
  const float a = fabsf(f);
  if (a >= kE4M3Max) return sign | 0x7e;
  // Subnormal range: steps of 2^-9; 8 steps is the smallest normal (code 8).
  if (a < 0.015625f) return sign | static_cast<uint8_t>(rintf(a * 512.0f));
  // a = (1 + m/2^23) * 2^(E-127): m rounded to its top 3 bits, to nearest,
  // ties to an even result (bit 20 is the last bit kept); a carry out of
  // the mantissa moves into the exponent, as it must. Then fp32's exponent
  // bias (127) exchanged for e4m3's (7): a in [2^-6, 448) gives codes 8 to
  // 0x7e.
  const uint32_t bits = E4M3FloatBits(a);
  const uint32_t rounded = (bits + 0x7ffffu + ((bits >> 20) & 1u)) >> 20;
  const uint32_t code = rounded - ((127u - 7u) << 3);
  return sign | static_cast<uint8_t>(code > 0x7e ? 0x7e : code);
}

}  // namespace pdserve::kernels
