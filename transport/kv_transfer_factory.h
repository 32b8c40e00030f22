// One place that builds a KvTransfer from options, for the worker, the CLI
// and tests: picks the backend (UCX or NCCL) and refuses combinations that
// cannot work with a clear Status before anything is allocated.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "common/kv_layout.h"
#include "common/status.h"
#include "transport/kv_transfer.h"

namespace pdserve {

enum class KvTransferKind { kUcx, kNccl };

// "ucx", "nccl" (exactly; InvalidArgument naming the accepted values otherwise).
StatusOr<KvTransferKind> ParseKvTransferKind(std::string_view name);
std::string_view KvTransferKindName(KvTransferKind kind);

// KvStagingMode (defined in kv_transfer.h): "auto", "always", "never".
StatusOr<KvStagingMode> ParseKvStagingMode(std::string_view name);
std::string_view KvStagingModeName(KvStagingMode mode);

struct KvTransferOptions {
  KvTransferKind kind = KvTransferKind::kUcx;
  // Where the pool that will be registered lives.
  MemoryType pool_memory = MemoryType::kHost;
  // CUDA device of a device pool (NCCL: the device it runs on; UCX: -1 means
  // the device that holds the pool).
  int cuda_device = 0;
  // UCX only: see ucx_transfer.h.
  KvStagingMode staging = KvStagingMode::kAuto;
  size_t staging_bytes = size_t{256} << 20;
  std::string tls;  // UCX TLS list; empty: UCX_TLS or UCX's default
  std::string name = "pdserve";
};

// kUcx: CreateUcxTransfer. kNccl: CreateNcclTransfer, device pools only
// (InvalidArgument for a host pool; Unavailable in builds without NCCL).
StatusOr<std::unique_ptr<KvTransfer>> CreateKvTransfer(const KvTransferOptions& options);

}  // namespace pdserve
