// RMSNorm, plain and with the residual add fused in (kernels/cuda/ops.h):
// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * weight, per row of the last
// dimension; rows are addressed through RowLayout, so the per-head q/k norm
// works on views of the packed q|k|v product.
#include <initializer_list>
#include <utility>

#include "kernels/cuda/ops.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

using kernels::RowLayout;

// The sum of `v` over the block's threads (at most kThreads), returned to
// every thread.
__device__ float BlockSum(float v) {
  __shared__ float warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[0] = v;
  }
  __syncthreads();
  return warp_sums[0];
}

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
  const float scale = rsqrtf(BlockSum(sum) / dim + eps);
  for (int i = threadIdx.x; i < dim; i += blockDim.x) out_row[i] = row[i] * scale * weight[i];
}

// The same, for rows of whole float4s (dim % 4 == 0, 16-byte aligned
// rows): each thread loads its kVecs float4s of x (and the residual) before
// it uses any, so a row costs about one memory round trip instead of one
// per loop step; the loop above waits on every load in turn, since its
// store to x may alias the residual it reads next (16 us a 4,096-wide row
// on an H100, a microsecond or two here). Same aliasing rules.
template <bool kAddResidual, int kVecs>
__global__ void RmsNormVecKernel(float* x, RowLayout xl, const float* residual, RowLayout rl,
                                 const float* __restrict__ weight, float* out, RowLayout ol,
                                 int dim, float eps) {
  auto* row = reinterpret_cast<float4*>(x + xl.offset(blockIdx.x));
  auto* out_row = reinterpret_cast<float4*>(out + ol.offset(blockIdx.x));
  const int n4 = dim / 4;
  float4 v[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    v[k] = i < n4 ? row[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  if constexpr (kAddResidual) {
    const auto* res = reinterpret_cast<const float4*>(residual + rl.offset(blockIdx.x));
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int i = threadIdx.x + k * blockDim.x;
      if (i < n4) {
        const float4 r = res[i];
        v[k].x += r.x;
        v[k].y += r.y;
        v[k].z += r.z;
        v[k].w += r.w;
      }
    }
  }
  float sum = 0.f;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    sum += v[k].x * v[k].x + v[k].y * v[k].y + v[k].z * v[k].z + v[k].w * v[k].w;
    const int i = threadIdx.x + k * blockDim.x;
    if (kAddResidual && i < n4) row[i] = v[k];
  }
  const float scale = rsqrtf(BlockSum(sum) / dim + eps);
  const auto* w4 = reinterpret_cast<const float4*>(weight);
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int i = threadIdx.x + k * blockDim.x;
    if (i < n4) {
      const float4 w = w4[i];
      out_row[i] = make_float4(v[k].x * scale * w.x, v[k].y * scale * w.y, v[k].z * scale * w.z,
                               v[k].w * scale * w.w);
    }
  }
}

// Float4s per thread of RmsNormVecKernel for rows of `dim`, or 0 where it
// does not apply (rows past 8 x 4 x kThreads elements, or not whole aligned
// float4s).
int NormVecs(int dim, std::initializer_list<std::pair<const void*, RowLayout>> rows) {
  if (dim % 4 != 0 || dim > 8 * 4 * kThreads) return 0;
  for (const auto& [base, layout] : rows) {
    if (base == nullptr) continue;
    if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || layout.token_stride % 4 != 0 ||
        (layout.rows_per_token != 1 && layout.row_size % 4 != 0)) {
      return 0;
    }
  }
  const int need = (dim / 4 + kThreads - 1) / kThreads;
  return need <= 1 ? 1 : need <= 2 ? 2 : need <= 4 ? 4 : 8;
}

template <bool kAddResidual>
bool LaunchNormVec(int vecs, unsigned rows, float* x, RowLayout xl, const float* residual,
                   RowLayout rl, const float* weight, float* out, RowLayout ol, int dim, float eps,
                   cudaStream_t stream) {
  switch (vecs) {
    case 1:
      RmsNormVecKernel<kAddResidual, 1>
          <<<rows, kThreads, 0, stream>>>(x, xl, residual, rl, weight, out, ol, dim, eps);
      return true;
    case 2:
      RmsNormVecKernel<kAddResidual, 2>
          <<<rows, kThreads, 0, stream>>>(x, xl, residual, rl, weight, out, ol, dim, eps);
      return true;
    case 4:
      RmsNormVecKernel<kAddResidual, 4>
          <<<rows, kThreads, 0, stream>>>(x, xl, residual, rl, weight, out, ol, dim, eps);
      return true;
    case 8:
      RmsNormVecKernel<kAddResidual, 8>
          <<<rows, kThreads, 0, stream>>>(x, xl, residual, rl, weight, out, ol, dim, eps);
      return true;
    default:
      return false;
  }
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
    // The plain kernels never write x.
    const int vecs = NormVecs(
        dim, {{x.data, x.row_layout()}, {out.data, out.row_layout()}, {weight.data, RowLayout{}}});
    if (!LaunchNormVec<false>(vecs, static_cast<unsigned>(rows), x.as<float>(), x.row_layout(),
                              nullptr, RowLayout{}, weight.as<const float>(), out.as<float>(),
                              out.row_layout(), dim, eps, stream)) {
      RmsNormKernel<false><<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(
          x.as<float>(), x.row_layout(), nullptr, RowLayout{}, weight.as<const float>(),
          out.as<float>(), out.row_layout(), dim, eps);
    }
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
  const int dim = static_cast<int>(x.row_size());
  const int vecs = NormVecs(dim, {{x.data, x.row_layout()},
                                  {y.data, y.row_layout()},
                                  {out.data, out.row_layout()},
                                  {weight.data, RowLayout{}}});
  if (!LaunchNormVec<true>(vecs, static_cast<unsigned>(x.rows()), x.as<float>(), x.row_layout(),
                           y.as<const float>(), y.row_layout(), weight.as<const float>(),
                           out.as<float>(), out.row_layout(), dim, eps, stream)) {
    RmsNormKernel<true><<<static_cast<unsigned>(x.rows()), kThreads, 0, stream>>>(
        x.as<float>(), x.row_layout(), y.as<const float>(), y.row_layout(),
        weight.as<const float>(), out.as<float>(), out.row_layout(), dim, eps);
  }
  Check(cudaGetLastError(), "AddRmsNorm");
}

}  // namespace pdserve::cuda
