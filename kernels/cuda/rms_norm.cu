#include "kernels/cuda/rms_norm.h"

namespace pdserve::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: a block-wide sum of squares, then the scaled write.
// With kAddResidual the row is first x[r] += residual[r], stored back to x.
// Each thread reads and writes only its own elements (i = threadIdx.x +
// k * blockDim.x) in both passes, so out may alias x (plain) or residual
// (fused): an element is read before the barrier and written after it.
template <bool kAddResidual>
__global__ void RmsNormKernel(float* x, const float* residual, const float* __restrict__ weight,
                              float* out, int dim, float eps) {
  float* row = x + static_cast<size_t>(blockIdx.x) * dim;
  float* out_row = out + static_cast<size_t>(blockIdx.x) * dim;
  float sum = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = row[i];
    if constexpr (kAddResidual) {
      v += residual[static_cast<size_t>(blockIdx.x) * dim + i];
      row[i] = v;
    }
    sum += v * v;
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ float warp_sums[kThreads / 32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = sum;
  __syncthreads();
  if (warp == 0) {
    sum = lane < blockDim.x / 32 ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) warp_sums[0] = sum;
  }
  __syncthreads();
  const float scale = rsqrtf(warp_sums[0] / dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) out_row[i] = row[i] * scale * weight[i];
}

// Short rows (Qwen3's per-head Q/K norm: [tokens * heads] rows of head_dim)
// would leave most of a 256-thread block idle: there one warp owns a row and
// a block does kThreads / 32 rows, the sum reduced with shuffles alone. As
// above, each lane reads and writes only its own elements, so out may alias x.
__global__ void RmsNormShortRowsKernel(const float* x, const float* __restrict__ weight, float* out,
                                       int rows, int dim, float eps) {
  const int row = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // a whole warp leaves together
  const int lane = threadIdx.x % 32;
  const float* in_row = x + static_cast<size_t>(row) * dim;
  float* out_row = out + static_cast<size_t>(row) * dim;
  float sum = 0.f;
  for (int i = lane; i < dim; i += 32) sum += in_row[i] * in_row[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float scale = rsqrtf(sum / dim + eps);
  for (int i = lane; i < dim; i += 32) out_row[i] = in_row[i] * scale * weight[i];
}

constexpr int kShortRow = 256;  // longest row handled by one warp

}  // namespace

cudaError_t RmsNormF32(const float* x, const float* weight, float* out, int rows, int dim,
                       float eps, cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaErrorInvalidValue;
  if (dim <= kShortRow) {
    constexpr int kRowsPerBlock = kThreads / 32;
    RmsNormShortRowsKernel<<<(rows + kRowsPerBlock - 1) / kRowsPerBlock, kThreads, 0, stream>>>(
        x, weight, out, rows, dim, eps);
    return cudaGetLastError();
  }
  // The plain kernel never writes x.
  RmsNormKernel<false>
      <<<rows, kThreads, 0, stream>>>(const_cast<float*>(x), nullptr, weight, out, dim, eps);
  return cudaGetLastError();
}

cudaError_t AddRmsNormF32(float* x, const float* residual, const float* weight, float* out,
                          int rows, int dim, float eps, cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaErrorInvalidValue;
  RmsNormKernel<true><<<rows, kThreads, 0, stream>>>(x, residual, weight, out, dim, eps);
  return cudaGetLastError();
}

}  // namespace pdserve::cuda
