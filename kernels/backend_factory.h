// Picks the compute backend a command runs on.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "common/status.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"

namespace pdserve::kernels {

// "cpu" (with `threads` threads, 0: one per core) or "cuda" / "cuda:N"
// (device N, default 0). InvalidArgument for another name; Unavailable when
// CUDA was not built in or the device does not exist.
StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view device, int threads);

// Turns a --device value into the device a backend is created on: "auto" is
// the first CUDA device when one exists (and CUDA is built in), else "cpu";
// "cuda" is "cuda:0". InvalidArgument naming what exists ("cpu, cuda:0
// (NVIDIA H100 ...)") for a malformed name or a CUDA device that is not
// there, so that a command can refuse it before it starts anything.
StatusOr<std::string> ResolveDevice(std::string_view requested);

// The communicators of a tensor-parallel group of two or more `ranks`
// (index = rank): shared memory between CPU backends, NCCL between CUDA
// backends on distinct devices, device-local between CUDA backends all on
// one device. InvalidArgument naming the devices when they mix the CPU and
// CUDA or repeat some devices but not all; Unavailable for ranks
// sharing a GPU in a process that loads kernels lazily
// (PrepareKernelLoadingFor); NCCL's own errors otherwise.
StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateCommunicators(
    const std::vector<Backend*>& ranks);

// Ranks sharing one GPU wait for each other in spinning kernels
// (kernels/cuda/local_communicator.h), which CUDA's lazy kernel loading can
// deadlock: the first launch of a kernel may wait for the whole device, a
// peer's spinning kernel included. When the comma-separated --devices list
// `devices` names one CUDA device more than once, sets CUDA_MODULE_LOADING
// to EAGER, which the driver reads once, when the process first calls CUDA:
// call it before anything else does. CreateCommunicators refuses such a
// group in a process that loads kernels lazily.
void PrepareKernelLoadingFor(std::string_view devices);

// "cpu" and every CUDA device with its description, comma-separated.
std::string DescribeAvailableDevices();

}  // namespace pdserve::kernels
