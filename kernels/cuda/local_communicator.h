// The device-local communicator: several tensor-parallel ranks on one GPU,
// each a CudaBackend with its own stream (NCCL refuses two ranks on one
// device, and most test machines have one GPU). A real implementation, not
// a mock: the ranks read each other's buffers in device memory, ordered on
// their streams by events, with a host barrier where a rank must know the
// others' buffers and events.
//
// Contract: kernels/communicator.h. Collectives are queued on each rank's
// stream and return without waiting for the device; they are not
// capturable in a CUDA graph (the host barriers are not part of a graph),
// so a tensor-parallel group on this communicator runs eagerly.
#pragma once

#include <memory>
#include <vector>

#include "kernels/communicator.h"
#include "kernels/cuda/cuda_backend.h"

namespace pdserve::kernels {

// One communicator per backend of `ranks` (index = rank), all on one
// device; empty when they are not (the caller names the devices).
std::vector<std::unique_ptr<Communicator>> CreateDeviceLocalGroup(
    const std::vector<CudaBackend*>& ranks);

}  // namespace pdserve::kernels
