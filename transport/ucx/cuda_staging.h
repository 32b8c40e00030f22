// Pinned host mirrors of device KV pools, for UCX builds without CUDA memory
// support. Compiled only with PDSERVE_WITH_CUDA. Internal to transport/ucx.
#pragma once

#include <cstddef>

#include "common/status.h"

namespace pdserve::ucx_detail {

// Pinned (page-locked) host memory of `bytes`, or an error naming the CUDA failure.
StatusOr<void*> AllocPinned(size_t bytes);
void FreePinned(void* p);
// Synchronous copies (device-to-host, host-to-device).
Status CopyDeviceToHost(void* dst, const void* src, size_t bytes);
Status CopyHostToDevice(void* dst, const void* src, size_t bytes);

}  // namespace pdserve::ucx_detail
