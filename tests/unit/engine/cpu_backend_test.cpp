// CPU backend ops that replace a longer host-side sequence must give its
// very results: the fused residual + norm those of Add then RmsNorm, the
// backend argmax the sampler's greedy token (the engine's reference tests
// compare whole forward passes; these pin the ops themselves).
#include "kernels/cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "engine/sampler.h"

namespace pdserve::kernels {
namespace {

std::vector<float> Random(std::mt19937& rng, size_t n) {
  std::uniform_real_distribution<float> dist(-3.f, 3.f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

TEST(CpuBackendTest, AddRmsNormIsAddThenRmsNorm) {
  std::mt19937 rng(std::random_device{}());
  CpuBackend cpu(3);
  for (const int64_t rows : {1, 7, 64}) {
    const int64_t dim = 517;
    const auto x = Random(rng, rows * dim), y = Random(rng, rows * dim), w = Random(rng, dim);

    auto t = [&](std::vector<float>& v) { return Tensor::Of(v.data(), DType::kF32, {rows, dim}); };
    auto weight = Tensor::Of(w.data(), DType::kF32, {dim});
    std::vector<float> want_x = x, want(rows * dim), y_copy = y;
    cpu.Add(t(want_x), t(y_copy));
    cpu.RmsNorm(t(want_x), weight, 1e-5f, t(want));

    std::vector<float> got_x = x, got(rows * dim, NAN);
    cpu.AddRmsNorm(t(got_x), t(y_copy), weight, 1e-5f, t(got));
    EXPECT_EQ(got_x, want_x) << rows << " rows";
    EXPECT_EQ(got, want) << rows << " rows";

    // out aliasing y, as the engine calls it.
    std::vector<float> alias_x = x, alias_y = y;
    cpu.AddRmsNorm(t(alias_x), t(alias_y), weight, 1e-5f, t(alias_y));
    EXPECT_EQ(alias_x, want_x) << rows << " rows";
    EXPECT_EQ(alias_y, want) << rows << " rows";
  }
}

TEST(CpuBackendTest, ArgMaxRowsIsTheSamplersGreedyToken) {
  std::mt19937 rng(std::random_device{}());
  CpuBackend cpu(1);
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const int64_t n = 1000;
  std::vector<std::vector<float>> rows;
  for (int i = 0; i < 20; ++i) rows.push_back(Random(rng, n));
  // Ties (lowest column wins), NaN (never wins), -inf everywhere, NaN first.
  rows.push_back(std::vector<float>(n, 1.5f));
  rows.push_back(Random(rng, n));
  rows.back()[3] = rows.back()[900] = 7.f;
  rows.push_back(Random(rng, n));
  rows.back()[0] = nan;
  rows.back()[500] = nan;
  rows.push_back(std::vector<float>(n, -inf));
  rows.push_back(std::vector<float>(n, -inf));
  rows.back()[0] = nan;
  rows.back()[n - 1] = -1e30f;
  std::vector<float> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  std::vector<int32_t> got(rows.size(), -1);
  cpu.ArgMaxRows(Tensor::Of(flat.data(), DType::kF32, {static_cast<int64_t>(rows.size()), n}),
                 got.data());
  SamplingParams greedy;
  greedy.temperature = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    EXPECT_EQ(got[r], SampleToken(rows[r], greedy, /*seed=*/1, /*position=*/0).token)
        << "row " << r;
  }
  EXPECT_EQ(got[20], 0);
  EXPECT_EQ(got[21], 3);
  EXPECT_EQ(got[23], 0);
  EXPECT_EQ(got[24], n - 1);
}

}  // namespace
}  // namespace pdserve::kernels
