#include "transport/kv_transfer_factory.h"

#include "transport/ucx/ucx_transfer.h"

#if PDSERVE_WITH_NCCL
#include "transport/nccl/nccl_transfer.h"
#endif

namespace pdserve {

StatusOr<KvTransferKind> ParseKvTransferKind(std::string_view name) {
  if (name == "ucx") return KvTransferKind::kUcx;
  if (name == "nccl") return KvTransferKind::kNccl;
  return Status::InvalidArgument("unknown KV transfer backend '" + std::string(name) +
                                 "' (expected ucx or nccl)");
}

std::string_view KvTransferKindName(KvTransferKind kind) {
  switch (kind) {
    case KvTransferKind::kUcx:
      return "ucx";
    case KvTransferKind::kNccl:
      return "nccl";
  }
  return "unknown";
}

StatusOr<KvStagingMode> ParseKvStagingMode(std::string_view name) {
  if (name == "auto") return KvStagingMode::kAuto;
  if (name == "always") return KvStagingMode::kAlways;
  if (name == "never") return KvStagingMode::kNever;
  return Status::InvalidArgument("unknown KV staging mode '" + std::string(name) +
                                 "' (expected auto, always or never)");
}

std::string_view KvStagingModeName(KvStagingMode mode) {
  switch (mode) {
    case KvStagingMode::kAuto:
      return "auto";
    case KvStagingMode::kAlways:
      return "always";
    case KvStagingMode::kNever:
      return "never";
  }
  return "unknown";
}

StatusOr<std::unique_ptr<KvTransfer>> CreateKvTransfer(const KvTransferOptions& options) {
  switch (options.kind) {
    case KvTransferKind::kUcx: {
#if !PDSERVE_WITH_CUDA
      if (options.pool_memory == MemoryType::kCuda) {
        return Status::Unavailable(
            "a device KV pool needs a CUDA build of pdserve (this one was built without CUDA)");
      }
#endif
      UcxTransferOptions uo;
      uo.tls = options.tls;
      uo.name = options.name;
      uo.staging = options.staging;
      uo.staging_bytes = options.staging_bytes;
      uo.cuda_device = options.pool_memory == MemoryType::kCuda ? options.cuda_device : -1;
      return CreateUcxTransfer(uo);
    }
    case KvTransferKind::kNccl: {
      if (options.pool_memory != MemoryType::kCuda) {
        return Status::InvalidArgument(
            "NCCL moves device memory only; use --kv-transfer ucx with a CPU device");
      }
#if PDSERVE_WITH_NCCL
      NcclTransferOptions no;
      no.device = options.cuda_device < 0 ? 0 : options.cuda_device;
      return CreateNcclTransfer(no);
#else
      return Status::Unavailable(
          "KV transfer over NCCL is not available: this build of pdserve has no NCCL "
          "(it needs a CUDA build with NCCL found); use --kv-transfer ucx");
#endif
    }
  }
  return Status::InvalidArgument("unknown KV transfer backend");
}

}  // namespace pdserve
