#include "transport/ucx/cuda_staging.h"

#include <cuda_runtime.h>

#include <string>
#include <vector>

namespace pdserve::ucx_detail {
namespace {

Status CudaError(const char* what, cudaError_t e) {
  return Status::Internal(std::string(what) + ": " + cudaGetErrorString(e));
}

class CudaCopier final : public StagingCopier {
 public:
  explicit CudaCopier(int device) : device_(device) {}
  ~CudaCopier() override {
    cudaSetDevice(device_);
    Drain();
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
    if (to_host_ != nullptr) cudaStreamDestroy(to_host_);
    if (to_device_ != nullptr) cudaStreamDestroy(to_device_);
  }

  Status Open() {
    cudaError_t e = cudaSetDevice(device_);
    if (e != cudaSuccess) return CudaError("cudaSetDevice for KV staging", e);
    e = cudaStreamCreateWithFlags(&to_host_, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&to_device_, cudaStreamNonBlocking);
    if (e != cudaSuccess) return CudaError("cudaStreamCreate for KV staging", e);
    return Status::Ok();
  }

  std::string_view name() const override { return "cuda"; }

  StatusOr<void*> AllocBounce(size_t bytes) override {
    cudaSetDevice(device_);
    void* p = nullptr;
    cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) return CudaError("cudaHostAlloc of the KV staging buffers", e);
    return p;
  }
  void FreeBounce(void* p) override {
    if (p != nullptr) cudaFreeHost(p);
  }

  Status Init(size_t slots) override {
    cudaSetDevice(device_);
    while (events_.size() < slots) {
      cudaEvent_t ev = nullptr;
      cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
      if (e != cudaSuccess) return CudaError("cudaEventCreate for KV staging", e);
      events_.push_back(ev);
    }
    return Status::Ok();
  }

  Status Start(size_t slot, const CopySegment* segs, size_t n, bool to_pool) override {
    cudaSetDevice(device_);
    cudaStream_t stream = to_pool ? to_device_ : to_host_;
    const cudaMemcpyKind kind = to_pool ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
    for (size_t i = 0; i < n; ++i) {
      cudaError_t e = cudaMemcpyAsync(segs[i].dst, segs[i].src, segs[i].bytes, kind, stream);
      if (e != cudaSuccess) {
        return CudaError(to_pool ? "copying staged KV blocks host-to-device"
                                 : "staging KV blocks device-to-host",
                         e);
      }
    }
    cudaError_t e = cudaEventRecord(events_.at(slot), stream);
    if (e != cudaSuccess) return CudaError("cudaEventRecord for KV staging", e);
    return Status::Ok();
  }

  bool Poll(size_t slot, Status* status) override {
    cudaError_t e = cudaEventQuery(events_.at(slot));
    if (e == cudaErrorNotReady) return false;
    *status = e == cudaSuccess ? Status::Ok() : CudaError("KV staging copy", e);
    return true;
  }

  bool asynchronous() const override { return true; }

  void Drain() override {
    if (to_host_ != nullptr) cudaStreamSynchronize(to_host_);
    if (to_device_ != nullptr) cudaStreamSynchronize(to_device_);
  }

 private:
  int device_;
  cudaStream_t to_host_ = nullptr;
  cudaStream_t to_device_ = nullptr;
  std::vector<cudaEvent_t> events_;
};

}  // namespace

StatusOr<std::unique_ptr<StagingCopier>> MakeCudaCopier(int device) {
  auto c = std::make_unique<CudaCopier>(device);
  PDSERVE_RETURN_IF_ERROR(c->Open());
  return std::unique_ptr<StagingCopier>(std::move(c));
}

StatusOr<int> DeviceOfPointer(const void* p) {
  cudaPointerAttributes attr{};
  cudaError_t e = cudaPointerGetAttributes(&attr, p);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state of this call
    return CudaError("cudaPointerGetAttributes of the KV pool", e);
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return Status::InvalidArgument("the KV pool is marked kCuda but is not device memory");
  }
  return attr.device;
}

}  // namespace pdserve::ucx_detail
