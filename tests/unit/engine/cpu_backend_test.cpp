// CPU backend ops that the forward pass fuses: the fused op must give the
// very bits of the unfused sequence it replaces (the engine's reference
// tests compare whole forward passes; this pins the op itself).
#include "kernels/cpu/cpu_backend.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

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

    std::vector<float> want_x = x, want(rows * dim);
    cpu.Add(want_x.data(), y.data(), rows * dim);
    cpu.RmsNorm(want_x.data(), w.data(), want.data(), rows, dim, 1e-5f);

    std::vector<float> got_x = x, got(rows * dim, NAN);
    cpu.AddRmsNorm(got_x.data(), y.data(), w.data(), got.data(), rows, dim, 1e-5f);
    EXPECT_EQ(got_x, want_x) << rows << " rows";
    EXPECT_EQ(got, want) << rows << " rows";

    // out aliasing y, as the engine calls it.
    std::vector<float> alias_x = x, alias_y = y;
    cpu.AddRmsNorm(alias_x.data(), alias_y.data(), w.data(), alias_y.data(), rows, dim, 1e-5f);
    EXPECT_EQ(alias_x, want_x) << rows << " rows";
    EXPECT_EQ(alias_y, want) << rows << " rows";
  }
}

}  // namespace
}  // namespace pdserve::kernels
