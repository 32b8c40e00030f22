// CUDA RMSNorm against a float64 CPU reference (label: gpu).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#if PDSERVE_WITH_CUDA
#include <cuda_runtime.h>

#include "kernels/cuda/device.h"
#include "kernels/cuda/rms_norm.h"
#endif

namespace pdserve {
namespace {

TEST(CudaRmsNormTest, MatchesReference) {
#if !PDSERVE_WITH_CUDA
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
#else
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  const int rows = 37, dim = 4096 + 3;  // odd sizes hit the loop tails
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> dist(-2.f, 2.f);
  std::vector<float> x(rows * dim), w(dim), out(rows * dim, NAN);
  for (auto& v : x) v = dist(rng);
  for (auto& v : w) v = dist(rng);
  float *dx, *dw, *dout;
  ASSERT_EQ(cudaMalloc(&dx, x.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dw, w.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, out.size() * 4), cudaSuccess);
  cudaMemcpy(dx, x.data(), x.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dw, w.data(), w.size() * 4, cudaMemcpyHostToDevice);
  cudaMemset(dout, 0xff, out.size() * 4);  // poison: NaN everywhere
  ASSERT_EQ(cuda::RmsNormF32(dx, dw, dout, rows, dim, 1e-5f, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out.data(), dout, out.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int r = 0; r < rows; ++r) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += double(x[r * dim + i]) * x[r * dim + i];
    const double scale = 1.0 / std::sqrt(ss / dim + 1e-5);
    for (int i = 0; i < dim; ++i) {
      const double want = x[r * dim + i] * scale * w[i];
      ASSERT_NEAR(out[r * dim + i], want, 1e-5 * std::max(1.0, std::fabs(want))) << r << "," << i;
    }
  }
  cudaFree(dx);
  cudaFree(dw);
  cudaFree(dout);
#endif
}

}  // namespace
}  // namespace pdserve
