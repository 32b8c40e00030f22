#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdio>

#include "kernels/cuda/device.h"

namespace pdserve::cuda {

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

bool EagerKernelLoading() {
  // The driver's own answer, through the runtime (no link to libcuda).
  using GetLoadingMode = CUresult (*)(CUmoduleLoadingMode*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault,
                                       &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return false;
  }
  CUmoduleLoadingMode mode{};
  return reinterpret_cast<GetLoadingMode>(fn)(&mode) == CUDA_SUCCESS &&
         mode == CU_MODULE_EAGER_LOADING;
}

std::string DeviceDescription(int index) {
  cudaDeviceProp prop{};
  cudaError_t err = cudaGetDeviceProperties(&prop, index);
  if (err != cudaSuccess) return cudaGetErrorString(err);
  char buf[256];
  std::snprintf(buf, sizeof(buf), "%s (sm_%d%d, %.1f GiB)", prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

}  // namespace pdserve::cuda
