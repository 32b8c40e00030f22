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

// Few-row products with bf16 weights (decode): y[r, j] = sum_c bf16(x[r, c])
// W[j, c], the arithmetic of the bf16 GEMM below (activations rounded to
// nearest even, fp32 accumulation) in another order. cuBLAS's kernels for
// a handful of rows read the weights at a fraction of the copy bandwidth;
// this one is built to stream them: a block takes kGemvRows rows of W, its
// threads stride over the columns 8 at a time (16-byte loads, each row's
// loads independent, so several 16-byte loads per thread are in flight),
// each x element is read once per block and reused across its rows, and
// the partial sums meet in shared memory.
constexpr int kGemvThreads = 256;
// Rows of W a block.
constexpr int kGemvRows = 4;
// More rows of x take cuBLAS: on an H100 (2026-11-28, `bench kernels`'
// sweep over Llama-3.1-8B's layers) this kernel read the weights at 0.97,
// 0.90 and 0.85 of the copy bandwidth for 1, 2 and 4 rows but 0.66 and
// 0.56 for 6 and 8 (then with 2 rows of W a block: x's rows, read from L2
// for every 2 rows of W, outweighed them), where cuBLAS read 0.79 at 9 to
// 16 rows.
constexpr int64_t kGemvMaxM = 4;

// Two bf16 packed in a 32-bit word, widened exactly.
__device__ __forceinline__ float Bf16Lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ float RoundToBf16(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

// x is fp32 (rounded here) for one row, whose rounding costs less than a
// conversion launch; bf16, rounded once by F32ToBf16Kernel, for more, where
// every block rounding every row of x again would cost more than the loads
// (kBf16X).
// Blocks an SM: 4 for one row of x (64 registers), else 2 (128 registers),
// for more loads in flight.
template <int M, bool kBf16X>
__global__ void __launch_bounds__(kGemvThreads, M == 1 ? 4 : 2)
    Bf16GemvKernel(const __nv_bfloat16* __restrict__ w, int64_t rows, int64_t cols,
                   const void* __restrict__ x, float* __restrict__ y, int64_t ldy) {
  __shared__ float partial[kGemvThreads / 32][kGemvRows * M];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kGemvRows;
  const int nrows = static_cast<int>(rows - row0 < kGemvRows ? rows - row0 : kGemvRows);
  float acc[kGemvRows][M];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  }
  const int64_t chunks = cols / 8;
  const uint4* wrow[kGemvRows];
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
    // A missing row (the last block) re-reads row 0 of the block; its sums
    // are never written.
    wrow[r] = reinterpret_cast<const uint4*>(w + (row0 + (r < nrows ? r : 0)) * cols);
  }
#pragma unroll 2
  for (int64_t c = threadIdx.x; c < chunks; c += kGemvThreads) {
    uint4 wv[kGemvRows];
#pragma unroll
    for (int r = 0; r < kGemvRows; ++r) wv[r] = __ldcs(wrow[r] + c);  // streamed once
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xv[8];
      if constexpr (kBf16X) {
        const uint4 xr = __ldg(
            reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(x) + m * cols) + c);
        xv[0] = Bf16Lo(xr.x);
        xv[1] = Bf16Hi(xr.x);
        xv[2] = Bf16Lo(xr.y);
        xv[3] = Bf16Hi(xr.y);
        xv[4] = Bf16Lo(xr.z);
        xv[5] = Bf16Hi(xr.z);
        xv[6] = Bf16Lo(xr.w);
        xv[7] = Bf16Hi(xr.w);
      } else {
        const float4* xp =
            reinterpret_cast<const float4*>(static_cast<const float*>(x) + m * cols) + 2 * c;
        const float4 a = __ldg(xp), b = __ldg(xp + 1);
        xv[0] = RoundToBf16(a.x);
        xv[1] = RoundToBf16(a.y);
        xv[2] = RoundToBf16(a.z);
        xv[3] = RoundToBf16(a.w);
        xv[4] = RoundToBf16(b.x);
        xv[5] = RoundToBf16(b.y);
        xv[6] = RoundToBf16(b.z);
        xv[7] = RoundToBf16(b.w);
      }
#pragma unroll
      for (int r = 0; r < kGemvRows; ++r) {
        float sum = acc[r][m];
        sum = fmaf(Bf16Lo(wv[r].x), xv[0], sum);
        sum = fmaf(Bf16Hi(wv[r].x), xv[1], sum);
        sum = fmaf(Bf16Lo(wv[r].y), xv[2], sum);
        sum = fmaf(Bf16Hi(wv[r].y), xv[3], sum);
        sum = fmaf(Bf16Lo(wv[r].z), xv[4], sum);
        sum = fmaf(Bf16Hi(wv[r].z), xv[5], sum);
        sum = fmaf(Bf16Lo(wv[r].w), xv[6], sum);
        sum = fmaf(Bf16Hi(wv[r].w), xv[7], sum);
        acc[r][m] = sum;
      }
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < kGemvRows; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float a = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
      if (lane == 0) partial[warp][r * M + m] = a;
    }
  }
  __syncthreads();
  if (threadIdx.x < kGemvRows * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kGemvThreads / 32; ++v) sum += partial[v][threadIdx.x];
    if (r < nrows) y[m * ldy + row0 + r] = sum;
  }
}

// Whether Bf16GemvKernel takes this product: few rows, whole 16-byte chunks
// of every row of W and x.
bool GemvFits(int64_t m, const WeightMatrix& part, const float* x) {
  return m <= kGemvMaxM && part.cols % 8 == 0 && reinterpret_cast<uintptr_t>(part.data) % 16 == 0 &&
         reinterpret_cast<uintptr_t>(x) % 16 == 0;
}

template <int M>
void LaunchBf16Gemv(const WeightMatrix& part, const void* x, float* y, int64_t ldy,
                    cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((part.rows + kGemvRows - 1) / kGemvRows);
  Bf16GemvKernel<M, (M > 1)><<<blocks, kGemvThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(part.data), part.rows, part.cols, x, y, ldy);
}

// x: fp32 for one row, the bf16 copy for more (Bf16GemvKernel).
void Bf16Gemv(int64_t m, const WeightMatrix& part, const void* x, float* y, int64_t ldy,
              cudaStream_t stream) {
  switch (m) {
    case 1:
      LaunchBf16Gemv<1>(part, x, y, ldy, stream);
      break;
    case 2:
      LaunchBf16Gemv<2>(part, x, y, ldy, stream);
      break;
    case 3:
      LaunchBf16Gemv<3>(part, x, y, ldy, stream);
      break;
    default:
      LaunchBf16Gemv<4>(part, x, y, ldy, stream);
      break;
  }
  Check(cudaGetLastError(), "Bf16Gemv");
}

}  // namespace

void RoundToBf16(const float* x, uint16_t* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  F32ToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(x, reinterpret_cast<__nv_bfloat16*>(y), n);
  Check(cudaGetLastError(), "RoundToBf16");
}

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
  // Few rows take the GEMV kernel, which rounds a single row of x itself;
  // more rows (GEMV or cuBLAS) are converted once for every part.
  bool gemv = w.dtype() == DType::kBF16;
  for (int p = 0; p < w.num_parts; ++p) gemv = gemv && GemvFits(m, w.parts[p], x.as<const float>());
  const __nv_bfloat16* xb = nullptr;
  if (w.dtype() == DType::kBF16 && (!gemv || m > 1)) {
    const int64_t n = m * w.cols;
    auto* converted = g.bf16_x->Get<__nv_bfloat16>(n, g.stream);
    RoundToBf16(x.as<const float>(), reinterpret_cast<uint16_t*>(converted), n, g.stream);
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
        if (gemv) {
          Bf16Gemv(m, part, m > 1 ? static_cast<const void*>(xb) : x.as<const float>(), yp, ldy,
                   g.stream);
          break;
        }
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
  kernels::OpCheck(w.scheme == kernels::WeightScheme::kNone &&
                       (w.dtype == DType::kF32 || w.dtype == DType::kBF16) && w.rows % heads == 0 &&
                       w.rows / heads == y.shape[2] && w.cols == x.shape[2],
                   "HeadsLinear", "takes fp32 or bf16 [heads * out, in] weights");
  // Head h: row-major y_h[tokens, out] = x_h[tokens, in] W_h^T, rows of x_h
  // heads * in apart and of y_h heads * out apart; column-major that is
  // y_h^T = W_h x_h^T, one batch entry per head.
  const float one = 1.0f, zero = 0.0f;
  const int64_t out = w.rows / heads, in = w.cols;
  const int m = static_cast<int>(out), n = static_cast<int>(tokens), k = static_cast<int>(in);
  const int ldx = static_cast<int>(heads * in), ldy = static_cast<int>(heads * out);
  if (w.dtype == DType::kF32) {
    Check(cublasSgemmStridedBatched(g.fp32, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one,
                                    static_cast<const float*>(w.data), k, out * in,
                                    x.as<const float>(), ldx, in, &zero, y.as<float>(), ldy, out,
                                    static_cast<int>(heads)),
          "cublasSgemmStridedBatched");
    return;
  }
  // bf16 weights multiply x rounded to bf16 (Linear's arithmetic), sums fp32.
  const int64_t count = tokens * heads * in;
  auto* xb = g.bf16_x->Get<__nv_bfloat16>(count, g.stream);
  RoundToBf16(x.as<const float>(), reinterpret_cast<uint16_t*>(xb), count, g.stream);
  Check(cublasGemmStridedBatchedEx(g.bf16, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, w.data,
                                   CUDA_R_16BF, k, out * in, xb, CUDA_R_16BF, ldx, in, &zero,
                                   y.as<float>(), CUDA_R_32F, ldy, out, static_cast<int>(heads),
                                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx bf16");
}

}  // namespace pdserve::cuda
