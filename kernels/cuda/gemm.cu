// GEMM / GEMV: Linear and the per-head products of MLA (kernels/cuda/ops.h).
#include <cuda_bf16.h>

#include "kernels/cuda/ops.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

// Activations enter bf16 matrix products rounded to nearest even, as the CPU
// reference rounds them (kernels/float_convert.h).
__global__ void F32ToBf16Kernel(const float* x, __nv_bfloat16* y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}

__global__ void AddBiasKernel(float* y, const float* bias, int64_t m, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < m * n) y[i] += bias[i % n];
}

}  // namespace

void Linear(const Gemm& g, const Tensor& x, const LinearWeights& w, const Tensor& y) {
  kernels::CheckPackedF32(x, "Linear");
  kernels::CheckPackedF32(y, "Linear");
  const int64_t m = x.rows();
  kernels::OpCheck(x.row_size() == w.cols && y.row_size() == w.rows && y.rows() == m, "Linear",
                   "takes x [m, w.cols] and y [m, w.rows]");
  if (m == 0) return;
  if (w.scheme() != kernels::WeightScheme::kNone) return Fp8Linear(g, x, w, y);
  // Row-major y[m, rows] = x[m, cols] W^T is column-major y^T = W x^T, with
  // W read as the column-major [cols, rows] matrix transposed. Each stacked
  // part fills its column range of y (ldc = all the rows).
  const float one = 1.0f, zero = 0.0f;
  const int cols = static_cast<int>(w.cols), ldy = static_cast<int>(w.rows);
  const __nv_bfloat16* xb = nullptr;
  if (w.dtype() == DType::kBF16) {
    const int64_t n = m * w.cols;
    auto* converted = g.bf16_x->Get<__nv_bfloat16>(n, g.stream);
    F32ToBf16Kernel<<<Blocks(n), kThreads, 0, g.stream>>>(x.as<const float>(), converted, n);
    Check(cudaGetLastError(), "F32ToBf16");
    xb = converted;
  }
  int64_t first = 0;
  for (int p = 0; p < w.num_parts; ++p) {
    const WeightMatrix& part = w.parts[p];
    const int rows = static_cast<int>(part.rows);
    float* yp = y.as<float>() + first;
    switch (part.dtype) {
      case DType::kF32:
        Check(cublasSgemm(g.fp32, CUBLAS_OP_T, CUBLAS_OP_N, rows, static_cast<int>(m), cols, &one,
                          static_cast<const float*>(part.data), cols, x.as<const float>(), cols,
                          &zero, yp, ldy),
              "cublasSgemm");
        break;
      case DType::kBF16:
        Check(cublasGemmEx(g.bf16, CUBLAS_OP_T, CUBLAS_OP_N, rows, static_cast<int>(m), cols, &one,
                           part.data, CUDA_R_16BF, cols, xb, CUDA_R_16BF, cols, &zero, yp,
                           CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
              "cublasGemmEx bf16");
        break;
      default:
        kernels::OpCheck(false, "Linear", "takes fp32 or bf16 weights");
    }
    first += part.rows;
  }
  if (w.bias != nullptr) {
    AddBiasKernel<<<Blocks(m * w.rows), kThreads, 0, g.stream>>>(y.as<float>(), w.bias, m, w.rows);
    Check(cudaGetLastError(), "bias");
  }
}

void HeadsLinear(const Gemm& g, const Tensor& x, const WeightMatrix& w, const Tensor& y) {
  kernels::CheckPackedF32(x, "HeadsLinear");
  kernels::CheckPackedF32(y, "HeadsLinear");
  kernels::OpCheck(
      x.rank == 3 && y.rank == 3 && y.shape[0] == x.shape[0] && y.shape[1] == x.shape[1],
      "HeadsLinear", "takes x [tokens, heads, in] and y [tokens, heads, out]");
  const int64_t tokens = x.shape[0], heads = x.shape[1];
  if (tokens == 0 || heads == 0) return;
  kernels::OpCheck(w.dtype == DType::kF32 && w.rows % heads == 0 && w.rows / heads == y.shape[2] &&
                       w.cols == x.shape[2],
                   "HeadsLinear", "takes fp32 [heads * out, in] weights");
  // Head h: row-major y_h[tokens, out] = x_h[tokens, in] W_h^T, rows of x_h
  // heads * in apart and of y_h heads * out apart; column-major that is
  // y_h^T = W_h x_h^T, one batch entry per head.
  const float one = 1.0f, zero = 0.0f;
  const int64_t out = w.rows / heads, in = w.cols;
  Check(cublasSgemmStridedBatched(
            g.fp32, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(out), static_cast<int>(tokens),
            static_cast<int>(in), &one, static_cast<const float*>(w.data), static_cast<int>(in),
            out * in, x.as<const float>(), static_cast<int>(heads * in), in, &zero, y.as<float>(),
            static_cast<int>(heads * out), out, static_cast<int>(heads)),
        "cublasSgemmStridedBatched");
}

}  // namespace pdserve::cuda
