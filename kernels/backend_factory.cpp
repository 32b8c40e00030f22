#include "kernels/backend_factory.h"

#include <charconv>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#if PDSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#endif

namespace pdserve::kernels {

StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view device, int threads) {
  if (device == "cpu") return std::unique_ptr<Backend>(std::make_unique<CpuBackend>(threads));
  if (device.substr(0, 4) != "cuda" || (device.size() > 4 && device[4] != ':')) {
    return Status::InvalidArgument("unknown device '" + std::string(device) +
                                   "' (expected cpu, cuda or cuda:N)");
  }
  int index = 0;
  if (device.size() > 4) {
    const std::string_view n = device.substr(5);
    auto [end, err] = std::from_chars(n.data(), n.data() + n.size(), index);
    if (err != std::errc() || end != n.data() + n.size() || n.empty() || index < 0)
      return Status::InvalidArgument("bad device index in '" + std::string(device) + "'");
  }
#if PDSERVE_WITH_CUDA
  auto backend = CudaBackend::Create(index);
  if (!backend) {
    return Status::Unavailable("no CUDA device " + std::to_string(index) + " on this machine");
  }
  return std::unique_ptr<Backend>(std::move(backend));
#else
  return Status::Unavailable("this pdserve was built without CUDA (PDSERVE_CUDA=OFF or no nvcc)");
#endif
}

}  // namespace pdserve::kernels
