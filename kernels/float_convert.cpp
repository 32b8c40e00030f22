#include "kernels/float_convert.h"

#include <array>
#include <cmath>

namespace pdserve::kernels {

float F16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  float magnitude;
  if (exp == 0) {
    magnitude = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
  } else if (exp == 31) {
    magnitude = mant ? NAN : INFINITY;
  } else {
    uint32_t bits = ((exp + 112u) << 23) | (mant << 13);
    std::memcpy(&magnitude, &bits, 4);
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, 4);
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

uint16_t F32ToF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const float a = std::fabs(f);
  if (std::isnan(f)) return sign | 0x7e00u;
  if (a >= 65520.0f) return sign | 0x7c00u;  // rounds past the largest finite half
  if (a < 6.103515625e-05f) {                // below the smallest normal: subnormal step 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(a * 16777216.0f));
  }
  uint32_t abits;
  std::memcpy(&abits, &a, 4);
  // Round the 23-bit mantissa to 10 bits, nearest even; a carry bumps the exponent.
  abits += 0xfffu + ((abits >> 13) & 1u);
  const uint32_t exp = (abits >> 23) - 112u;
  return sign | static_cast<uint16_t>((exp << 10) | ((abits >> 13) & 0x3ffu));
}

namespace {
std::array<float, 256> BuildE4M3Table() {
  std::array<float, 256> t{};
  for (int v = 0; v < 256; ++v) t[v] = E4M3Decode(static_cast<uint8_t>(v));
  return t;
}
const std::array<float, 256> kE4M3Table = BuildE4M3Table();
}  // namespace

float E4M3ToF32(uint8_t v) { return kE4M3Table[v]; }

uint8_t F32ToE4M3(float f) { return E4M3Encode(f); }

}  // namespace pdserve::kernels
