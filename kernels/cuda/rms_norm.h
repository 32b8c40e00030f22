// RMSNorm on the device: out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight.
#pragma once

#include <cuda_runtime_api.h>

namespace pdserve::cuda {

// x, weight and out are device pointers; x and out are [rows, dim] row-major
// and may alias. Returns the launch error, if any. Rows of up to 256 values
// (per-head norms over head_dim) take one warp each, longer ones a block.
cudaError_t RmsNormF32(const float* x, const float* weight, float* out, int rows, int dim,
                       float eps, cudaStream_t stream);

// The residual add fused in: x[r] += residual[r] (stored), then out[r] =
// RmsNorm(x[r]). out may alias residual, not x.
cudaError_t AddRmsNormF32(float* x, const float* residual, const float* weight, float* out,
                          int rows, int dim, float eps, cudaStream_t stream);

}  // namespace pdserve::cuda
