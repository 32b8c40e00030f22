// kernels/fp4_e2m1.h against the formats as published, derived here
// independently of the codec: E2M1 from the OCP Microscaling (MX) v1.0
// definition, E4M3 from the OCP FP8 definition, encoders that scan every
// code for the nearest value (ties to the even code), and NVIDIA's NVFP4
// recipe (block scale = amax / 6 times the tensor scale 448 * 6 / tensor
// amax, rounded to E4M3; values divided by the rounded scale, rounded to
// E2M1) written out with those scanning encoders. Hand-worked blocks pin the
// packing and the scale rounding.
#include "kernels/fp4_e2m1.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace pdserve::kernels {
namespace {

// MX E2M1: bias 1; (-1)^s * 2^(e-1) * (1 + m/2) for e in 1..3, (-1)^s * m/2
// for e = 0 (2^(1-bias) * m/2).
double SpecE2M1(int code) {
  const int s = (code >> 3) & 1, e = (code >> 1) & 3, m = code & 1;
  const double v = e == 0 ? m / 2.0 : std::ldexp(1.0 + m / 2.0, e - 1);
  return s ? -v : v;
}

// OFP8 E4M3: bias 7, 0x7f / 0xff NaN, subnormals m/8 * 2^-6.
double SpecE4M3(int code) {
  const int s = code >> 7, e = (code >> 3) & 15, m = code & 7;
  double v;
  if (e == 15 && m == 7) {
    v = std::nan("");
  } else if (e == 0) {
    v = std::ldexp(m / 8.0, -6);
  } else {
    v = std::ldexp(1.0 + m / 8.0, e - 7);
  }
  return s ? -v : v;
}

// Nearest of codes [0, max_code] by |value|, ties to the even code; beyond
// the largest it saturates.
template <typename ValueFn>
int ScanNearest(double a, int max_code, ValueFn value) {
  // Far above the top, a - value loses its digits in double: decide first.
  if (a >= value(max_code)) return max_code;
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= max_code; ++c) {
    const double err = std::fabs(a - value(c));
    if (err < best_err || (err == best_err && c % 2 == 0)) {
      best = c;
      best_err = err;
    }
  }
  return best;
}

uint8_t RefE2M1(double x) {
  if (std::isnan(x)) return 0;
  return (std::signbit(x) ? 8 : 0) | ScanNearest(std::fabs(x), 7, SpecE2M1);
}

uint8_t RefE4M3(double x) {  // non-negative inputs only (scales)
  return static_cast<uint8_t>(ScanNearest(x, 0x7e, SpecE4M3));
}

TEST(Fp4E2M1Test, DecodeEveryCodeAsTheSpecDefinesIt) {
  const float magnitudes[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(static_cast<double>(E2M1Decode(static_cast<uint8_t>(c))), SpecE2M1(c)) << c;
    EXPECT_EQ(std::fabs(E2M1Decode(static_cast<uint8_t>(c))), magnitudes[c & 7]) << c;
    EXPECT_EQ(std::signbit(E2M1Decode(static_cast<uint8_t>(c))), c >= 8) << c;
  }
  // Only the low nibble counts.
  EXPECT_EQ(E2M1Decode(0xf7), 6.0f);
  EXPECT_EQ(E2M1Decode(0x5d), -3.0f);
}

TEST(Fp4E2M1Test, EveryCodeRoundTrips) {
  for (int c = 0; c < 16; ++c) EXPECT_EQ(E2M1Encode(E2M1Decode(static_cast<uint8_t>(c))), c) << c;
}

TEST(Fp4E2M1Test, TiesGoToTheEvenCodeAndNeighboursToTheNearest) {
  // The seven midpoints and where round-to-nearest-even sends them.
  const float ties[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const uint8_t tie_codes[7] = {0, 2, 2, 4, 4, 6, 6};  // 0, 1, 1, 2, 2, 4, 4
  for (int i = 0; i < 7; ++i) {
    for (int sign : {0, 8}) {
      const float t = sign ? -ties[i] : ties[i];
      EXPECT_EQ(E2M1Encode(t), sign | tie_codes[i]) << t;
      EXPECT_EQ(E2M1Encode(std::nextafter(t, 0.0f)), sign | i) << t;
      EXPECT_EQ(E2M1Encode(std::nextafter(t, sign ? -100.0f : 100.0f)), sign | (i + 1)) << t;
      EXPECT_EQ(RefE2M1(t), sign | tie_codes[i]);  // the scanning encoder agrees
    }
  }
}

TEST(Fp4E2M1Test, SaturatesAtSixAndMapsNanToZero) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(E2M1Encode(6.0f), 0x7);
  EXPECT_EQ(E2M1Encode(std::nextafter(6.0f, 7.0f)), 0x7);
  EXPECT_EQ(E2M1Encode(7.0f), 0x7);  // above 6 there is nothing to round to
  EXPECT_EQ(E2M1Encode(1e30f), 0x7);
  EXPECT_EQ(E2M1Encode(inf), 0x7);
  EXPECT_EQ(E2M1Encode(-inf), 0xf);
  EXPECT_EQ(E2M1Encode(-1e30f), 0xf);
  EXPECT_EQ(E2M1Encode(std::nanf("")), 0x0);
  EXPECT_EQ(E2M1Encode(-0.0f), 0x8);
  EXPECT_EQ(E2M1Encode(-0.1f), 0x8);
}

TEST(Fp4E2M1Test, RandomFloatsMatchTheScanningEncoder) {
  std::mt19937 rng(3);
  for (int i = 0; i < 100000; ++i) {
    uint32_t bits = rng();
    if (i % 4 != 0) bits = (bits & 0x807fffffu) | ((120 + rng() % 10) << 23);  // 2^-7 .. 2^3
    const float f = std::bit_cast<float>(bits);
    ASSERT_EQ(E2M1Encode(f), RefE2M1(f)) << f;
  }
}

TEST(Nvfp4Test, TensorScaleMapsTheAmaxTo448Times6) {
  EXPECT_EQ(Nvfp4TensorScale(2688.0f), 1.0f);
  EXPECT_EQ(Nvfp4TensorScale(1344.0f), 2.0f);
  EXPECT_EQ(Nvfp4TensorScale(10.0f), 268.8f);
  EXPECT_EQ(Nvfp4TensorScale(0.0f), 1.0f);
  EXPECT_EQ(Nvfp4TensorScale(std::numeric_limits<float>::infinity()), 1.0f);
  EXPECT_EQ(Nvfp4TensorScale(std::nanf("")), 1.0f);
}

// Worked by hand with tensor scale 1.
TEST(Nvfp4Test, HandWorkedBlocks) {
  uint8_t packed[8], scale;
  {
    // amax 6: block scale 6 / 6 = 1 (E4M3 0x38); every value is on the grid.
    const float x[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.5f, -1, -1.5f, -2, -3, -4, -6, 0};
    Nvfp4QuantizeBlock(x, 1.0f, packed, &scale);
    EXPECT_EQ(scale, 0x38);
    const uint8_t want[8] = {0x10, 0x32, 0x54, 0x76, 0xa9, 0xcb, 0xed, 0x0f};
    for (int i = 0; i < 8; ++i) EXPECT_EQ(packed[i], want[i]) << i;
    float back[16];
    Nvfp4DequantizeBlock(packed, scale, 1.0f, back);
    for (int i = 0; i < 16; ++i) EXPECT_EQ(back[i], x[i]) << i;
  }
  {
    // amax 1.8: 0.3 rounds to E4M3 1.25 * 2^-2 = 0.3125 (0x2a; 0.3 = 1.2 *
    // 2^-2 and 1.2 is nearer 1.25 than 1.125). Then 1.8 / 0.3125 = 5.76 -> 6,
    // 0.9 -> 2.88 -> 3, 0.46875 -> 1.5 exactly, 0.78125 -> 2.5, a tie -> 2,
    // -0.234375 -> -0.75, a tie -> -1, 0.0625 -> 0.2 -> 0.
    float x[16] = {1.8f, 0.9f, 0.46875f, 0.78125f, -0.234375f, 0.0625f};
    Nvfp4QuantizeBlock(x, 1.0f, packed, &scale);
    EXPECT_EQ(scale, 0x2a);
    EXPECT_EQ(E4M3Decode(scale), 0.3125f);
    EXPECT_EQ(packed[0], 0x57);  // 6 (7), 3 (5)
    EXPECT_EQ(packed[1], 0x43);  // 1.5 (3), 2 (4)
    EXPECT_EQ(packed[2], 0x0a);  // -1 (0xa), 0
    for (int i = 3; i < 8; ++i) EXPECT_EQ(packed[i], 0) << i;
  }
  {
    // amax 6.36: 1.06 rounds down to E4M3 1.0, so 6.36 lands past 6 and
    // saturates; -6.36 too.
    float x[16] = {6.36f, -6.36f};
    Nvfp4QuantizeBlock(x, 1.0f, packed, &scale);
    EXPECT_EQ(scale, 0x38);
    EXPECT_EQ(packed[0], 0xf7);
  }
  {
    // NaNs, quiet or signalling, take no part in amax and encode as 0: the
    // block is scaled by its 3 alone (scale 0.5, 0x30; 3 -> 6, 1 -> 2).
    const float snan = std::bit_cast<float>(0x7f800001u);
    float x[16] = {snan, 3.0f, std::nanf(""), 1.0f};
    Nvfp4QuantizeBlock(x, 1.0f, packed, &scale);
    EXPECT_EQ(scale, 0x30);
    EXPECT_EQ(packed[0], 0x70);
    EXPECT_EQ(packed[1], 0x40);
  }
  {
    // All zeros: scale 0, codes 0, and dequantised zeros (no division by 0).
    const float x[16] = {};
    Nvfp4QuantizeBlock(x, 1.0f, packed, &scale);
    EXPECT_EQ(scale, 0);
    for (int i = 0; i < 8; ++i) EXPECT_EQ(packed[i], 0);
    float back[16];
    Nvfp4DequantizeBlock(packed, scale, 1.0f, back);
    for (float v : back) EXPECT_EQ(v, 0.0f);
  }
}

// Random tensors of blocks: scale and value codes equal the recipe carried
// out with the scanning encoders; decoded values equal the spec values
// times scale over tensor scale; the per-block error stays within half an
// E2M1 step of the largest magnitude (1, between 4 and 6) times the scale,
// unless the rounded-down scale saturated the block's largest value.
TEST(Nvfp4Test, RandomBlocksFollowTheRecipe) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int t = 0; t < 200; ++t) {
    const int blocks = 8;
    std::vector<float> x(blocks * kNvfp4BlockSize);
    const float spread = std::ldexp(1.0f, static_cast<int>(rng() % 30) - 15);
    for (float& v : x) v = normal(rng) * spread * (rng() % 8 == 0 ? 10.0f : 1.0f);
    float tensor_amax = 0;
    for (float v : x) tensor_amax = std::max(tensor_amax, std::fabs(v));
    const float ts = Nvfp4TensorScale(tensor_amax);
    for (int b = 0; b < blocks; ++b) {
      const float* xb = x.data() + b * kNvfp4BlockSize;
      uint8_t packed[8], scale;
      Nvfp4QuantizeBlock(xb, ts, packed, &scale);
      float amax = 0;
      for (int i = 0; i < kNvfp4BlockSize; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const uint8_t want_scale = RefE4M3(amax / 6.0f * ts);
      ASSERT_EQ(scale, want_scale) << "tensor " << t << " block " << b;
      const float sf = static_cast<float>(SpecE4M3(want_scale));
      const float to_e2m1 = sf > 0 ? ts / sf : 0.0f;
      float back[16];
      Nvfp4DequantizeBlock(packed, scale, ts, back);
      for (int i = 0; i < kNvfp4BlockSize; ++i) {
        const uint8_t code = (packed[i / 2] >> (4 * (i % 2))) & 0xf;
        ASSERT_EQ(code, RefE2M1(xb[i] * to_e2m1)) << "tensor " << t << " value " << i;
        EXPECT_FLOAT_EQ(back[i], static_cast<float>(SpecE2M1(code) * (sf / ts)));
        if (sf > 0 && amax * to_e2m1 <= 6.0f) {
          EXPECT_LE(std::fabs(back[i] - xb[i]), 1.0 * sf / ts * 1.0001) << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels
