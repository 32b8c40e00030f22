// RMSNorm, plain and with the residual add fused in (kernels/cuda/ops.h):
// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row of the last
// dimension; rows are addressed through RowLayout, so the per-head q/k norm
// works on views of the packed q|k|v product.
#include "kernels/cuda/ops.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

using kernels::RowLayout;

// One block per row: a block-wide sum of squares, then the scaled write.
// With kAddResidual the row is first x[r] += residual[r], stored back to x.
// Each thread reads and writes only its own elements (i = threadIdx.x +
// k * blockDim.x) in both passes, so out may alias x (plain) or residual
// (fused): an element is read before the barrier and written after it.
template <bool kAddResidual>
__global__ void RmsNormKernel(float* x, RowLayout xl, const float* residual, RowLayout rl,
                              const float* __restrict__ weight, float* out, RowLayout ol, int dim,
                              float eps) {
  float* row = x + xl.offset(blockIdx.x);
  float* out_row = out + ol.offset(blockIdx.x);
  float sum = 0.f;
  for (int i = threadIdx.x; i < dim; i += blockDim.x) {
    float v = row[i];
    if constexpr (kAddResidual) {
      v += residual[rl.offset(blockIdx.x) + i];
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
__global__ void RmsNormShortRowsKernel(const float* x, RowLayout xl,
                                       const float* __restrict__ weight, float* out, RowLayout ol,
                                       int64_t rows, int dim, float eps) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(kThreads / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // a whole warp leaves together
  const int lane = threadIdx.x % 32;
  const float* in_row = x + xl.offset(row);
  float* out_row = out + ol.offset(row);
  float sum = 0.f;
  for (int i = lane; i < dim; i += 32) sum += in_row[i] * in_row[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  const float scale = rsqrtf(sum / dim + eps);
  for (int i = lane; i < dim; i += 32) out_row[i] = in_row[i] * scale * weight[i];
}

constexpr int kShortRow = 256;  // longest row handled by one warp

void CheckNorm(const Tensor& x, const Tensor& weight, const Tensor& out, const char* op) {
  kernels::CheckF32(x, op);
  kernels::CheckF32(out, op);
  kernels::OpCheck(weight.dtype == DType::kF32 && weight.numel() == x.row_size() &&
                       out.rows() == x.rows() && out.row_size() == x.row_size(),
                   op, "takes x and out of one shape and an fp32 weight of a row's size");
}

}  // namespace

void RmsNorm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out,
             cudaStream_t stream) {
  CheckNorm(x, weight, out, "RmsNorm");
  const int64_t rows = x.rows();
  const int dim = static_cast<int>(x.row_size());
  if (rows == 0) return;
  if (dim <= kShortRow) {
    constexpr int kRowsPerBlock = kThreads / 32;
    RmsNormShortRowsKernel<<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock),
                             kThreads, 0, stream>>>(x.as<const float>(), x.row_layout(),
                                                    weight.as<const float>(), out.as<float>(),
                                                    out.row_layout(), rows, dim, eps);
  } else {
    // The plain kernel never writes x.
    RmsNormKernel<false><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
        x.as<float>(), x.row_layout(), nullptr, RowLayout{}, weight.as<const float>(),
        out.as<float>(), out.row_layout(), dim, eps);
  }
  Check(cudaGetLastError(), "RmsNorm");
}

void AddRmsNorm(const Tensor& x, const Tensor& y, const Tensor& weight, float eps,
                const Tensor& out, cudaStream_t stream) {
  CheckNorm(x, weight, out, "AddRmsNorm");
  kernels::CheckF32(y, "AddRmsNorm");
  kernels::OpCheck(y.rows() == x.rows() && y.row_size() == x.row_size(), "AddRmsNorm",
                   "takes x and y of one shape");
  if (x.rows() == 0) return;
  RmsNormKernel<true><<<static_cast<unsigned>(x.rows()), kThreads, 0, stream>>>(
      x.as<float>(), x.row_layout(), y.as<const float>(), y.row_layout(), weight.as<const float>(),
      out.as<float>(), out.row_layout(), static_cast<int>(x.row_size()), eps);
  Check(cudaGetLastError(), "AddRmsNorm");
}

}  // namespace pdserve::cuda
