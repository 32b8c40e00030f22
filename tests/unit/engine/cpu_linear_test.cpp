// CpuBackend::Linear at every SIMD level this processor has, for fp32, bf16
// and fp16 weights, against a double-precision product of the same values:
// row counts on both sides of the switch from the weight-streaming kernels
// to BLAS (or, for bf16 weights on AVX-512 BF16, to products of activations
// rounded to bf16: the reference rounds them alike), odd sizes that exercise
// every tail, with and without bias.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm_bf16.h"
#include "kernels/cpu/gemv.h"
#include "kernels/float_convert.h"

namespace pdserve::kernels {
namespace {

// Weights stored as `dtype`, plus the fp32 values they stand for.
struct Weights {
  std::vector<uint8_t> bytes;
  std::vector<float> values;
  WeightMatrix matrix;
};

Weights RandomWeights(std::mt19937& rng, DType dtype, int64_t rows, int64_t cols) {
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  Weights w;
  const int64_t n = rows * cols, elem = DTypeBits(dtype) / 8;
  w.bytes.resize(n * elem);
  w.values.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const float v = dist(rng);
    if (dtype == DType::kF32) {
      std::memcpy(&w.bytes[i * 4], &v, 4);
      w.values[i] = v;
    } else {
      const uint16_t h = dtype == DType::kBF16 ? F32ToBf16(v) : F32ToF16(v);
      std::memcpy(&w.bytes[i * 2], &h, 2);
      w.values[i] = dtype == DType::kBF16 ? Bf16ToF32(h) : F16ToF32(h);
    }
  }
  w.matrix = WeightMatrix{w.bytes.data(), dtype, rows, cols};
  return w;
}

std::vector<SimdLevel> Levels() {
  std::vector<SimdLevel> levels;
  for (int l = 0; l <= static_cast<int>(DetectedSimdLevel()); ++l) {
    levels.push_back(static_cast<SimdLevel>(l));
  }
  return levels;
}

TEST(CpuLinearTest, MatchesDoublePrecisionProductAtEveryLevel) {
  std::mt19937 rng(12345);
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  for (const SimdLevel level : Levels()) {
    CpuBackend cpu(3, level);
    ASSERT_EQ(cpu.simd_level(), level);
    for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const int64_t m : {1, 2, 3, 4, 5, 8, 9, 17, 65, 97, 131}) {
        for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{1, 1},
                                                                           {3, 7},
                                                                           {4, 16},
                                                                           {5, 17},
                                                                           {37, 33},
                                                                           {130, 64},
                                                                           {67, 515},
                                                                           {200, 31},
                                                                           {96, 2}}) {
          const Weights w = RandomWeights(rng, dtype, n, k);
          std::vector<float> x(m * k), bias(n);
          for (auto& v : x) v = dist(rng);
          for (auto& v : bias) v = dist(rng);
          // The activations as the kernel multiplies them.
          std::vector<float> xr = x;
          if (dtype == DType::kBF16 && m > kMaxStreamingRows && UsesBf16DotProducts(level)) {
            for (auto& v : xr) v = Bf16ToF32(F32ToBf16(v));
          }
          for (const bool with_bias : {false, true}) {
            std::vector<float> y(m * n, NAN);
            cpu.Linear(Tensor::Of(x.data(), DType::kF32, {m, k}),
                       LinearWeights::Of(w.matrix, with_bias ? bias.data() : nullptr),
                       Tensor::Of(y.data(), DType::kF32, {m, n}));
            for (int64_t r = 0; r < m; ++r) {
              for (int64_t j = 0; j < n; ++j) {
                double want = with_bias ? bias[j] : 0.0, magnitude = std::fabs(want);
                for (int64_t i = 0; i < k; ++i) {
                  const double p = static_cast<double>(xr[r * k + i]) * w.values[j * k + i];
                  want += p;
                  magnitude += std::fabs(p);
                }
                // fp32 summation of k + 1 terms in any order: at most
                // (k + 1) * 2^-24 of the sum of their magnitudes.
                const double bound = (k + 1) * std::ldexp(1.0, -24) * magnitude + 1e-30;
                ASSERT_LE(std::fabs(y[r * n + j] - want), bound)
                    << SimdLevelName(level) << " " << DTypeName(dtype) << " m=" << m << " n=" << n
                    << " k=" << k << " bias=" << with_bias << " at (" << r << ", " << j << ")";
              }
            }
          }
        }
      }
    }
  }
}

// The activations' rounding for bf16 dot products is F32ToBf16's: to
// nearest, ties to even, infinities kept, for every tail length.
TEST(CpuLinearTest, ActivationsRoundToBf16AsTheScalarConversion) {
  if (!UsesBf16DotProducts(SimdLevel::kAvx512)) {
    GTEST_SKIP() << "this processor has no AVX-512 BF16: bf16 prefill goes to BLAS";
  }
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> dist(-1e3f, 1e3f);
  std::vector<float> x(37);
  for (auto& v : x) v = dist(rng);
  // Ties (halfway between two bf16 values, both parities) and special values.
  const uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x7f800000u, 0xff800000u,
                               0x00000000u, 0x80000000u, 0x7f7fffffu, 0x00000001u};
  for (size_t i = 0; i < std::size(specials); ++i) std::memcpy(&x[i], &specials[i], 4);
  for (int64_t count = 0; count <= static_cast<int64_t>(x.size()); ++count) {
    std::vector<uint16_t> out(x.size() + 1, 0xabcd);
    RoundRowsToBf16(x.data(), count, out.data());
    for (int64_t i = 0; i < count; ++i) EXPECT_EQ(out[i], F32ToBf16(x[i])) << count << " " << i;
    EXPECT_EQ(out[count], 0xabcd) << "wrote past " << count;
  }
}

// A product of stacked parts (q|k|v, gate|up, kept where they are) gives
// each part's columns what the part's own product gives, for parts of
// different widths, with the bias of every row: exactly on the streaming
// kernels, within fp32 rounding past the BLAS switch (BLAS blocks a wider
// slice of output features differently).
TEST(CpuLinearTest, StackedPartsEqualOneProductPerPart) {
  std::mt19937 rng(777);
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  for (const SimdLevel level : Levels()) {
    CpuBackend cpu(3, level);
    for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (const int64_t m : {1, 3, 17, 64, 65}) {
        const int64_t k = 70, rows[] = {96, 17, 33}, n = 96 + 17 + 33;
        const Weights parts[] = {RandomWeights(rng, dtype, rows[0], k),
                                 RandomWeights(rng, dtype, rows[1], k),
                                 RandomWeights(rng, dtype, rows[2], k)};
        std::vector<float> x(m * k), bias(n);
        for (auto& e : x) e = dist(rng);
        for (auto& e : bias) e = dist(rng);
        LinearWeights stacked;
        for (int p = 0; p < 3; ++p) stacked.parts[p] = parts[p].matrix;
        stacked.num_parts = 3;
        stacked.rows = n;
        stacked.cols = k;
        stacked.bias = bias.data();
        const Tensor xt = Tensor::Of(x.data(), DType::kF32, {m, k});
        std::vector<float> y(m * n, NAN);
        cpu.Linear(xt, stacked, Tensor::Of(y.data(), DType::kF32, {m, n}));
        int64_t first = 0;
        for (int p = 0; p < 3; ++p) {
          std::vector<float> want(m * rows[p]);
          cpu.Linear(xt, LinearWeights::Of(parts[p].matrix, bias.data() + first),
                     Tensor::Of(want.data(), DType::kF32, {m, rows[p]}));
          for (int64_t r = 0; r < m; ++r) {
            for (int64_t j = 0; j < rows[p]; ++j) {
              const float got = y[r * n + first + j], w = want[r * rows[p] + j];
              const float bound =
                  m <= kMaxStreamingRows ? 0.0f : 1e-5f * std::max(1.0f, std::fabs(w));
              ASSERT_LE(std::fabs(got - w), bound)
                  << SimdLevelName(level) << " " << DTypeName(dtype) << " m=" << m << " part " << p
                  << " at (" << r << ", " << j << ")";
            }
          }
          first += rows[p];
        }
      }
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels
