// GEMM / GEMV with fp8 weights (kernels/cuda/ops.h Fp8Linear): the paths
// of kernels/fp8_gemm.h. Weights are prepared by CudaBackend::PrepareLinear
// as one packed matrix (PackFp8Parts): e4m3 codes [rows, cols] and fp32
// scales per row (kFp8Channel) or per block.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>

#include "kernels/cuda/fp8_codes.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/fp8_gemm.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

using kernels::ActivationScaling;
using kernels::Fp8GemmPath;
using kernels::WeightScheme;

// The scales of a packed matrix as the kernels read them: scale of (row, col)
// = scales[row / block_rows * scale_cols + col / block_cols]; a per-row
// scheme is blocks of 1 x cols.
struct Fp8Scales {
  const float* scales;
  int64_t block_rows, block_cols, scale_cols;
  __device__ float at(int64_t row, int64_t col) const {
    return scales[row / block_rows * scale_cols + col / block_cols];
  }
};

Fp8Scales ScalesOf(const WeightMatrix& w) {
  if (w.scheme == WeightScheme::kFp8Block) {
    return {w.scales, w.block_rows, w.block_cols, w.scale_cols()};
  }
  return {w.scales, 1, w.cols, 1};
}

constexpr int kGemvWarps = 4;  // output rows per block, one warp each

// y[r][j] = sum_c x[r][c] * value(j, c) (+ bias[j]) for r < M: one warp
// per output row j, each lane reading one code at a time, the scale applied
// per code or, per row, once at the end. The general case (any cols, any
// alignment); Fp8StreamGemvKernel takes the usual one.
template <int M>
__global__ void Fp8GemvKernel(const float* __restrict__ x, const uint8_t* __restrict__ w,
                              Fp8Scales s, bool per_row, const float* __restrict__ bias,
                              float* __restrict__ y, int64_t n, int64_t k) {
  const int lane = threadIdx.x % 32;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kGemvWarps + threadIdx.x / 32;
  if (j >= n) return;
  const uint8_t* row = w + j * k;
  float acc[M];
#pragma unroll
  for (int r = 0; r < M; ++r) acc[r] = 0.f;
  for (int64_t c = lane; c < k; c += 32) {
    const float v = Fp8ToFloat(row[c]) * (per_row ? 1.f : s.at(j, c));
#pragma unroll
    for (int r = 0; r < M; ++r) acc[r] += x[r * k + c] * v;
  }
#pragma unroll
  for (int r = 0; r < M; ++r) {
    float a = acc[r];
#pragma unroll
    for (int o = 16; o > 0; o /= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
    if (lane == 0) {
      y[r * n + j] = a * (per_row ? s.at(j, 0) : 1.f) + (bias != nullptr ? bias[j] : 0.f);
    }
  }
}

// Few-row products (decode) streaming the codes, built as Bf16GemvKernel
// (gemm.cu) is: a block takes Fp8GemvRows(M) rows of W, its threads stride
// over the columns 16 at a time (16-byte loads, every row's load issued
// before any is used, so 4-8 x 16 bytes per thread are in flight), x is read
// once per chunk and reused across the rows, and the partial sums meet in
// shared memory. The weight-only product: codes widened exactly, fp32
// activations, each 16-column chunk's products summed in fp32 and scaled by
// its block's scale (kBlock), or per row the row's sum scaled once at the
// end. Needs cols % 16 == 0 (and block_cols % 16 == 0 for kBlock, so that a
// chunk lies in one block) and W and x 16-byte aligned; Fp8GemvKernel takes
// the rest.
constexpr int kStreamThreads = 256;
constexpr int Fp8GemvRows(int m) { return m <= 2 ? 8 : 4; }

__device__ __forceinline__ uint32_t Word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int M, bool kBlock>
__global__ void __launch_bounds__(kStreamThreads)
    Fp8StreamGemvKernel(const float* __restrict__ x, const uint8_t* __restrict__ w, Fp8Scales s,
                        const float* __restrict__ bias, float* __restrict__ y, int64_t n,
                        int64_t k) {
  constexpr int R = Fp8GemvRows(M);
  __shared__ float partial[kStreamThreads / 32][R * M];
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * R;
  const int nrows = static_cast<int>(n - row0 < R ? n - row0 : R);
  const uint4* wrow[R];
  const float* srow[R];  // kBlock: the row's block row of scales
#pragma unroll
  for (int r = 0; r < R; ++r) {
    // A missing row (the last block) re-reads the block's first row; its
    // sums are never written.
    const int64_t row = row0 + (r < nrows ? r : 0);
    wrow[r] = reinterpret_cast<const uint4*>(w + row * k);
    // 32-bit divisions: a matrix's rows and columns are far below 2^32.
    srow[r] = kBlock ? s.scales + static_cast<uint32_t>(row) / static_cast<uint32_t>(s.block_rows) *
                                      s.scale_cols
                     : nullptr;
  }
  float acc[R][M];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
  }
  const int64_t chunks = k / 16;
  for (int64_t c = threadIdx.x; c < chunks; c += kStreamThreads) {
    uint4 wv[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r] = __ldcs(wrow[r] + c);  // streamed once
    float scale[R];
    if constexpr (kBlock) {
      const uint32_t block_col =
          static_cast<uint32_t>(c * 16) / static_cast<uint32_t>(s.block_cols);
#pragma unroll
      for (int r = 0; r < R; ++r) scale[r] = __ldg(srow[r] + block_col);
    }
    float part[R][M];  // kBlock: the chunk's sums, scaled once
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) part[r][m] = 0.f;
    }
    // Four columns at a time: every row's x values loaded once, each row's
    // codes widened once.
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      float4 xv[M];
#pragma unroll
      for (int m = 0; m < M; ++m)
        xv[m] = __ldg(reinterpret_cast<const float4*>(x + m * k) + 4 * c + q);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float4 v = Fp8QuadToFloat4(Word(wv[r], q));
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float d = xv[m].x * v.x + xv[m].y * v.y + xv[m].z * v.z + xv[m].w * v.w;
          // Per row the chunk's sum would be scaled by 1: straight into the
          // row's sum, which saves a chunk's R x M registers.
          if constexpr (kBlock) {
            part[r][m] += d;
          } else {
            acc[r][m] += d;
          }
        }
      }
    }
    if constexpr (kBlock) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] += part[r][m] * scale[r];
      }
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float a = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o /= 2) a += __shfl_xor_sync(0xffffffffu, a, o);
      if (lane == 0) partial[warp][r * M + m] = a;
    }
  }
  __syncthreads();
  if (threadIdx.x < R * M) {
    const int r = threadIdx.x / M, m = threadIdx.x % M;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < kStreamThreads / 32; ++v) sum += partial[v][threadIdx.x];
    if (r < nrows) {
      const int64_t j = row0 + r;
      // Per row, scale (j, any column) is scales[j].
      y[m * n + j] = sum * (kBlock ? 1.f : s.scales[j]) + (bias != nullptr ? bias[j] : 0.f);
    }
  }
}

template <int M>
void LaunchGemv(const float* x, const WeightMatrix& w, const float* bias, float* y, int64_t n,
                cudaStream_t stream) {
  const int64_t k = w.cols;
  const Fp8Scales s = ScalesOf(w);
  const bool per_row = w.scheme != WeightScheme::kFp8Block;
  const bool stream_fits = k % 16 == 0 && (per_row || w.block_cols % 16 == 0) &&
                           reinterpret_cast<uintptr_t>(w.data) % 16 == 0 &&
                           reinterpret_cast<uintptr_t>(x) % 16 == 0;
  const auto* codes = static_cast<const uint8_t*>(w.data);
  if (stream_fits) {
    const auto blocks = static_cast<unsigned>((n + Fp8GemvRows(M) - 1) / Fp8GemvRows(M));
    if (per_row) {
      Fp8StreamGemvKernel<M, false>
          <<<blocks, kStreamThreads, 0, stream>>>(x, codes, s, bias, y, n, k);
    } else {
      Fp8StreamGemvKernel<M, true>
          <<<blocks, kStreamThreads, 0, stream>>>(x, codes, s, bias, y, n, k);
    }
  } else {
    const auto blocks = static_cast<unsigned>((n + kGemvWarps - 1) / kGemvWarps);
    Fp8GemvKernel<M><<<blocks, 32 * kGemvWarps, 0, stream>>>(x, codes, s, per_row, bias, y, n, k);
  }
  Check(cudaGetLastError(), "Fp8Gemv");
}

void Gemv(const float* x, int64_t m, const WeightMatrix& w, const float* bias, float* y,
          cudaStream_t stream) {
  const int64_t n = w.rows;
  switch (m) {
    case 1:
      return LaunchGemv<1>(x, w, bias, y, n, stream);
    case 2:
      return LaunchGemv<2>(x, w, bias, y, n, stream);
    case 3:
      return LaunchGemv<3>(x, w, bias, y, n, stream);
    case 4:
      return LaunchGemv<4>(x, w, bias, y, n, stream);
    case 5:
      return LaunchGemv<5>(x, w, bias, y, n, stream);
    case 6:
      return LaunchGemv<6>(x, w, bias, y, n, stream);
    case 7:
      return LaunchGemv<7>(x, w, bias, y, n, stream);
    default:
      return LaunchGemv<8>(x, w, bias, y, n, stream);
  }
}

// ---- kWidenBf16: rows [r0, r0 + rows) dequantised to bf16.
__global__ void WidenRowsKernel(const uint8_t* __restrict__ w, Fp8Scales s, int64_t r0,
                                int64_t rows, int64_t k, __nv_bfloat16* __restrict__ out) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * k) return;
  const int64_t r = r0 + i / k, c = i % k;
  out[i] = __float2bfloat16_rn(Fp8ToFloat(w[r * k + c]) * s.at(r, c));
}

__global__ void AddBiasRowsKernel(float* y, const float* bias, int64_t m, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < m * n) y[i] += bias[i % n];
}

// Weights widened at most this many bytes of bf16 at a time.
constexpr int64_t kWidenBytes = int64_t{64} << 20;

void WidenBf16(const Gemm& g, const float* x, int64_t m, const WeightMatrix& w, const float* bias,
               float* y) {
  const int64_t n = w.rows, k = w.cols;
  auto* xb = g.bf16_x->Get<__nv_bfloat16>(m * k, g.stream);
  RoundToBf16(x, reinterpret_cast<uint16_t*>(xb), m * k, g.stream);
  const int64_t chunk = std::max<int64_t>(1, std::min(n, kWidenBytes / (2 * k)));
  auto* wb = g.fp8_widened->Get<__nv_bfloat16>(chunk * k, g.stream);
  const Fp8Scales s = ScalesOf(w);
  const float one = 1.0f, zero = 0.0f;
  for (int64_t r0 = 0; r0 < n; r0 += chunk) {
    const int64_t rows = std::min(chunk, n - r0);
    WidenRowsKernel<<<Blocks(rows * k), kThreads, 0, g.stream>>>(
        static_cast<const uint8_t*>(w.data), s, r0, rows, k, wb);
    Check(cudaGetLastError(), "WidenRows");
    // Column-major y^T[rows slice, m] = W_slice x^T, ldc = n.
    Check(cublasGemmEx(g.bf16, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(rows),
                       static_cast<int>(m), static_cast<int>(k), &one, wb, CUDA_R_16BF,
                       static_cast<int>(k), xb, CUDA_R_16BF, static_cast<int>(k), &zero, y + r0,
                       CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx fp8 widened");
  }
  if (bias != nullptr) {
    AddBiasRowsKernel<<<Blocks(m * n), kThreads, 0, g.stream>>>(y, bias, m, n);
    Check(cudaGetLastError(), "bias");
  }
}

// ---- kW8A8.

// One block per row: the row's activation scale (per token: from its
// largest magnitude; per tensor: the magnitude itself, made a scale by
// TensorScaleKernel; static: the checkpoint's).
__global__ void RowScaleKernel(const float* __restrict__ x, int64_t k, ActivationScaling mode,
                               float input_scale, float* __restrict__ xs) {
  const int64_t row = blockIdx.x;
  if (mode == ActivationScaling::kStatic) {
    if (threadIdx.x == 0) xs[row] = input_scale;
    return;
  }
  float amax = 0.f;
  for (int64_t c = threadIdx.x; c < k; c += blockDim.x) amax = fmaxf(amax, fabsf(x[row * k + c]));
  __shared__ float warp_max[32];
  for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = amax;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (unsigned i = 1; i < blockDim.x / 32; ++i) amax = fmaxf(amax, warp_max[i]);
    xs[row] =
        mode == ActivationScaling::kDynamicPerToken ? (amax > 0.f ? amax / 448.f : 1.f) : amax;
  }
}

// One block: every row's scale from the largest row magnitude.
__global__ void TensorScaleKernel(float* xs, int64_t m) {
  __shared__ float scale;
  if (threadIdx.x == 0) {
    float amax = 0.f;
    for (int64_t i = 0; i < m; ++i) amax = fmaxf(amax, xs[i]);
    scale = amax > 0.f ? amax / 448.f : 1.f;
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < m; i += blockDim.x) xs[i] = scale;
}

__global__ void QuantizeRowsKernel(const float* __restrict__ x, const float* __restrict__ xs,
                                   int64_t m, int64_t k, __nv_fp8_storage_t* __restrict__ xq) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= m * k) return;
  xq[i] = __nv_cvt_float_to_fp8(x[i] / xs[i / k], __NV_SATFINITE, __NV_E4M3);
}

// y[i][j] = acc[i][j] * xs[i] * ws[j] (+ bias[j]), in place.
__global__ void ScaleOutputKernel(float* y, const float* __restrict__ xs,
                                  const float* __restrict__ ws, const float* __restrict__ bias,
                                  int64_t m, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= m * n) return;
  const int64_t row = i / n, col = i % n;
  y[i] = y[i] * xs[row] * ws[col] + (bias != nullptr ? bias[col] : 0.f);
}

// The cuBLASLt objects of one fp8 GEMM shape and the algorithm its
// heuristic chose (found false: none, the caller widens instead).
struct LtPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  cublasLtMatmulHeuristicResult_t result = {};
  bool found = false;
  LtPlan() = default;
  LtPlan(const LtPlan&) = delete;
  LtPlan& operator=(const LtPlan&) = delete;
  ~LtPlan() {
    if (pref != nullptr) cublasLtMatmulPreferenceDestroy(pref);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (op != nullptr) cublasLtMatmulDescDestroy(op);
  }
};

// acc (column-major [n, m] = row-major y [m, n]) = W xq^T: the
// descriptors, and the heuristic's pick within the workspace.
std::unique_ptr<LtPlan> BuildLtPlan(const Gemm& g, int64_t m, int64_t n, int64_t k) {
  auto plan = std::make_unique<LtPlan>();
  LtPlan& d = *plan;
  Check(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F),
        "cublasLtMatmulDescCreate");
  const cublasOperation_t t = CUBLAS_OP_T, nt = CUBLAS_OP_N;
  Check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)), "TRANSA");
  Check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &nt, sizeof(nt)),
        "TRANSB");
  // Fp8 products promoted to full fp32 accumulation periodically (no fast
  // accumulation): the accuracy the CPU reference is held to.
  const int8_t fast = 0;
  Check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)),
        "FAST_ACCUM");
  Check(cublasLtMatrixLayoutCreate(&d.a, CUDA_R_8F_E4M3, k, n, k), "layout A");
  Check(cublasLtMatrixLayoutCreate(&d.b, CUDA_R_8F_E4M3, k, m, k), "layout B");
  Check(cublasLtMatrixLayoutCreate(&d.d, CUDA_R_32F, n, m, n), "layout D");
  Check(cublasLtMatmulPreferenceCreate(&d.pref), "cublasLtMatmulPreferenceCreate");
  const size_t ws = g.lt_workspace_bytes;
  Check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof(ws)),
        "MAX_WORKSPACE_BYTES");
  int found = 0;
  d.found = cublasLtMatmulAlgoGetHeuristic(g.lt, d.op, d.a, d.b, d.d, d.d, d.pref, 1, &d.result,
                                           &found) == CUBLAS_STATUS_SUCCESS &&
            found > 0;
  return plan;
}

}  // namespace

// Plans by (m, n, k), up to kMaxPlans of them: a prefill step meets a
// handful of shapes per layer and every layer repeats them, so the
// heuristic (host time, tens of microseconds) runs once a shape rather
// than once a call. Past the cap (many distinct chunk lengths) a shape's
// plan is built for its call alone.
struct LtPlans {
  static constexpr size_t kMaxPlans = 1024;
  std::map<std::array<int64_t, 3>, std::unique_ptr<LtPlan>> plans;
};

LtPlans* CreateLtPlans() { return new LtPlans; }
void DestroyLtPlans(LtPlans* plans) { delete plans; }

namespace {

// acc = W xq^T on the fp8 tensor cores, fp32 out; false when cuBLASLt has
// no algorithm for it (the caller widens instead).
bool LtFp8Gemm(const Gemm& g, const uint8_t* w, const __nv_fp8_storage_t* xq, int64_t m, int64_t n,
               int64_t k, float* y) {
  const std::array<int64_t, 3> shape{m, n, k};
  const LtPlan* plan = nullptr;
  std::unique_ptr<LtPlan> uncached;
  if (g.lt_plans != nullptr) {
    auto it = g.lt_plans->plans.find(shape);
    if (it == g.lt_plans->plans.end() && g.lt_plans->plans.size() < LtPlans::kMaxPlans) {
      it = g.lt_plans->plans.emplace(shape, BuildLtPlan(g, m, n, k)).first;
    }
    if (it != g.lt_plans->plans.end()) plan = it->second.get();
  }
  if (plan == nullptr) {
    uncached = BuildLtPlan(g, m, n, k);
    plan = uncached.get();
  }
  if (!plan->found) return false;
  const float one = 1.0f, zero = 0.0f;
  Check(cublasLtMatmul(g.lt, plan->op, &one, w, plan->a, xq, plan->b, &zero, y, plan->d, y, plan->d,
                       &plan->result.algo, g.lt_workspace, g.lt_workspace_bytes, g.stream),
        "cublasLtMatmul fp8");
  return true;
}

bool W8A8(const Gemm& g, const float* x, int64_t m, const WeightMatrix& w, const float* bias,
          float* y) {
  const int64_t n = w.rows, k = w.cols;
  // The codes and the scales in one piece of scratch: scales first.
  const int64_t scale_floats = (m + 63) / 64 * 64;
  auto* scratch = g.fp8_x->Get<uint8_t>(scale_floats * 4 + m * k, g.stream);
  auto* xs = reinterpret_cast<float*>(scratch);
  auto* xq = reinterpret_cast<__nv_fp8_storage_t*>(scratch + scale_floats * 4);
  RowScaleKernel<<<static_cast<unsigned>(m), kThreads, 0, g.stream>>>(x, k, w.activation_scaling,
                                                                      w.input_scale, xs);
  Check(cudaGetLastError(), "RowScale");
  if (w.activation_scaling == ActivationScaling::kDynamicPerTensor) {
    TensorScaleKernel<<<1, kThreads, 0, g.stream>>>(xs, m);
    Check(cudaGetLastError(), "TensorScale");
  }
  QuantizeRowsKernel<<<Blocks(m * k), kThreads, 0, g.stream>>>(x, xs, m, k, xq);
  Check(cudaGetLastError(), "QuantizeRows");
  if (!LtFp8Gemm(g, static_cast<const uint8_t*>(w.data), xq, m, n, k, y)) return false;
  ScaleOutputKernel<<<Blocks(m * n), kThreads, 0, g.stream>>>(y, xs, w.scales, bias, m, n);
  Check(cudaGetLastError(), "ScaleOutput");
  return true;
}

}  // namespace

void Fp8Linear(const Gemm& g, const Tensor& x, const LinearWeights& w, const Tensor& y) {
  // CudaBackend::PrepareLinear packs every fp8 product into one matrix.
  kernels::OpCheck(w.num_parts == 1, "Linear", "takes fp8 weights packed into one matrix");
  const int64_t m = x.rows();
  const float* xp = x.as<const float>();
  float* yp = y.as<float>();
  const WeightMatrix& part = w.parts[0];
  switch (kernels::ChooseFp8GemmPath(g.sm, part, m)) {
    case Fp8GemmPath::kGemv:
      return Gemv(xp, m, part, w.bias, yp, g.stream);
    case Fp8GemmPath::kW8A8:
      if (W8A8(g, xp, m, part, w.bias, yp)) return;
      break;  // no cuBLASLt algorithm for it: widen
    case Fp8GemmPath::kWidenBf16:
      break;
  }
  WidenBf16(g, xp, m, part, w.bias, yp);
}

}  // namespace pdserve::cuda
