// The host side of the CUDA backend's fp8 products (kernels/fp8_gemm.h),
// held on the CPU: packing stacked parts keeps every weight's value; the
// path each call takes; and the W8A8 arithmetic its GPU test compares with,
// against an independent float64 computation.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/fp8_gemm.h"
#include "tests/support/reference_tensors.h"

namespace pdserve::kernels {
namespace {

using testing::reference::DecodeE4M3;
using testing::reference::RoundE4M3;

struct Part {
  std::vector<uint8_t> codes;
  std::vector<float> scales;
  WeightMatrix m;
};

Part RandomPart(std::mt19937& rng, WeightScheme scheme, int64_t rows, int64_t cols, int64_t br,
                int64_t bc, float input_scale) {
  Part p;
  std::uniform_int_distribution<int> code(0, 255);
  std::uniform_real_distribution<float> e(-9.f, -3.f);
  p.codes.resize(rows * cols);
  for (auto& c : p.codes) {
    do c = static_cast<uint8_t>(code(rng));
    while ((c & 0x7f) == 0x7f);
  }
  p.m = WeightMatrix{nullptr, DType::kFP8E4M3, rows, cols, scheme, nullptr, br, bc};
  p.scales.resize(p.m.num_scales());
  for (auto& s : p.scales) s = std::exp2(e(rng));
  p.m.data = p.codes.data();
  p.m.scales = p.scales.data();
  p.m.activation_scaling = ActivationScaling::kStatic;
  p.m.input_scale = input_scale;
  return p;
}

// Element (r, c) of a matrix with host codes and scales, in double.
double Value(const WeightMatrix& w, int64_t r, int64_t c) {
  return DecodeE4M3(static_cast<const uint8_t*>(w.data)[r * w.cols + c]) * w.scale_at(r, c);
}

TEST(Fp8GemmTest, PackingKeepsEveryValue) {
  std::mt19937 rng(1);
  struct Case {
    WeightScheme scheme;
    int64_t br, bc;
    std::vector<int64_t> rows;
    WeightScheme packed;
    int64_t packed_br;
  };
  const Case cases[] = {
      {WeightScheme::kFp8Tensor, 0, 0, {64, 16, 16}, WeightScheme::kFp8Channel, 0},
      {WeightScheme::kFp8Channel, 0, 0, {40, 24}, WeightScheme::kFp8Channel, 0},
      {WeightScheme::kFp8Block, 128, 128, {256, 128}, WeightScheme::kFp8Block, 128},
      // gate|up of 96 rows each: the second part starts inside a block.
      {WeightScheme::kFp8Block, 128, 128, {96, 96}, WeightScheme::kFp8Block, 1},
  };
  for (const Case& c : cases) {
    std::vector<Part> parts;
    std::vector<WeightMatrix> ms;
    float largest = 0;
    for (size_t i = 0; i < c.rows.size(); ++i) {
      const float in = 0.01f * static_cast<float>(i + 1);
      largest = std::max(largest, in);
      parts.push_back(RandomPart(rng, c.scheme, c.rows[i], 200, c.br, c.bc, in));
    }
    for (auto& p : parts) ms.push_back(p.m);
    PackedFp8 packed = PackFp8Parts(ms.data(), static_cast<int>(ms.size()));
    WeightMatrix w = packed.matrix;
    w.data = packed.codes.data();
    w.scales = packed.scales.data();
    EXPECT_EQ(w.scheme, c.packed);
    if (c.packed == WeightScheme::kFp8Block) {
      EXPECT_EQ(w.block_rows, c.packed_br);
    }
    EXPECT_EQ(static_cast<int64_t>(packed.scales.size()), w.num_scales());
    EXPECT_EQ(w.input_scale, largest) << "the largest static scale of the parts";
    int64_t row = 0;
    for (const Part& p : parts) {
      for (int64_t r = 0; r < p.m.rows; ++r, ++row) {
        for (int64_t col = 0; col < 200; ++col) {
          ASSERT_EQ(Value(w, row, col), Value(p.m, r, col)) << row << "," << col;
        }
      }
    }
  }
}

TEST(Fp8GemmTest, PathOfEachCall) {
  WeightMatrix channel{nullptr, DType::kFP8E4M3, 4096, 4096, WeightScheme::kFp8Channel};
  channel.activation_scaling = ActivationScaling::kDynamicPerToken;
  WeightMatrix block = channel;
  block.scheme = WeightScheme::kFp8Block;
  block.block_rows = block.block_cols = 128;
  WeightMatrix weight_only = channel;
  weight_only.activation_scaling = ActivationScaling::kNone;
  WeightMatrix odd = channel;
  odd.cols = 4100;
  EXPECT_EQ(ChooseFp8GemmPath(90, channel, 1), Fp8GemmPath::kGemv);
  EXPECT_EQ(ChooseFp8GemmPath(90, channel, kFp8GemvMaxRows), Fp8GemmPath::kGemv);
  EXPECT_EQ(ChooseFp8GemmPath(90, channel, kFp8GemvMaxRows + 1), Fp8GemmPath::kW8A8);
  EXPECT_EQ(ChooseFp8GemmPath(89, channel, 4096), Fp8GemmPath::kW8A8);
  EXPECT_EQ(ChooseFp8GemmPath(86, channel, 4096), Fp8GemmPath::kWidenBf16);  // Ampere: weight-only
  EXPECT_EQ(ChooseFp8GemmPath(80, block, 1), Fp8GemmPath::kGemv);
  EXPECT_EQ(ChooseFp8GemmPath(90, block, 4096), Fp8GemmPath::kWidenBf16);
  EXPECT_EQ(ChooseFp8GemmPath(90, weight_only, 4096), Fp8GemmPath::kWidenBf16);
  EXPECT_EQ(ChooseFp8GemmPath(90, odd, 4096), Fp8GemmPath::kWidenBf16);
}

// W8A8Reference against the arithmetic written out in double: activations
// scaled per token, per tensor or statically, rounded to e4m3 (the test's
// own rounding), multiplied by the codes' values, then by both scales.
TEST(Fp8GemmTest, W8A8ReferenceIsTheFormatsArithmetic) {
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> dist(-3.f, 3.f);
  const int64_t m = 9, n = 33, k = 64;
  Part p = RandomPart(rng, WeightScheme::kFp8Channel, n, k, 0, 0, 0.02f);
  std::vector<float> x(m * k), bias(n);
  for (auto& v : x) v = dist(rng);
  for (auto& v : bias) v = dist(rng);
  x[5] = 2000.f;  // static scale 0.02 saturates it at 448 * 0.02
  for (const ActivationScaling mode :
       {ActivationScaling::kDynamicPerToken, ActivationScaling::kDynamicPerTensor,
        ActivationScaling::kStatic}) {
    p.m.activation_scaling = mode;
    std::vector<float> y(m * n);
    W8A8Reference(x.data(), m, p.m, bias.data(), y.data());
    double tensor_amax = 0;
    for (float v : x) tensor_amax = std::max(tensor_amax, std::fabs(static_cast<double>(v)));
    for (int64_t i = 0; i < m; ++i) {
      double amax = 0;
      for (int64_t c = 0; c < k; ++c)
        amax = std::max(amax, std::fabs(static_cast<double>(x[i * k + c])));
      const float s = mode == ActivationScaling::kStatic ? 0.02f
                      : mode == ActivationScaling::kDynamicPerToken
                          ? static_cast<float>(amax) / 448.f
                          : static_cast<float>(tensor_amax) / 448.f;
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0, mag = 0;
        for (int64_t c = 0; c < k; ++c) {
          const double t =
              RoundE4M3(static_cast<float>(x[i * k + c] / s)) * Value(p.m, j, c) / p.scales[j];
          acc += t;
          mag += std::fabs(t);
        }
        const double want = acc * s * p.scales[j] + bias[j];
        ASSERT_NEAR(y[i * n + j], want,
                    (k + 3) * std::ldexp(1.0, -24) * (mag * s * p.scales[j] + std::fabs(bias[j])))
            << static_cast<int>(mode) << " " << i << "," << j;
      }
    }
  }
}

}  // namespace
}  // namespace pdserve::kernels
