// Sampling on the device (kernels/cuda/ops.h): greedy, so that only token
// ids leave the device. Seeded sampling keyed by (seed, output index) is the
// host sampler's today (engine/sampler.h); its counter-based draw is what a
// device kernel would compute.
#include "kernels/cuda/ops.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

// One block per row. Each thread keeps its best (value, column) with NaN as
// -inf; the block then reduces pairs, the larger value and on a tie the
// lower column winning, so the result is the CPU's whatever the schedule.
constexpr int kArgMaxThreads = 1024;
__device__ inline bool ArgMaxBetter(float v, int64_t i, float best_v, int64_t best_i) {
  return v > best_v || (v == best_v && i < best_i);
}
__global__ void ArgMaxRowsKernel(const float* x, int64_t row_stride, int64_t n, int32_t* out) {
  const float* row = x + static_cast<int64_t>(blockIdx.x) * row_stride;
  float best_v = -INFINITY;
  int64_t best_i = n;  // no column yet: loses every tie against a real one
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = isnan(row[i]) ? -INFINITY : row[i];
    if (ArgMaxBetter(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, best_v, offset);
    const int64_t i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (ArgMaxBetter(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  __shared__ float warp_v[kArgMaxThreads / 32];
  __shared__ int64_t warp_i[kArgMaxThreads / 32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    warp_v[warp] = best_v;
    warp_i[warp] = best_i;
  }
  __syncthreads();
  if (warp != 0) return;
  const int warps = blockDim.x / 32;
  best_v = lane < warps ? warp_v[lane] : -INFINITY;
  best_i = lane < warps ? warp_i[lane] : n;
  for (int offset = 16; offset > 0; offset /= 2) {
    const float v = __shfl_xor_sync(0xffffffffu, best_v, offset);
    const int64_t i = __shfl_xor_sync(0xffffffffu, best_i, offset);
    if (ArgMaxBetter(v, i, best_v, best_i)) {
      best_v = v;
      best_i = i;
    }
  }
  // best_i is n only for an empty row.
  if (lane == 0) out[blockIdx.x] = static_cast<int32_t>(best_i < n ? best_i : 0);
}

// x[row][token] += delta, one thread an adjustment (no two share an element).
__global__ void AdjustLogitsKernel(float* x, int64_t row_stride,
                                   const kernels::LogitAdjustment* adjustments, int64_t count) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count) return;
  const kernels::LogitAdjustment a = adjustments[i];
  x[a.row * row_stride + a.token] += a.delta;
}

}  // namespace

void AdjustLogits(const Tensor& x, const kernels::LogitAdjustment* adjustments, int64_t count,
                  cudaStream_t stream) {
  kernels::CheckF32(x, "AdjustLogits");
  kernels::OpCheck(x.rank == 2, "AdjustLogits", "takes x as [rows, n]");
  if (count == 0) return;
  AdjustLogitsKernel<<<static_cast<unsigned>((count + kThreads - 1) / kThreads), kThreads, 0,
                       stream>>>(x.as<float>(), x.stride[0], adjustments, count);
  Check(cudaGetLastError(), "AdjustLogits");
}

void ArgMaxRows(const Tensor& x, int32_t* out, cudaStream_t stream) {
  kernels::CheckF32(x, "ArgMaxRows");
  kernels::OpCheck(x.rank == 2, "ArgMaxRows", "takes x as [rows, n]");
  const int64_t rows = x.rows();
  if (rows == 0) return;
  ArgMaxRowsKernel<<<static_cast<unsigned>(rows), kArgMaxThreads, 0, stream>>>(
      x.as<const float>(), x.stride[0], x.row_size(), out);
  Check(cudaGetLastError(), "ArgMaxRows");
}

}  // namespace pdserve::cuda
