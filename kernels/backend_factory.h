// Picks the compute backend a command runs on.
#pragma once

#include <memory>
#include <string_view>

#include "common/status.h"
#include "kernels/backend.h"

namespace pdserve::kernels {

// "cpu" (with `threads` threads, 0: one per core) or "cuda" / "cuda:N"
// (device N, default 0). InvalidArgument for another name; Unavailable when
// CUDA was not built in or the device does not exist.
StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view device, int threads);

}  // namespace pdserve::kernels
