// The paged KV pool: one preallocated, contiguous region of equal blocks.
//
// Contract: the region never moves or grows after Create, and its byte
// layout is kernels::KvCacheLayout (block id b at b * bytes_per_block(), each
// block holding the K and V (or MLA latent) of the layers of one layer group,
// common/kv_groups.h: every layer for a model without windows, plus fp8
// scales). The transport layer
// registers [base(), base() + total_bytes()) once and moves a block by id.
// Which block holds what is the block manager's business, not the pool's.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/kv_layout.h"
#include "common/status.h"
#include "engine/kv_scales.h"
#include "engine/model_config.h"
#include "kernels/backend.h"

namespace pdserve {

class KvCachePool {
 public:
  // As many blocks as fit in `budget_bytes`. InvalidArgument for a block size
  // < 1, a dtype the KV cache cannot hold (nvfp4 with an odd head_dim), or
  // calibrated `scales` (engine/kv_scales.h) of another dtype or shape than
  // the pool's; ResourceExhausted when the budget holds no block or the
  // backend cannot allocate it.
  static StatusOr<std::unique_ptr<KvCachePool>> Create(kernels::Backend* backend,
                                                       const ModelConfig& config, DType dtype,
                                                       int64_t block_size, int64_t budget_bytes,
                                                       const KvScales* scales = nullptr);
  ~KvCachePool();
  KvCachePool(const KvCachePool&) = delete;
  KvCachePool& operator=(const KvCachePool&) = delete;

  const kernels::KvCacheLayout& layout() const { return layout_; }
  // The layer groups a block holds one of (layout().num_layers layers each).
  const KvGroups& groups() const { return groups_; }
  void* base() const { return base_; }
  int64_t total_bytes() const { return layout_.total_bytes(); }
  int64_t bytes_per_block() const { return layout_.bytes_per_block(); }
  int64_t num_blocks() const { return layout_.num_blocks; }
  // Start of block `id` (backend memory).
  uint8_t* block(int64_t id) const {
    return static_cast<uint8_t*>(base_) + layout_.block_offset(id);
  }
  std::string Describe() const { return layout_.Describe(); }
  // Host memory, or device memory of a backend that does not share it.
  MemoryType memory_type() const;
  // The pool as the KV transport announces and compares it: every byte field
  // from this pool's layout, plus the identities only the caller knows.
  KvLayout TransferLayout(std::string model_id, DType weight_dtype,
                          std::string transfer_backend) const;

 private:
  KvCachePool() = default;
  kernels::Backend* backend_ = nullptr;
  kernels::KvCacheLayout layout_;
  KvGroups groups_;
  std::string eviction_;             // KvEviction::Describe() of the model's mode
  float* key_bounds_ = nullptr;      // Quest's (KvCacheLayout::key_bounds)
  std::vector<float> fixed_scales_;  // layout_.fixed_scales points here
  void* base_ = nullptr;
};

}  // namespace pdserve
