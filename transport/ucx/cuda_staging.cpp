#include "transport/ucx/cuda_staging.h"

#include <cuda_runtime.h>

#include <string>

namespace pdserve::ucx_detail {
namespace {

Status CudaError(const char* what, cudaError_t e) {
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

}  // namespace

StatusOr<void*> AllocPinned(size_t bytes) {
  void* p = nullptr;
  cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) return CudaError("cudaHostAlloc of the KV staging mirror", e);
  return p;
}

void FreePinned(void* p) {
  if (p != nullptr) cudaFreeHost(p);
}

Status CopyDeviceToHost(void* dst, const void* src, size_t bytes) {
  cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost);
  if (e != cudaSuccess) return CudaError("staging KV blocks device-to-host", e);
  return Status::Ok();
}

Status CopyHostToDevice(void* dst, const void* src, size_t bytes) {
  cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  if (e != cudaSuccess) return CudaError("copying staged KV blocks host-to-device", e);
  return Status::Ok();
}

}  // namespace pdserve::ucx_detail
