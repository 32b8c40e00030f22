// The scaled KV dtypes as WriteKv (CPU backend) stores them, against bytes
// derived here from the formats and the rule of kernels/backend.h: the
// region scale is the smallest power of two s (found by doubling, not by
// frexp) with max|x| / s within the dtype's range (448 for fp8 e4m3, 57344
// for e5m2, 448 x 6 for nvfp4); fp8 elements are x / s rounded by the
// codecs of kernels/fp8_e4m3.h and kernels/fp8_e5m2.h; nvfp4 follows
// NVIDIA's recipe per 16 consecutive values of a token's head (micro-scale =
// E4M3(amax / 6 / s), codes = E2M1(x / (s * micro)); a head_dim that is not
// a multiple of 16 ends on a shorter group), codes two a byte with the even
// element low, then every token's micro-scales. Those codecs are checked at every code against the
// published formats (fp8_e5m2_test, fp4_e2m1_test). Then: a later write that
// needs a larger scale re-expresses what the block holds without changing a
// value (exact at these magnitudes), and the quantisation error of each type
// on Gaussian data is what the format gives.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/fp4_e2m1.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/fp8_e5m2.h"

namespace pdserve::kernels {
namespace {

constexpr int64_t kBlock = 8;

KvCacheLayout OneHead(DType dtype, int64_t head_dim) {
  KvCacheLayout l;
  l.num_layers = 1;
  l.num_kv_heads = 1;
  l.head_dim = head_dim;
  l.block_size = kBlock;
  l.dtype = dtype;
  l.num_blocks = 2;
  return l;
}

double Range(DType d) {
  return d == DType::kFP8E5M2 ? 57344.0 : d == DType::kNvFp4 ? 448.0 * 6 : 448.0;
}

// The smallest power of two s from 2^-126 up with max_abs / s <= the range,
// at most 2^119 (kernels/kv_quant.h: beyond those 1 / s or the decoders'
// s * 2^8 would leave fp32's range).
float ScaleByDoubling(DType d, float max_abs) {
  if (max_abs == 0) return 0;
  float s = std::ldexp(1.0f, -126);
  while (static_cast<double>(max_abs) / s > Range(d) && s < std::ldexp(1.0f, 119)) s *= 2;
  return s;
}

// Where element i's micro-scale sits among a region's (nvfp4).
int64_t MicroIndex(const KvCacheLayout& l, int64_t i) {
  const int64_t hd = l.head_dim;
  return i / hd * ((hd + 15) / 16) + i % hd / 16;
}

// A head region's bytes for `values` (tokens x head_dim) at scale s,
// written from slot 0.
std::vector<uint8_t> ExpectedRegion(const KvCacheLayout& l, const std::vector<float>& values,
                                    float s) {
  const DType d = l.dtype;
  std::vector<uint8_t> r(l.head_bytes(), 0);
  const int64_t n = static_cast<int64_t>(values.size()), hd = l.head_dim;
  if (d == DType::kNvFp4) {
    for (int64_t t = 0; t < n / hd; ++t) {
      for (int64_t g = t * hd; g < (t + 1) * hd; g += 16) {
        const int64_t end = std::min(g + 16, (t + 1) * hd);
        // NVIDIA's recipe in the region's scaled units (values / s, exact
        // for a power of two), where no intermediate is subnormal.
        float amax = 0;
        for (int64_t i = g; i < end; ++i) amax = std::max(amax, std::fabs(values[i] / s));
        const uint8_t micro = E4M3Encode(amax / 6.0f);
        r[l.head_value_bytes() + MicroIndex(l, g)] = micro;
        const float unit = E4M3Decode(micro);
        for (int64_t i = g; i < end; ++i) {
          const uint8_t code = unit > 0 ? E2M1Encode(values[i] / s / unit) : 0;
          r[i / 2] |= static_cast<uint8_t>(code << (4 * (i % 2)));
        }
      }
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      r[i] = d == DType::kFP8E5M2 ? E5M2Encode(values[i] / s) : E4M3Encode(values[i] / s);
    }
  }
  return r;
}

double Decoded(const KvCacheLayout& l, const uint8_t* region, float s, int64_t i) {
  if (l.dtype == DType::kNvFp4) {
    const uint8_t code = (region[i / 2] >> (4 * (i % 2))) & 0xf;
    return static_cast<double>(E2M1Decode(code)) *
           E4M3Decode(region[l.head_value_bytes() + MicroIndex(l, i)]) * s;
  }
  return static_cast<double>(l.dtype == DType::kFP8E5M2 ? E5M2Decode(region[i])
                                                        : E4M3Decode(region[i])) *
         s;
}

struct Written {
  std::vector<uint8_t> pool;
  float k_scale = 0;
};

// Writes `tokens` tokens of k (v = -k) from slot `first` of block 1.
void Write(CpuBackend& cpu, const KvCacheLayout& l, Written* w, const std::vector<float>& k,
           int64_t first) {
  const int64_t tokens = static_cast<int64_t>(k.size()) / l.head_dim;
  std::vector<float> v(k.size());
  for (size_t i = 0; i < k.size(); ++i) v[i] = -k[i];
  std::vector<int64_t> slots(tokens);
  for (int64_t t = 0; t < tokens; ++t) slots[t] = kBlock + first + t;
  cpu.WriteKv(l, w->pool.data(), 0, Tensor::Of(k.data(), DType::kF32, {tokens, 1, l.head_dim}),
              Tensor::Of(v.data(), DType::kF32, {tokens, 1, l.head_dim}), slots.data());
  std::memcpy(&w->k_scale, w->pool.data() + l.k_scale_offset(1, 0, 0), 4);
}

class KvQuantWriteTest : public ::testing::TestWithParam<DType> {};

// 32: two whole groups a token; 8 (stories260K's heads) and 24: short groups.
constexpr int64_t kHeadDims[] = {32, 8, 24};

TEST_P(KvQuantWriteTest, StoredBytesAreTheFormatsOwn) {
  const DType d = GetParam();
  CpuBackend cpu(2);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  for (const int64_t hd : kHeadDims) {
    const KvCacheLayout l = OneHead(d, hd);
    // Also magnitudes at the ends of fp32's range: regions whose scale would
    // fall under 2^-126 (a reciprocal of inf stored zeros as NaN) or, for
    // 1e-39, whose quotient by the range underflows to 0.
    for (float magnitude : {1e-39f, 1e-37f, 1e-3f, 0.7f, 3.0f, 250.0f, 9e4f, 5e37f}) {
      SCOPED_TRACE(std::string(DTypeName(d)) + " head_dim " + std::to_string(hd) + " magnitude " +
                   std::to_string(magnitude));
      std::vector<float> k(5 * hd);
      for (auto& x : k) x = magnitude * normal(rng);
      k[3] = 0;  // zeros stay zeros
      Written w;
      w.pool.assign(l.total_bytes(), 0xa5);  // a previous user's bytes
      Write(cpu, l, &w, k, 0);
      float max_abs = 0;
      for (float x : k) max_abs = std::max(max_abs, std::fabs(x));
      const float s = ScaleByDoubling(d, max_abs);
      EXPECT_EQ(w.k_scale, s);
      const std::vector<uint8_t> want = ExpectedRegion(l, k, s);
      const uint8_t* got = w.pool.data() + l.k_offset(1, 0, 0);
      // The written tokens' codes (and, for nvfp4, their micro-scales).
      const int64_t code_bytes = static_cast<int64_t>(k.size()) * DTypeBits(d) / 8;
      for (int64_t i = 0; i < code_bytes; ++i) ASSERT_EQ(got[i], want[i]) << "byte " << i;
      if (d == DType::kNvFp4) {
        for (int64_t b = 0; b < 5 * ((hd + 15) / 16); ++b) {
          ASSERT_EQ(got[l.head_value_bytes() + b], want[l.head_value_bytes() + b]) << "micro " << b;
        }
      }
      // V is written by the same rule: -k decodes to minus K's values.
      const uint8_t* v = w.pool.data() + l.v_offset(1, 0, 0);
      float v_scale;
      std::memcpy(&v_scale, w.pool.data() + l.v_scale_offset(1, 0, 0), 4);
      for (int64_t i = 0; i < static_cast<int64_t>(k.size()); ++i) {
        ASSERT_EQ(Decoded(l, v, v_scale, i), -Decoded(l, got, s, i)) << i;
      }
    }
  }
}

TEST_P(KvQuantWriteTest, AGrowingScaleKeepsTheValuesAlreadyStored) {
  const DType d = GetParam();
  CpuBackend cpu(2);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> uniform(0.5f, 1.0f);
  for (const int64_t hd : kHeadDims) {
    SCOPED_TRACE("head_dim " + std::to_string(hd));
    const KvCacheLayout l = OneHead(d, hd);
    std::vector<float> chunk(3 * hd);
    for (auto& x : chunk) x = (rng() % 2 ? 1 : -1) * uniform(rng);
    chunk[0] = 1.0f;  // the chunk's largest magnitude
    Written w;
    w.pool.assign(l.total_bytes(), 0);
    Write(cpu, l, &w, chunk, 0);
    const float before = w.k_scale;
    const uint8_t* region = w.pool.data() + l.k_offset(1, 0, 0);
    std::vector<double> stored(chunk.size());
    for (size_t i = 0; i < chunk.size(); ++i) stored[i] = Decoded(l, region, before, i);

    // A decode token 4x larger: the scale grows 4x, what was there is
    // re-expressed (nvfp4: its micro-scales divided by 4, staying normal).
    std::vector<float> loud(hd);
    for (auto& x : loud) x = 4.0f * (rng() % 2 ? 1 : -1) * uniform(rng);
    loud[0] = 4.0f;  // the largest value of all, so the growth is exactly 4
    Write(cpu, l, &w, loud, 3);
    EXPECT_EQ(w.k_scale, 4 * before);
    for (size_t i = 0; i < chunk.size(); ++i) {
      ASSERT_EQ(Decoded(l, region, w.k_scale, i), stored[i]) << "element " << i;
    }
    // The new token is stored as a first write at that scale would store it.
    const std::vector<uint8_t> want = ExpectedRegion(l, loud, w.k_scale);
    for (int64_t i = 0; i < hd; ++i) {
      EXPECT_NEAR(Decoded(l, region, w.k_scale, 3 * hd + i), Decoded(l, want.data(), w.k_scale, i),
                  1e-12)
          << i;
    }
  }
}

// Relative RMS error of the stored values on Gaussian data, against what
// each format's precision implies: fp8 e4m3 has 3 mantissa bits (steps of
// 2^-3 relative, RMS about 2^-3 / sqrt(12) x ~1.4 over a binade), e5m2 two,
// nvfp4's E2M1 one bit over a 16-value block scale.
TEST_P(KvQuantWriteTest, ErrorIsTheFormatsPrecision) {
  const DType d = GetParam();
  const KvCacheLayout l = OneHead(d, 32);
  CpuBackend cpu(2);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.f, 1.f);
  double err = 0, ref = 0;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> k(kBlock * l.head_dim);
    for (auto& x : k) x = normal(rng);
    Written w;
    w.pool.assign(l.total_bytes(), 0);
    Write(cpu, l, &w, k, 0);
    const uint8_t* region = w.pool.data() + l.k_offset(1, 0, 0);
    for (size_t i = 0; i < k.size(); ++i) {
      const double e = Decoded(l, region, w.k_scale, i) - k[i];
      err += e * e;
      ref += static_cast<double>(k[i]) * k[i];
    }
  }
  const double rel = std::sqrt(err / ref);
  const double bound = d == DType::kFP8E4M3 ? 0.04 : d == DType::kFP8E5M2 ? 0.08 : 0.16;
  const double floor = d == DType::kFP8E4M3 ? 0.01 : d == DType::kFP8E5M2 ? 0.02 : 0.05;
  EXPECT_LT(rel, bound) << DTypeName(d);
  EXPECT_GT(rel, floor) << DTypeName(d) << ": suspiciously exact for the format";
}

// Calibrated scales (KvCacheLayout::fixed_scales): every region of the layer
// takes that scale, from the first write on, whatever it holds; nothing
// grows, and values past the scale's range saturate.
TEST_P(KvQuantWriteTest, FixedScalesAreUsedAsTheyAre) {
  const DType d = GetParam();
  KvCacheLayout l = OneHead(d, 24);
  const float fixed[2] = {0.25f, 0.5f};  // K, V of layer 0
  l.fixed_scales = fixed;
  CpuBackend cpu(2);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> quiet(2 * 24), loud(24);
  for (auto& x : quiet) x = 0.01f * normal(rng);
  for (auto& x : loud) x = 1e5f * normal(rng);  // far past every range at 0.25
  Written w;
  w.pool.assign(l.total_bytes(), 0x5a);
  Write(cpu, l, &w, quiet, 0);
  EXPECT_EQ(w.k_scale, fixed[0]);
  Write(cpu, l, &w, loud, 2);
  EXPECT_EQ(w.k_scale, fixed[0]) << "a calibrated scale must not grow";
  std::vector<float> all = quiet;
  all.insert(all.end(), loud.begin(), loud.end());
  const std::vector<uint8_t> want = ExpectedRegion(l, all, fixed[0]);
  const uint8_t* got = w.pool.data() + l.k_offset(1, 0, 0);
  for (int64_t i = 0; i < 3 * 24; ++i) {
    ASSERT_EQ(Decoded(l, got, w.k_scale, i), Decoded(l, want.data(), fixed[0], i)) << i;
  }
  // The loud token saturated at the largest magnitude the scale holds.
  double largest = 0;
  for (int64_t i = 2 * 24; i < 3 * 24; ++i)
    largest = std::max(largest, std::fabs(Decoded(l, got, w.k_scale, i)));
  EXPECT_EQ(largest, Range(d) * fixed[0]);
  float v_scale;
  std::memcpy(&v_scale, w.pool.data() + l.v_scale_offset(1, 0, 0), 4);
  EXPECT_EQ(v_scale, fixed[1]);
}

INSTANTIATE_TEST_SUITE_P(ScaledKvDtypes, KvQuantWriteTest,
                         ::testing::Values(DType::kFP8E4M3, DType::kFP8E5M2, DType::kNvFp4),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace pdserve::kernels
