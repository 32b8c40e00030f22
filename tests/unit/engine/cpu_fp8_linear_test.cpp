// CpuBackend::Linear with fp8 weights at every SIMD level this processor
// has, against a double-precision product of the weights that the test
// dequantises itself (its own e4m3 decoder and its own reading of the
// scale layouts): per tensor, per channel, 128 x 128 blocks, odd block
// shapes (1 x 128 as the MLA loader makes, 16 x 48), stacked parts with
// different scales, row counts on both sides of the switch from the
// streaming kernels to the many-row product, every code of the format
// (subnormals and 448 included), sizes that leave tails in every loop. Past
// the switch, on a processor with AVX-512 BF16, the AVX-512 level multiplies
// activations rounded to bf16 (gemm_bf16.h) when blocks are an even number
// of columns wide: the reference rounds them alike (its own rounding), and
// elsewhere keeps them fp32; either reference is off by far more than the
// bound if the kernel took the other path.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/gemm_bf16.h"
#include "kernels/cpu/gemv.h"
#include "kernels/cpu/gemv_fp8.h"

namespace pdserve::kernels {
namespace {

// e4m3 (bias 7, 3 mantissa bits; exponent field 0: subnormals of 2^-9).
double Decode(uint8_t code) {
  const int e = (code >> 3) & 15, mant = code & 7;
  const double v = e == 0 ? std::ldexp(mant, -9) : std::ldexp(8 + mant, e - 10);
  return code & 0x80 ? -v : v;
}

// x rounded to bf16: to nearest, ties to even (x finite and normal here).
float RoundToBf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

struct Fp8Weights {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  WeightMatrix matrix;
  // The scale of (r, c), read from the layout as the format defines it.
  double Scale(int64_t r, int64_t c) const {
    switch (matrix.scheme) {
      case WeightScheme::kFp8Tensor:
        return scales[0];
      case WeightScheme::kFp8Channel:
        return scales[r];
      default: {
        const int64_t per_row = (matrix.cols + matrix.block_cols - 1) / matrix.block_cols;
        return scales[(r / matrix.block_rows) * per_row + c / matrix.block_cols];
      }
    }
  }
  double Value(int64_t r, int64_t c) const {
    return Decode(codes[r * matrix.cols + c]) * Scale(r, c);
  }
};

Fp8Weights Random(std::mt19937& rng, WeightScheme scheme, int64_t rows, int64_t cols,
                  int64_t br = 0, int64_t bc = 0) {
  Fp8Weights w;
  std::uniform_int_distribution<int> code(0, 255);
  w.codes.resize(rows * cols);
  for (auto& c : w.codes) {
    do c = static_cast<uint8_t>(code(rng));
    while ((c & 0x7f) == 0x7f);  // no NaN codes (the loader refuses them)
  }
  int64_t n = 1;
  if (scheme == WeightScheme::kFp8Channel) n = rows;
  if (scheme == WeightScheme::kFp8Block) n = ((rows + br - 1) / br) * ((cols + bc - 1) / bc);
  std::uniform_real_distribution<float> exponent(-12.f, -2.f);
  for (int64_t i = 0; i < n; ++i) w.scales.push_back(std::exp2(exponent(rng)));
  w.matrix =
      WeightMatrix{w.codes.data(), DType::kFP8E4M3, rows, cols, scheme, w.scales.data(), br, bc};
  return w;
}

std::vector<SimdLevel> Levels() {
  std::vector<SimdLevel> levels;
  for (int l = 0; l <= static_cast<int>(DetectedSimdLevel()); ++l) {
    levels.push_back(static_cast<SimdLevel>(l));
  }
  return levels;
}

// Whether a product of m rows with w multiplies activations rounded to bf16
// at `level`: past the streaming kernels, on AVX-512 with BF16, unless
// blocks are an odd number of columns wide (a pair of inputs would straddle
// two scales).
bool RoundsActivations(SimdLevel level, int64_t m, const WeightMatrix& w) {
  return m > kMaxStreamingRows && UsesBf16DotProducts(level) &&
         (w.scheme != WeightScheme::kFp8Block || w.block_cols % 2 == 0);
}

// x as the product at `level` multiplies it.
std::vector<float> AsMultiplied(std::vector<float> x, SimdLevel level, int64_t m,
                                const WeightMatrix& w) {
  if (RoundsActivations(level, m, w)) {
    for (auto& v : x) v = RoundToBf16(v);
  }
  return x;
}

// y = x . W^T + bias in double, W the parts' values stacked.
std::vector<double> Reference(const std::vector<float>& x, int64_t m,
                              const std::vector<const Fp8Weights*>& parts,
                              const std::vector<float>& bias, std::vector<double>* magnitude) {
  int64_t n = 0;
  for (auto* p : parts) n += p->matrix.rows;
  const int64_t k = parts[0]->matrix.cols;
  std::vector<double> y(m * n);
  magnitude->assign(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    int64_t j = 0;
    for (auto* p : parts) {
      for (int64_t r = 0; r < p->matrix.rows; ++r, ++j) {
        double acc = bias.empty() ? 0.0 : bias[j], mag = 0;
        for (int64_t c = 0; c < k; ++c) {
          const double t = static_cast<double>(x[i * k + c]) * p->Value(r, c);
          acc += t;
          mag += std::fabs(t);
        }
        y[i * n + j] = acc;
        (*magnitude)[i * n + j] = mag + (bias.empty() ? 0.0 : std::fabs(bias[j]));
      }
    }
  }
  return y;
}

struct Case {
  WeightScheme scheme;
  int64_t n, k, br, bc;
};

TEST(CpuFp8LinearTest, MatchesDoublePrecisionProductOfTheDequantisedWeights) {
  std::mt19937 rng(2026);
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  const Case cases[] = {
      {WeightScheme::kFp8Tensor, 37, 33, 0, 0},      {WeightScheme::kFp8Tensor, 64, 512, 0, 0},
      {WeightScheme::kFp8Channel, 5, 17, 0, 0},      {WeightScheme::kFp8Channel, 130, 200, 0, 0},
      {WeightScheme::kFp8Block, 300, 260, 128, 128},  // partial blocks on both edges
      {WeightScheme::kFp8Block, 64, 512, 128, 128},   // one row of blocks
      {WeightScheme::kFp8Block, 33, 300, 1, 128},     // MLA's row subsets
      {WeightScheme::kFp8Block, 40, 100, 16, 48},     // blocks not multiples of a vector
      {WeightScheme::kFp8Block, 50, 99, 16, 33},      // odd blocks: fp32 activations
      {WeightScheme::kFp8Block, 45, 129, 128, 128},   // one column into the second block
      {WeightScheme::kFp8Channel, 70, 1, 0, 0},       // a single, unpaired column
  };
  for (const SimdLevel level : Levels()) {
    CpuBackend cpu(3, level);
    for (const Case& c : cases) {
      const Fp8Weights w = Random(rng, c.scheme, c.n, c.k, c.br, c.bc);
      for (const int64_t m : {1, 2, 3, 5, 8, 9, 65, 70, 131}) {
        SCOPED_TRACE(std::string(SimdLevelName(level)) + " " + WeightSchemeName(c.scheme) + " " +
                     std::to_string(c.n) + "x" + std::to_string(c.k) + " m " + std::to_string(m));
        std::vector<float> x(m * c.k), bias(c.n);
        for (auto& v : x) v = dist(rng);
        for (auto& v : bias) v = dist(rng);
        WeightStore store(&cpu);
        auto prepared = cpu.PrepareLinear(&w.matrix, 1, bias.data(), /*in_place=*/true, &store);
        ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
        EXPECT_EQ(store.bytes(), 0) << "fp8 weights are read in place";
        std::vector<float> y(m * c.n, NAN);
        cpu.Linear(Tensor::Of(x.data(), DType::kF32, {m, c.k}), *prepared,
                   Tensor::Of(y.data(), DType::kF32, {m, c.n}));
        std::vector<double> mag;
        const auto want = Reference(AsMultiplied(x, level, m, w.matrix), m, {&w}, bias, &mag);
        for (int64_t i = 0; i < m * c.n; ++i) {
          // fp32 sums of k products (exact for two bf16 values; a block's
          // run summed alone, then scaled into the total by one fused
          // multiply-add), at most two roundings of scales and one of the
          // bias: (k + 3) units of 2^-24 of the terms' magnitudes.
          ASSERT_NEAR(y[i], want[i], (c.k + 3) * std::ldexp(1.0, -24) * mag[i] + 1e-30)
              << "element " << i;
        }
      }
    }
  }
}

// q|k|v as three matrices with their own per-tensor scales (and gate|up as
// two with blocks), one product, computed in place.
TEST(CpuFp8LinearTest, StackedPartsKeepTheirOwnScales) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (const SimdLevel level : Levels()) {
    CpuBackend cpu(2, level);
    for (const bool blocks : {false, true}) {
      const WeightScheme scheme = blocks ? WeightScheme::kFp8Block : WeightScheme::kFp8Tensor;
      const int64_t br = blocks ? 128 : 0, bc = blocks ? 128 : 0, k = 192;
      const Fp8Weights a = Random(rng, scheme, 96, k, br, bc);
      const Fp8Weights b = Random(rng, scheme, 40, k, br, bc);
      const Fp8Weights d = Random(rng, scheme, 136, k, br, bc);
      const WeightMatrix parts[] = {a.matrix, b.matrix, d.matrix};
      std::vector<float> bias(96 + 40 + 136);
      for (auto& v : bias) v = dist(rng);
      WeightStore store(&cpu);
      auto w = cpu.PrepareLinear(parts, 3, bias.data(), /*in_place=*/false, &store);
      ASSERT_TRUE(w.ok()) << w.status().ToString();
      EXPECT_GT(store.bytes(), 0) << "not in place: a copy of codes and scales";
      EXPECT_EQ(w->stored_bytes(),
                (96 + 40 + 136) * k +
                    4 * (a.matrix.num_scales() + b.matrix.num_scales() + d.matrix.num_scales()) +
                    4 * (96 + 40 + 136));
      for (const int64_t m : {1, 4, 80, 150}) {
        std::vector<float> x(m * k), y(m * (96 + 40 + 136), NAN);
        for (auto& v : x) v = dist(rng);
        cpu.Linear(Tensor::Of(x.data(), DType::kF32, {m, k}), *w,
                   Tensor::Of(y.data(), DType::kF32, {m, 96 + 40 + 136}));
        std::vector<double> mag;
        const auto want =
            Reference(AsMultiplied(x, level, m, a.matrix), m, {&a, &b, &d}, bias, &mag);
        for (size_t i = 0; i < y.size(); ++i) {
          ASSERT_NEAR(y[i], want[i], (k + 3) * std::ldexp(1.0, -24) * mag[i])
              << SimdLevelName(level) << " m " << m << " " << i;
        }
      }
    }
  }
}

// The widening that feeds BLAS: each element's value times its scale,
// rounded once to fp32, at every level.
TEST(CpuFp8LinearTest, WidenedRowsAreTheValuesRoundedOnce) {
  std::mt19937 rng(3);
  for (const SimdLevel level : Levels()) {
    const Fp8Weights w = Random(rng, WeightScheme::kFp8Block, 70, 300, 16, 48);
    std::vector<float> out(20 * 300);
    WeightRowsToF32(level, w.matrix, 31, 51, out.data());
    for (int64_t r = 0; r < 20; ++r) {
      for (int64_t c = 0; c < 300; ++c) {
        ASSERT_EQ(out[r * 300 + c], static_cast<float>(w.Value(31 + r, c)))
            << SimdLevelName(level) << " " << r << "," << c;
      }
    }
  }
}

// The AVX-512 decode GEMV's two ways of widening the codes (byte lookups
// where the processor has VBMI, arithmetic otherwise) give the same result
// bit for bit: the same values in the same lanes, summed in the same order.
// Every code occurs; the column counts leave tails of 32 and fewer columns.
TEST(CpuFp8LinearTest, ByteLookupIsTheArithmeticWideningBitForBit) {
  if (DetectedSimdLevel() < SimdLevel::kAvx512 || !HasAvx512Vbmi()) {
    GTEST_SKIP() << "no AVX-512 VBMI: the byte lookup does not run here";
  }
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  const Case cases[] = {
      {WeightScheme::kFp8Tensor, 37, 512, 0, 0},     {WeightScheme::kFp8Tensor, 9, 97, 0, 0},
      {WeightScheme::kFp8Channel, 20, 1536, 0, 0},   {WeightScheme::kFp8Channel, 8, 63, 0, 0},
      {WeightScheme::kFp8Block, 300, 260, 128, 128}, {WeightScheme::kFp8Block, 33, 300, 1, 128},
      {WeightScheme::kFp8Block, 40, 100, 16, 48},
  };
  for (const Case& c : cases) {
    const Fp8Weights w = Random(rng, c.scheme, c.n, c.k, c.br, c.bc);
    std::vector<float> x(c.k), bias(c.n);
    for (auto& v : x) v = dist(rng);
    for (auto& v : bias) v = dist(rng);
    std::vector<float> lookup(c.n, NAN), arithmetic(c.n, NAN);
    LinearRowsFp8(SimdLevel::kAvx512, x.data(), 1, w.matrix, bias.data(), 0, c.n, lookup.data(),
                  c.n, /*byte_lookup=*/true);
    LinearRowsFp8(SimdLevel::kAvx512, x.data(), 1, w.matrix, bias.data(), 0, c.n, arithmetic.data(),
                  c.n, /*byte_lookup=*/false);
    for (int64_t j = 0; j < c.n; ++j) {
      ASSERT_EQ(std::memcmp(&lookup[j], &arithmetic[j], sizeof(float)), 0)
          << WeightSchemeName(c.scheme) << " " << c.n << "x" << c.k << " row " << j << ": "
          << lookup[j] << " vs " << arithmetic[j];
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels
