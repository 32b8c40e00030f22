// The CUDA StagingCopier (see staging_copier.h): device pools staged through
// pinned host bounce buffers, with cudaMemcpyAsync on two streams (one per
// direction) and one event per bounce slot. Compiled only with
// PDSERVE_WITH_CUDA. Internal to transport/ucx.
#pragma once

#include <memory>

#include "common/status.h"
#include "transport/ucx/staging_copier.h"

namespace pdserve::ucx_detail {

// `device`: the CUDA device of the pool (the progress thread selects it before
// every call into CUDA).
StatusOr<std::unique_ptr<StagingCopier>> MakeCudaCopier(int device);

// The CUDA device that holds `p`, or an error when `p` is not device memory.
StatusOr<int> DeviceOfPointer(const void* p);

}  // namespace pdserve::ucx_detail
