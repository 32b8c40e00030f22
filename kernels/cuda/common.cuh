// What every op family of the CUDA backend shares: error checks, launch
// sizes, and device scratch whose size is fixed before a step runs.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace pdserve::cuda {

// A failed CUDA call aborts with its error: a device in an unknown state
// must not produce tokens.
inline void Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "pdserve cuda backend: %s: %s\n", what, cudaGetErrorString(err));
  std::abort();
}

inline void Check(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "pdserve cuda backend: %s: cuBLAS status %d\n", what,
               static_cast<int>(status));
  std::abort();
}

inline constexpr int kThreads = 256;

inline unsigned Blocks(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// Device scratch reused from call to call. Reserve sizes it before steps
// run (stream-ordered, so no growth waits for the device). A captured CUDA
// graph keeps the addresses it was captured with, so a buffer is never
// freed while the backend lives: growing retires the old one (kept until
// Release) and, inside a capture, allocates with cudaMalloc under the
// relaxed capture mode (an allocation outside the graph, which replays
// then read; a stream-ordered allocation would become a graph node).
// Growth in Get rounds up to a power of two, so the retired buffers never
// add up to more than the live one.
class Workspace {
 public:
  explicit Workspace(const char* name) : name_(name) {}
  void Reserve(size_t bytes, cudaStream_t stream) {
    if (bytes > bytes_) Grow(bytes, stream);
  }
  template <typename T>
  T* Get(int64_t elems, cudaStream_t stream) {
    const size_t bytes = static_cast<size_t>(elems) * sizeof(T);
    if (bytes > bytes_) {
      size_t rounded = 256;
      while (rounded < bytes) rounded *= 2;
      Grow(rounded, stream);
    }
    return static_cast<T*>(data_);
  }
  // After the stream is idle and every graph captured on it is destroyed.
  void Release() {
    for (void* p : retired_) cudaFree(p);
    retired_.clear();
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void Grow(size_t bytes, cudaStream_t stream) {
    cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    Check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
    void* grown = nullptr;
    if (capturing == cudaStreamCaptureStatusNone) {
      Check(cudaMallocAsync(&grown, bytes, stream), name_);
    } else {
      cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
      Check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
      const cudaError_t allocated = cudaMalloc(&grown, bytes);
      Check(cudaThreadExchangeStreamCaptureMode(&mode), "cudaThreadExchangeStreamCaptureMode");
      Check(allocated, name_);
    }
    if (data_ != nullptr) retired_.push_back(data_);
    data_ = grown;
    bytes_ = bytes;
  }

  const char* name_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::vector<void*> retired_;  // earlier buffers, which captured graphs may still use
};

}  // namespace pdserve::cuda
