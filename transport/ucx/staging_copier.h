// Copies between a KV pool and the UCX backend's bounce buffers (staged
// transfers, see ucx_transfer.h). Internal to transport/ucx.
//
// One implementation per pool memory type: host pools copy with memcpy (the
// copy is done when Start returns), device pools with cudaMemcpyAsync on a
// stream and an event per bounce slot (cuda_staging.cpp, CUDA builds only).
// Both are driven by the same pipeline code, which is why staging mode
// "always" on a host pool exercises the device path's pipeline on a CPU.
#pragma once

#include <cstddef>
#include <memory>
#include <string_view>

#include "common/status.h"

namespace pdserve::ucx_detail {

struct CopySegment {
  void* dst = nullptr;
  const void* src = nullptr;
  size_t bytes = 0;
};

class StagingCopier {
 public:
  virtual ~StagingCopier() = default;
  virtual std::string_view name() const = 0;
  // Bounce-buffer memory: pinned host memory for device pools, aligned host
  // memory otherwise.
  virtual StatusOr<void*> AllocBounce(size_t bytes) = 0;
  virtual void FreeBounce(void* p) = 0;
  // Prepares per-slot state (events) for `slots` bounce slots.
  virtual Status Init(size_t slots) = 0;
  // Starts copying `n` segments for bounce slot `slot`; `to_pool`: bounce ->
  // pool (receiver), else pool -> bounce (writer). A slot has at most one copy
  // in flight.
  virtual Status Start(size_t slot, const CopySegment* segs, size_t n, bool to_pool) = 0;
  // True once the slot's copy has finished; *status then says how.
  virtual bool Poll(size_t slot, Status* status) = 0;
  // Whether copies finish after Start returns (the progress thread then polls).
  virtual bool asynchronous() const = 0;
  // Waits for every copy in flight (before the bounce buffers are freed).
  virtual void Drain() = 0;
};

std::unique_ptr<StagingCopier> MakeHostCopier();

}  // namespace pdserve::ucx_detail
