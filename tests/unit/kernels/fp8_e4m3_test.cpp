// kernels/fp8_e4m3.h against the OCP 8-bit floating point specification
// (OFP8, E4M3: bias 7, no infinities, S.1111.111 the only NaN, largest
// finite 448), derived here independently of the codec: every code's value
// from the format's definition, and an encoder that scans all codes for the
// nearest (ties to the even code) instead of doing bit arithmetic. Checked at
// every code, every midpoint between neighbours (the ties), one ulp either
// side of each, saturation, NaN and zeros, and a sweep of random floats.
#include "kernels/fp8_e4m3.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <random>

namespace pdserve::kernels {
namespace {

// (-1)^s * 2^(e-7) * (1 + m/8) for e in 1..15 (but e = 15, m = 7),
// (-1)^s * 2^-6 * (m/8) for e = 0, NaN for e = 15 and m = 7.
double SpecValue(int code) {
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

// Round to nearest, ties to even, saturating: anything from 448 on (the
// format has no infinity) is +-448, NaN the code 0x7f.
uint8_t SpecEncode(double x) {
  if (std::isnan(x)) return 0x7f;
  const uint8_t sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  if (a >= 448.0) return sign | 0x7e;
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int c = 0; c <= 0x7e; ++c) {
    const double err = std::fabs(a - SpecValue(c));
    if (err < best_err || (err == best_err && c % 2 == 0)) {
      best = c;
      best_err = err;
    }
  }
  return sign | static_cast<uint8_t>(best);
}

TEST(Fp8E4M3Test, DecodeEveryCodeAsTheSpecDefinesIt) {
  for (int c = 0; c < 256; ++c) {
    const double want = SpecValue(c);
    const float got = E4M3Decode(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << c;
    }
  }
  EXPECT_EQ(E4M3Decode(0x7e), 448.0f);
  EXPECT_EQ(E4M3Decode(0x08), 0x1p-6f);
  EXPECT_EQ(E4M3Decode(0x01), 0x1p-9f);
  EXPECT_EQ(E4M3Decode(0x38), 1.0f);
  EXPECT_EQ(E4M3Decode(0xc0), -2.0f);
}

TEST(Fp8E4M3Test, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN below
    EXPECT_EQ(E4M3Encode(E4M3Decode(static_cast<uint8_t>(c))), c) << c;
  }
}

TEST(Fp8E4M3Test, MidpointsTieToEvenAndNeighboursRoundToTheNearest) {
  for (int sign : {0, 0x80}) {
    for (int c = 0; c < 0x7e; ++c) {
      const double lo = SpecValue(sign | c), hi = SpecValue(sign | (c + 1));
      const float mid = static_cast<float>((lo + hi) / 2);  // exact: 5 significant bits
      ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
      const int even = c % 2 == 0 ? c : c + 1;
      EXPECT_EQ(E4M3Encode(mid), sign | even) << "midpoint after code " << c;
      EXPECT_EQ(E4M3Encode(std::nextafter(mid, 0.0f)), sign | c) << c;
      EXPECT_EQ(E4M3Encode(std::nextafter(mid, sign ? -1e9f : 1e9f)), sign | (c + 1)) << c;
    }
  }
}

TEST(Fp8E4M3Test, SaturationNanAndZeros) {
  const float inf = std::numeric_limits<float>::infinity();
  // 464 would be the midpoint to the next (NaN) code: saturation throughout.
  EXPECT_EQ(E4M3Encode(std::nextafter(448.0f, 0.0f)), 0x7e);
  EXPECT_EQ(E4M3Encode(448.0f), 0x7e);
  EXPECT_EQ(E4M3Encode(464.0f), 0x7e);
  EXPECT_EQ(E4M3Encode(-1e30f), 0xfe);
  EXPECT_EQ(E4M3Encode(inf), 0x7e);
  EXPECT_EQ(E4M3Encode(-inf), 0xfe);
  EXPECT_EQ(E4M3Encode(std::nanf("")), 0x7f);
  EXPECT_EQ(E4M3Encode(-std::nanf("")), 0x7f);
  EXPECT_EQ(E4M3Encode(0.0f), 0x00);
  EXPECT_EQ(E4M3Encode(-0.0f), 0x80);
  // Half the smallest subnormal ties to 0; just above it rounds up.
  EXPECT_EQ(E4M3Encode(0x1p-10f), 0x00);
  EXPECT_EQ(E4M3Encode(std::nextafter(0x1p-10f, 1.0f)), 0x01);
  EXPECT_EQ(E4M3Encode(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(Fp8E4M3Test, RandomFloatsMatchTheScanningEncoder) {
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) {
    // Mostly the E4M3 range (2^-12 to 2^10), some of everything else.
    uint32_t bits = rng();
    if (i % 4 != 0) bits = (bits & 0x807fffffu) | ((115 + rng() % 22) << 23);
    const float f = std::bit_cast<float>(bits);
    ASSERT_EQ(E4M3Encode(f), SpecEncode(f)) << f << " bits " << bits;
  }
}

}  // namespace
}  // namespace pdserve::kernels
