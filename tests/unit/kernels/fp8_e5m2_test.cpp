// kernels/fp8_e5m2.h against the OCP 8-bit floating point specification
// (OFP8), derived here independently of the codec: every code's value from
// the format's definition, and an encoder that scans all codes for the
// nearest (ties to the even code) instead of doing bit arithmetic. Checked at
// every code, every midpoint between neighbours (the ties), one ulp either
// side of each, the saturation and infinity edges of both overflow modes,
// and a sweep of random float bit patterns.
#include "kernels/fp8_e5m2.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

namespace pdserve::kernels {
namespace {

// OFP8 E5M2: (-1)^s * 2^(e-15) * (1 + m/4) for e in 1..30, (-1)^s * 2^-14 *
// (m/4) for e = 0, infinity for e = 31 and m = 0, NaN for e = 31 and m != 0.
double SpecValue(int code) {
  const int s = code >> 7, e = (code >> 2) & 31, m = code & 3;
  double v;
  if (e == 31) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::nan("");
  } else if (e == 0) {
    v = std::ldexp(m / 4.0, -14);
  } else {
    v = std::ldexp(1.0 + m / 4.0, e - 15);
  }
  return s ? -v : v;
}

// Round to nearest, ties to even, as if the exponent range went on: the
// value after 57344 would be 2^16 (code 0x7c, even mantissa), so what
// rounds there overflows: +-57344 when saturating, +-infinity otherwise.
uint8_t SpecEncode(double x, E5M2Overflow mode) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  // From 2^16 on, a - v loses its digits in double; it all overflows.
  if (a >= 65536.0) return sign | (mode == E5M2Overflow::kSaturate ? 0x7b : 0x7c);
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7c; ++c) {
    const double v = c == 0x7c ? 65536.0 : SpecValue(c);
    const double err = std::fabs(a - v);
    if (err < best_err || (err == best_err && c % 2 == 0)) {
      best = c;
      best_err = err;
    }
  }
  if (best == 0x7c) best = mode == E5M2Overflow::kSaturate ? 0x7b : 0x7c;
  return sign | static_cast<uint8_t>(best);
}

constexpr E5M2Overflow kModes[] = {E5M2Overflow::kSaturate, E5M2Overflow::kNonSaturating};

TEST(Fp8E5M2Test, DecodeEveryCodeAsTheSpecDefinesIt) {
  for (int c = 0; c < 256; ++c) {
    const double want = SpecValue(c);
    const float got = E5M2Decode(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
    }
  }
  // Named values of the spec's table.
  EXPECT_EQ(E5M2Decode(0x7b), 57344.0f);
  EXPECT_EQ(E5M2Decode(0x04), 0x1p-14f);
  EXPECT_EQ(E5M2Decode(0x01), 0x1p-16f);
  EXPECT_EQ(E5M2Decode(0x03), 0.75f * 0x1p-14f);
  EXPECT_EQ(E5M2Decode(0x3c), 1.0f);
  EXPECT_EQ(E5M2Decode(0xc0), -2.0f);
  EXPECT_EQ(E5M2Decode(0x7c), std::numeric_limits<float>::infinity());
  EXPECT_EQ(E5M2Decode(0xfc), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::signbit(E5M2Decode(0x80)));
}

TEST(Fp8E5M2Test, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> 2) & 31;
    if (e == 31) continue;  // infinities and NaNs below
    for (E5M2Overflow mode : kModes) {
      EXPECT_EQ(E5M2Encode(E5M2Decode(static_cast<uint8_t>(c)), mode), c) << c;
    }
  }
}

TEST(Fp8E5M2Test, MidpointsTieToEvenAndNeighboursRoundToTheNearest) {
  for (int sign : {0, 0x80}) {
    for (int c = 0; c < 0x7b; ++c) {
      const double lo = SpecValue(sign | c), hi = SpecValue(sign | (c + 1));
      const float mid = static_cast<float>((lo + hi) / 2);  // exact: 4 significant bits
      ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
      const int even = c % 2 == 0 ? c : c + 1;
      for (E5M2Overflow mode : kModes) {
        EXPECT_EQ(E5M2Encode(mid, mode), sign | even) << "midpoint after code " << c;
        EXPECT_EQ(E5M2Encode(std::nextafter(mid, 0.0f), mode), sign | c) << c;
        EXPECT_EQ(E5M2Encode(std::nextafter(mid, sign ? -1e9f : 1e9f), mode), sign | (c + 1)) << c;
      }
    }
  }
}

TEST(Fp8E5M2Test, SaturationInfinityAndNan) {
  const float inf = std::numeric_limits<float>::infinity();
  const auto sat = E5M2Overflow::kSaturate;
  const auto ieee = E5M2Overflow::kNonSaturating;
  // 61440 is the midpoint between 57344 and the (absent) 65536.
  EXPECT_EQ(E5M2Encode(std::nextafter(61440.0f, 0.0f), ieee), 0x7b);
  EXPECT_EQ(E5M2Encode(61440.0f, ieee), 0x7c);
  EXPECT_EQ(E5M2Encode(-61440.0f, ieee), 0xfc);
  EXPECT_EQ(E5M2Encode(1e30f, ieee), 0x7c);
  EXPECT_EQ(E5M2Encode(inf, ieee), 0x7c);
  EXPECT_EQ(E5M2Encode(-inf, ieee), 0xfc);
  EXPECT_EQ(E5M2Encode(61440.0f, sat), 0x7b);
  EXPECT_EQ(E5M2Encode(-1e30f, sat), 0xfb);
  EXPECT_EQ(E5M2Encode(inf, sat), 0x7b);
  EXPECT_EQ(E5M2Encode(-inf, sat), 0xfb);
  EXPECT_EQ(E5M2Encode(std::numeric_limits<float>::max()), 0x7b);  // saturating by default
  for (E5M2Overflow mode : kModes) {
    EXPECT_EQ(E5M2Encode(std::nanf(""), mode), 0x7f);
    EXPECT_EQ(E5M2Encode(-std::nanf(""), mode), 0x7f);
    EXPECT_EQ(E5M2Encode(-0.0f, mode), 0x80);
    // Below half the smallest subnormal: zero; the half itself ties to 0.
    EXPECT_EQ(E5M2Encode(0x1p-17f, mode), 0x00);
    EXPECT_EQ(E5M2Encode(std::nextafter(0x1p-17f, 1.0f), mode), 0x01);
    EXPECT_EQ(E5M2Encode(-0x1p-30f, mode), 0x80);
    EXPECT_EQ(E5M2Encode(std::numeric_limits<float>::denorm_min(), mode), 0x00);
  }
}

TEST(Fp8E5M2Test, RandomFloatsMatchTheScanningEncoder) {
  std::mt19937 rng(5);
  for (int i = 0; i < 100000; ++i) {
    // Mostly the E5M2 range, some of everything else (huge, tiny, NaN).
    uint32_t bits = rng();
    if (i % 4 != 0) bits = (bits & 0x807fffffu) | ((100 + rng() % 60) << 23);
    const float f = std::bit_cast<float>(bits);
    for (E5M2Overflow mode : kModes) {
      ASSERT_EQ(E5M2Encode(f, mode), SpecEncode(f, mode)) << f << " bits " << bits;
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels
