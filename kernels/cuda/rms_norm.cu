#include "kernels/cuda/rms_norm.h"

namespace pdserve::cuda {
namespace {

constexpr int kThreads = 256;

// One block per row: a block-wide sum of squares, then the scaled write.
__global__ void RmsNormF32Kernel(const float* __restrict__ x, const float* __restrict__ weight,
                                 float* __restrict__ out, int dim, float eps) {
  const float* row = x + static_cast<size_t>(blockIdx.x) * dim;
  float* out_row = out + static_cast<size_t>(blockIdx.x) * dim;
  float sum = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) sum += row[i] * row[i];
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

}  // namespace

cudaError_t RmsNormF32(const float* x, const float* weight, float* out, int rows, int dim,
                       float eps, cudaStream_t stream) {
  if (rows <= 0 || dim <= 0) return cudaErrorInvalidValue;
  RmsNormF32Kernel<<<rows, kThreads, 0, stream>>>(x, weight, out, dim, eps);
  return cudaGetLastError();
}

}  // namespace pdserve::cuda
