// The device-local communicator: several tensor-parallel ranks on one GPU,
// each a CudaBackend with its own stream (NCCL refuses two ranks on one
// device, and most test machines have one GPU). A real implementation, not
// a mock: the ranks read each other's buffers in device memory, publishing
// their addresses to each other on the host, and wait for each other on the
// device with a barrier kernel (a counter per rank in device memory; the
// .cu file says how and why it cannot starve a rank).
//
// Contract: kernels/communicator.h, sums in rank order. Collectives are
// queued on each rank's stream and return without waiting for the device.
// Capturable: nothing inside what a graph holds waits on the host, and no
// parameter of its kernels changes between replays (the addresses a
// capture exchanged are the static buffers the ranks' graphs use). Abort
// releases the ranks' streams spinning in a barrier, replays included.
#pragma once

#include <memory>
#include <vector>

#include "kernels/communicator.h"
#include "kernels/cuda/cuda_backend.h"

namespace pdserve::kernels {

// One communicator per backend of `ranks` (index = rank, at most 8), all on
// one device; empty when they are not (the caller names the devices).
std::vector<std::unique_ptr<Communicator>> CreateDeviceLocalGroup(
    const std::vector<CudaBackend*>& ranks);

}  // namespace pdserve::kernels
