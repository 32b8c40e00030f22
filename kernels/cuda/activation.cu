// Element-wise activations and row gathers (kernels/cuda/ops.h): SwiGLU and
// GeLU-tanh GLU over the two halves of a gate|up product, the residual add,
// scaling and soft-capping in place, and the gather behind the embedding
// lookup (from an fp32, bf16 or fp16 table) and the logits rows.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/cuda/ops.h"
#include "kernels/op_check.h"

namespace pdserve::cuda {
namespace {

using kernels::RowLayout;

__global__ void SwiGluKernel(const float* gate, RowLayout gl, const float* up, RowLayout ul,
                             float* out, RowLayout ol, int64_t rows, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, c = i % n;
  const float g = gate[gl.offset(r) + c];
  out[ol.offset(r) + c] = g / (1.0f + expf(-g)) * up[ul.offset(r) + c];
}

__global__ void GeluTanhGluKernel(const float* gate, RowLayout gl, const float* up, RowLayout ul,
                                  float* out, RowLayout ol, int64_t rows, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= rows * n) return;
  const int64_t r = i / n, c = i % n;
  const float g = gate[gl.offset(r) + c];
  const float k = 0.7978845608028654f;  // sqrt(2 / pi)
  out[ol.offset(r) + c] =
      0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g))) * up[ul.offset(r) + c];
}

__global__ void ScaleKernel(float* x, float factor, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] *= factor;
}

__global__ void SoftCapKernel(float* x, float cap, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

__global__ void AddKernel(float* x, const float* y, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) x[i] += y[i];
}

__device__ __forceinline__ float Widened(float v) { return v; }
__device__ __forceinline__ float Widened(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float Widened(__half v) { return __half2float(v); }

// out row r = x row rows[r], each element widened exactly to fp32.
template <typename T>
__global__ void GatherKernel(const T* x, RowLayout xl, const int32_t* rows, int64_t count,
                             int64_t dim, float* out, RowLayout ol) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= count * dim) return;
  const int64_t r = i / dim, c = i % dim;
  out[ol.offset(r) + c] = Widened(x[xl.offset(rows[r]) + c]);
}

}  // namespace

void SwiGlu(const Tensor& gate, const Tensor& up, const Tensor& out, cudaStream_t stream) {
  kernels::CheckF32(gate, "SwiGlu");
  kernels::CheckF32(up, "SwiGlu");
  kernels::CheckF32(out, "SwiGlu");
  const int64_t rows = out.rows(), n = out.row_size();
  kernels::OpCheck(
      gate.row_size() == n && up.row_size() == n && gate.rows() == rows && up.rows() == rows,
      "SwiGlu", "takes gate, up and out of one shape");
  if (rows * n == 0) return;
  SwiGluKernel<<<Blocks(rows * n), kThreads, 0, stream>>>(
      gate.as<const float>(), gate.row_layout(), up.as<const float>(), up.row_layout(),
      out.as<float>(), out.row_layout(), rows, n);
  Check(cudaGetLastError(), "SwiGlu");
}

void GeluTanhGlu(const Tensor& gate, const Tensor& up, const Tensor& out, cudaStream_t stream) {
  kernels::CheckF32(gate, "GeluTanhGlu");
  kernels::CheckF32(up, "GeluTanhGlu");
  kernels::CheckF32(out, "GeluTanhGlu");
  const int64_t rows = out.rows(), n = out.row_size();
  kernels::OpCheck(
      gate.row_size() == n && up.row_size() == n && gate.rows() == rows && up.rows() == rows,
      "GeluTanhGlu", "takes gate, up and out of one shape");
  if (rows * n == 0) return;
  GeluTanhGluKernel<<<Blocks(rows * n), kThreads, 0, stream>>>(
      gate.as<const float>(), gate.row_layout(), up.as<const float>(), up.row_layout(),
      out.as<float>(), out.row_layout(), rows, n);
  Check(cudaGetLastError(), "GeluTanhGlu");
}

void Scale(const Tensor& x, float factor, cudaStream_t stream) {
  kernels::CheckPackedF32(x, "Scale");
  const int64_t n = x.numel();
  if (n == 0) return;
  ScaleKernel<<<Blocks(n), kThreads, 0, stream>>>(x.as<float>(), factor, n);
  Check(cudaGetLastError(), "Scale");
}

void SoftCap(const Tensor& x, float cap, cudaStream_t stream) {
  kernels::CheckPackedF32(x, "SoftCap");
  const int64_t n = x.numel();
  if (n == 0) return;
  SoftCapKernel<<<Blocks(n), kThreads, 0, stream>>>(x.as<float>(), cap, n);
  Check(cudaGetLastError(), "SoftCap");
}

void Add(const Tensor& x, const Tensor& y, cudaStream_t stream) {
  kernels::CheckPackedF32(x, "Add");
  kernels::CheckPackedF32(y, "Add");
  kernels::OpCheck(x.numel() == y.numel(), "Add", "takes x and y of one size");
  const int64_t n = x.numel();
  if (n == 0) return;
  AddKernel<<<Blocks(n), kThreads, 0, stream>>>(x.as<float>(), y.as<const float>(), n);
  Check(cudaGetLastError(), "Add");
}

void GatherRows(const Tensor& x, const int32_t* rows, const Tensor& out, cudaStream_t stream) {
  kernels::CheckF32(x, "GatherRows");
  kernels::CheckF32(out, "GatherRows");
  const int64_t count = out.rows(), dim = out.row_size();
  kernels::OpCheck(x.row_size() == dim, "GatherRows", "takes x and out of one row size");
  if (count * dim == 0) return;
  GatherKernel<<<Blocks(count * dim), kThreads, 0, stream>>>(
      x.as<const float>(), x.row_layout(), rows, count, dim, out.as<float>(), out.row_layout());
  Check(cudaGetLastError(), "GatherRows");
}

void Embedding(const Tensor& table, const int32_t* ids, const Tensor& out, cudaStream_t stream) {
  if (table.dtype == DType::kF32) return GatherRows(table, ids, out, stream);
  kernels::OpCheck(table.dtype == DType::kBF16 || table.dtype == DType::kF16, "Embedding",
                   "takes an fp32, bf16 or fp16 table");
  kernels::CheckF32(out, "Embedding");
  const int64_t count = out.rows(), dim = out.row_size();
  kernels::OpCheck(table.row_size() == dim, "Embedding", "takes table and out of one row size");
  if (count * dim == 0) return;
  const RowLayout tl = table.row_layout(), ol = out.row_layout();
  if (table.dtype == DType::kBF16) {
    GatherKernel<<<Blocks(count * dim), kThreads, 0, stream>>>(
        table.as<const __nv_bfloat16>(), tl, ids, count, dim, out.as<float>(), ol);
  } else {
    GatherKernel<<<Blocks(count * dim), kThreads, 0, stream>>>(table.as<const __half>(), tl, ids,
                                                               count, dim, out.as<float>(), ol);
  }
  Check(cudaGetLastError(), "Embedding");
}

}  // namespace pdserve::cuda
