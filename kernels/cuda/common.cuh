// What every op family of the CUDA backend shares: error checks, launch
// sizes, and device scratch whose size is fixed before a step runs.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

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

// Set when a Workspace would have had to grow while this thread's stream
// was being captured (captures are thread-local: cudaStreamCaptureModeThreadLocal);
// CudaBackend::CaptureGraph clears it before a capture and drops the graph if
// it is set after, so the step runs eagerly instead.
inline thread_local bool workspace_outgrown_in_capture = false;

// Device scratch reused from call to call. Reserve sizes it before steps
// run (stream-ordered, so no growth waits for the device); Get never
// allocates while the stream is being captured into a graph, where an
// allocation would not be replayed: a capture that needs more than was
// reserved is marked failed (workspace_outgrown_in_capture) and gets the
// buffer as it is, which the discarded graph never uses.
class Workspace {
 public:
  explicit Workspace(const char* name) : name_(name) {}
  void Reserve(size_t bytes, cudaStream_t stream) {
    if (bytes <= bytes_) return;
    if (data_ != nullptr) Check(cudaFreeAsync(data_, stream), "cudaFreeAsync");
    Check(cudaMallocAsync(&data_, bytes, stream), "cudaMallocAsync");
    bytes_ = bytes;
  }
  template <typename T>
  T* Get(int64_t elems, cudaStream_t stream) {
    const size_t bytes = static_cast<size_t>(elems) * sizeof(T);
    if (bytes > bytes_) {
      cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
      Check(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing");
      if (capturing != cudaStreamCaptureStatusNone) {
        std::fprintf(stderr,
                     "pdserve cuda backend: %s scratch of %zu bytes outgrew %zu in a graph "
                     "capture; the capture is dropped\n",
                     name_, bytes, bytes_);
        workspace_outgrown_in_capture = true;
        return static_cast<T*>(data_);
      }
      Reserve(bytes, stream);
    }
    return static_cast<T*>(data_);
  }
  // After the stream is idle.
  void Release() {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  const char* name_;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace pdserve::cuda
