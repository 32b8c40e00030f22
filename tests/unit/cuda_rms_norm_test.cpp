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

// Rows of `dim` values: 4099 takes the block-per-row kernel, head_dim-sized
// rows (Qwen3's per-head Q/K norm, run in place) the warp-per-row one.
void CheckRmsNorm([[maybe_unused]] int rows, [[maybe_unused]] int dim,
                  [[maybe_unused]] bool in_place) {
#if !PDSERVE_WITH_CUDA
  GTEST_SKIP() << "built without CUDA (PDSERVE_CUDA=OFF or no nvcc)";
#else
  if (cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device on this machine";
  SCOPED_TRACE(::testing::Message()
               << rows << " rows of " << dim << (in_place ? ", in place" : ""));
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
  if (in_place) {
    cudaFree(dout);
    dout = dx;
  }
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
  if (!in_place) cudaFree(dout);
#endif
}

TEST(CudaRmsNormTest, MatchesReference) {
  CheckRmsNorm(37, 4096 + 3, false);  // odd sizes hit the loop tails
  CheckRmsNorm(37, 4096 + 3, true);
}

TEST(CudaRmsNormTest, ShortRowsMatchReference) {
  for (int dim : {8, 32, 100, 128, 256, 257}) {
    CheckRmsNorm(8 * 37 + 5, dim, true);  // a partial block of rows at the end
    CheckRmsNorm(3, dim, false);
  }
}

}  // namespace
}  // namespace pdserve
