#include "kernels/backend_factory.h"

#include <charconv>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/local_communicator.h"
#include "kernels/cuda/nccl_communicator.h"
#endif

namespace pdserve::kernels {
namespace {

int CudaDeviceCount() {
#if PDSERVE_WITH_CUDA
  return cuda::DeviceCount();
#else
  return 0;
#endif
}

// The index of "cuda" (0) or "cuda:N"; nullopt when `device` is not of that form.
std::optional<int> CudaIndex(std::string_view device) {
  if (device.substr(0, 4) != "cuda" || (device.size() > 4 && device[4] != ':')) return std::nullopt;
  if (device.size() == 4) return 0;
  const std::string_view n = device.substr(5);
  int index = 0;
  auto [end, err] = std::from_chars(n.data(), n.data() + n.size(), index);
  if (err != std::errc() || end != n.data() + n.size() || n.empty() || index < 0)
    return std::nullopt;
  return index;
}

}  // namespace

std::string DescribeAvailableDevices() {
  std::string out = "cpu";
#if PDSERVE_WITH_CUDA
  for (int i = 0; i < CudaDeviceCount(); ++i)
    out += ", cuda:" + std::to_string(i) + " (" + cuda::DeviceDescription(i) + ")";
#endif
  return out;
}

StatusOr<std::string> ResolveDevice(std::string_view requested) {
  if (requested == "cpu") return std::string("cpu");
  if (requested == "auto") return std::string(CudaDeviceCount() > 0 ? "cuda:0" : "cpu");
  const std::optional<int> index = CudaIndex(requested);
  if (!index) {
    return Status::InvalidArgument("unknown device '" + std::string(requested) +
                                   "' (expected auto, cpu, cuda or cuda:N)");
  }
#if !PDSERVE_WITH_CUDA
  return Status::InvalidArgument(
      "device '" + std::string(requested) +
      "': this pdserve was built without CUDA; available: " + DescribeAvailableDevices());
#endif
  if (*index >= CudaDeviceCount()) {
    return Status::InvalidArgument("no CUDA device " + std::to_string(*index) +
                                   " on this machine; available: " + DescribeAvailableDevices());
  }
  return "cuda:" + std::to_string(*index);
}

StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view device, int threads) {
  if (device == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(threads));
  const std::optional<int> cuda_index = CudaIndex(device);
  if (!cuda_index) {
    return Status::InvalidArgument("unknown device '" + std::string(device) +
                                   "' (expected cpu, cuda or cuda:N)");
  }
#if PDSERVE_WITH_CUDA
  const int index = *cuda_index;
  auto backend = CudaBackend::Create(index);
  if (!backend) {
    return Status::Unavailable("no CUDA device " + std::to_string(index) + " on this machine");
  }
  return std::unique_ptr<Backend>(std::move(backend));
#else
  return Status::Unavailable("this pdserve was built without CUDA (PDSERVE_CUDA=OFF or no nvcc)");
#endif
}

void PrepareKernelLoadingFor(std::string_view devices) {
  std::set<int> seen;
  size_t at = 0;
  while (at <= devices.size()) {
    const size_t comma = std::min(devices.find(',', at), devices.size());
    const std::optional<int> index = CudaIndex(devices.substr(at, comma - at));
    if (index && !seen.insert(*index).second) {
      setenv("CUDA_MODULE_LOADING", "EAGER", 1);
      return;
    }
    at = comma + 1;
  }
}

StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateCommunicators(
    const std::vector<Backend*>& ranks) {
  std::set<std::string> devices;
  std::string names;
  for (Backend* b : ranks) {
    devices.insert(b->device_name());
    names += (names.empty() ? "" : ",") + b->device_name();
  }
  if (ranks.front()->name() == "cpu") {
    if (devices.size() > 1) {
      return Status::InvalidArgument("tensor-parallel ranks mix the CPU and CUDA (" + names + ")");
    }
    return CreateSharedMemoryGroup(static_cast<int>(ranks.size()));
  }
#if PDSERVE_WITH_CUDA
  std::vector<CudaBackend*> cuda;
  for (Backend* b : ranks) {
    auto* c = dynamic_cast<CudaBackend*>(b);
    if (c == nullptr) {
      return Status::InvalidArgument("tensor-parallel ranks mix the CPU and CUDA (" + names + ")");
    }
    cuda.push_back(c);
  }
  // NCCL refuses two ranks on one device; the device-local communicator
  // sees one device's buffers only.
  if (devices.size() == 1) {
    if (!cuda::EagerKernelLoading()) {
      return Status::Unavailable(
          "tensor-parallel ranks sharing " + *devices.begin() +
          " need CUDA's eager kernel loading (CUDA_MODULE_LOADING=EAGER before the process "
          "first calls CUDA; pdserve sets it when --devices repeats a GPU): with lazy loading a "
          "rank's first launch of a kernel can wait for a peer that waits for it");
    }
    return CreateDeviceLocalGroup(cuda);
  }
  if (devices.size() == ranks.size()) return CreateNcclGroup(cuda);
  return Status::InvalidArgument("tensor-parallel ranks on " + names +
                                 ": ranks share one GPU (the device-local communicator) or "
                                 "have a GPU each (NCCL), not both");
#else
  return Status::Unavailable("this pdserve was built without CUDA (ranks on " + names + ")");
#endif
}

}  // namespace pdserve::kernels
