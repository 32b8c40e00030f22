#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "kernels/cuda/roofline.h"

namespace pdserve::cuda {
namespace {

constexpr int kRepetitions = 10;

// Best time in seconds of kRepetitions runs of `body` on `stream`.
template <typename Body>
double BestSeconds(cudaStream_t stream, Body&& body) {
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  body();  // warm-up
  double best = 1e30;
  for (int i = 0; i < kRepetitions; ++i) {
    cudaEventRecord(start, stream);
    body();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    best = std::min(best, ms / 1e3);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return best;
}

__global__ void FillKernel(float* p, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = 1.0f / static_cast<float>(1 + i % 1024);
}

__global__ void FillBf16Kernel(__nv_bfloat16* p, size_t n) {
  const size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
  if (i < n) p[i] = __float2bfloat16(1.0f / static_cast<float>(1 + i % 1024));
}

}  // namespace

Roofline MeasureRoofline(size_t copy_bytes, int gemm_n) {
  Roofline r;
  cudaStream_t stream;
  if (cudaStreamCreate(&stream) != cudaSuccess) {
    r.error = cudaGetErrorString(cudaGetLastError());
    return r;
  }
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, copy_bytes) == cudaSuccess && cudaMalloc(&b, copy_bytes) == cudaSuccess) {
    const double s = BestSeconds(
        stream, [&] { cudaMemcpyAsync(b, a, copy_bytes, cudaMemcpyDeviceToDevice, stream); });
    r.copy_gbytes_per_s = 2.0 * static_cast<double>(copy_bytes) / s / 1e9;
  } else {
    r.error = "copy buffers: " + std::string(cudaGetErrorString(cudaGetLastError()));
  }
  cudaFree(a);
  cudaFree(b);

  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
    r.error = "cublasCreate failed";
    cudaStreamDestroy(stream);
    return r;
  }
  cublasSetStream(handle, stream);
  const size_t n = static_cast<size_t>(gemm_n);
  const double flops = 2.0 * n * n * n;
  float *x = nullptr, *y = nullptr, *z = nullptr;
  if (cudaMalloc(&x, n * n * 4) == cudaSuccess && cudaMalloc(&y, n * n * 4) == cudaSuccess &&
      cudaMalloc(&z, n * n * 4) == cudaSuccess) {
    const unsigned blocks = static_cast<unsigned>((n * n + 255) / 256);
    FillKernel<<<blocks, 256, 0, stream>>>(x, n * n);
    FillKernel<<<blocks, 256, 0, stream>>>(y, n * n);
    const float one = 1.0f, zero = 0.0f;
    cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH);
    const double s = BestSeconds(stream, [&] {
      cublasSgemm(handle, CUBLAS_OP_N, CUBLAS_OP_N, gemm_n, gemm_n, gemm_n, &one, x, gemm_n, y,
                  gemm_n, &zero, z, gemm_n);
    });
    r.fp32_tflops = flops / s / 1e12;

    // bf16 inputs in the first halves of x and y, fp32 output in z.
    auto* xb = reinterpret_cast<__nv_bfloat16*>(x);
    auto* yb = reinterpret_cast<__nv_bfloat16*>(y);
    FillBf16Kernel<<<blocks, 256, 0, stream>>>(xb, n * n);
    FillBf16Kernel<<<blocks, 256, 0, stream>>>(yb, n * n);
    cublasSetMathMode(handle, CUBLAS_DEFAULT_MATH);
    const double sb = BestSeconds(stream, [&] {
      cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, gemm_n, gemm_n, gemm_n, &one, xb, CUDA_R_16BF,
                   gemm_n, yb, CUDA_R_16BF, gemm_n, &zero, z, CUDA_R_32F, gemm_n,
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    });
    r.bf16_tflops = flops / sb / 1e12;
  } else {
    r.error = "GEMM buffers: " + std::string(cudaGetErrorString(cudaGetLastError()));
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess && r.error.empty())
    r.error = cudaGetErrorString(e);
  cudaFree(x);
  cudaFree(y);
  cudaFree(z);
  cublasDestroy(handle);
  cudaStreamDestroy(stream);
  return r;
}

}  // namespace pdserve::cuda
