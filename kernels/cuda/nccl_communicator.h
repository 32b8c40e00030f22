// The NCCL communicator: one tensor-parallel rank per GPU of this process,
// all of the worker's GPUs in one NCCL communicator (ncclCommInitAll), each
// rank's collectives queued on its backend's stream.
//
// Contract: kernels/communicator.h, with two differences. The collectives
// never wait on the host (no barrier, no sync), so they are captured in a
// CUDA graph with the rest of a step (capturable() is true). And NCCL adds
// in its own order (ring or tree), not rank order: every rank still gets
// the same sums (each element is reduced once, then copied to every rank),
// but they may differ from a serial sum in the last bits. Abort returns at
// once and aborts NCCL's communicators on a thread of its own (see the
// source for why), so ranks waiting on the device are released soon after
// it, not by the time it returns.
//
// A rank whose graph is already queued when another rank aborts the group
// replays NCCL kernels of an aborted communicator; the group is of no use
// then and the worker exits, but that path has not run on a GPU.
#pragma once

#include <memory>
#include <vector>

#include "common/status.h"
#include "kernels/communicator.h"
#include "kernels/cuda/cuda_backend.h"

namespace pdserve::kernels {

// One communicator per backend of `ranks` (index = rank), each on a device
// of its own. InvalidArgument when a device repeats (NCCL refuses two
// ranks on one device: kernels/cuda/local_communicator.h is for that);
// Unavailable when NCCL was not built in or its initialisation fails,
// with NCCL's message.
StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclGroup(
    const std::vector<CudaBackend*>& ranks);

}  // namespace pdserve::kernels
