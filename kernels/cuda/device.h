// CUDA device discovery, callable from plain C++ (no CUDA headers needed).
#pragma once

#include <string>

namespace pdserve::cuda {

// Number of usable CUDA devices; 0 when there is no driver or no device.
int DeviceCount();

// False when the driver loads kernels lazily, at their first launch (CUDA's
// default; CUDA_MODULE_LOADING=EAGER loads them all when the process first
// calls CUDA), or cannot say.
bool EagerKernelLoading();

// "NVIDIA H100 80GB HBM3 (sm_90, 79.1 GiB)" for device `index`, or the error.
std::string DeviceDescription(int index);

}  // namespace pdserve::cuda
