#include "engine/kv_cache.h"

namespace pdserve {

StatusOr<std::unique_ptr<KvCachePool>> KvCachePool::Create(kernels::Backend* backend,
                                                           const ModelConfig& config, DType dtype,
                                                           int64_t block_size, int64_t budget_bytes,
                                                           const KvScales* scales) {
  if (block_size < 1 || block_size > 1024) {
    return Status::InvalidArgument("block size must be in [1, 1024], got " +
                                   std::to_string(block_size));
  }
  kernels::KvCacheLayout layout;
  if (config.is_mla()) {
    layout = kernels::KvCacheLayout::Mla(config.num_layers, config.kv_lora_rank,
                                         config.qk_rope_head_dim);
  } else {
    // A block holds one layer group's layers (all of them for one group).
    layout.num_layers = config.kv_groups().layers_per_group;
    layout.num_kv_heads = config.num_kv_heads;
    layout.head_dim = config.head_dim;
  }
  layout.block_size = block_size;
  layout.dtype = dtype;
  if (dtype == DType::kNvFp4 && layout.head_dim % 2 != 0) {
    return Status::InvalidArgument(
        "KV cache dtype nvfp4 needs an even head_dim (two 4-bit values a byte); this model's is " +
        std::to_string(layout.head_dim));
  }
  if (scales != nullptr) {
    if (!layout.has_scales() || scales->kv_dtype != dtype) {
      return Status::InvalidArgument("KV scales were calibrated for " +
                                     std::string(DTypeName(scales->kv_dtype)) +
                                     " KV, this pool is " + std::string(DTypeName(dtype)));
    }
    if (scales->kv_sets != layout.kv_sets() || scales->num_layers() != config.num_layers) {
      return Status::InvalidArgument(
          "KV scales hold " + std::to_string(scales->num_layers()) + " layers of " +
          std::to_string(scales->kv_sets) + ", the model " + std::to_string(config.num_layers) +
          " of " + std::to_string(layout.kv_sets()) + (layout.is_mla() ? " (MLA)" : " (K, V)"));
    }
  }
  const int64_t per_block = layout.bytes_per_block();
  layout.num_blocks = budget_bytes > 0 ? budget_bytes / per_block : 0;
  if (layout.num_blocks < 1) {
    return Status::ResourceExhausted("KV cache budget of " + std::to_string(budget_bytes) +
                                     " bytes holds no block (one block takes " +
                                     std::to_string(per_block) + " bytes)");
  }
  std::unique_ptr<KvCachePool> pool(new KvCachePool());
  pool->backend_ = backend;
  pool->layout_ = layout;
  pool->groups_ = config.is_mla() ? KvGroups::Full(config.num_layers) : config.kv_groups();
  pool->eviction_ = config.kv_eviction.Describe();
  if (scales != nullptr) {
    // In group order: [group][layer of the group][set], what each group's
    // blocks use (Model::Forward points every group at its own rows).
    const int64_t sets = layout.kv_sets();
    for (const auto& layers : pool->groups_.layers) {
      for (int64_t l : layers) {
        pool->fixed_scales_.insert(pool->fixed_scales_.end(), scales->scales.begin() + l * sets,
                                   scales->scales.begin() + (l + 1) * sets);
      }
    }
    pool->layout_.fixed_scales = pool->fixed_scales_.data();
  }
  pool->base_ = backend->Allocate(static_cast<size_t>(layout.total_bytes()));
  if (pool->base_ == nullptr) {
    return Status::ResourceExhausted("cannot allocate a KV pool of " +
                                     std::to_string(layout.total_bytes()) + " bytes");
  }
  if (config.kv_eviction.quest_blocks > 0) {
    // Quest's key bounds beside the pool: 2 x head_dim floats per block,
    // layer and KV head (1/block_size of the keys' fp32 bytes).
    const auto bytes = static_cast<size_t>(layout.num_blocks * layout.num_layers *
                                           layout.num_kv_heads * 2 * layout.head_dim * 4);
    pool->key_bounds_ = static_cast<float*>(backend->Allocate(bytes));
    if (pool->key_bounds_ == nullptr) {
      return Status::ResourceExhausted("cannot allocate Quest's key bounds");
    }
    pool->layout_.key_bounds = pool->key_bounds_;
  }
  return pool;
}

KvCachePool::~KvCachePool() {
  if (base_ != nullptr) backend_->Free(base_);
  if (key_bounds_ != nullptr) backend_->Free(key_bounds_);
}

MemoryType KvCachePool::memory_type() const {
  return backend_->SharesHostMemory() ? MemoryType::kHost : MemoryType::kCuda;
}

KvLayout KvCachePool::TransferLayout(std::string model_id, DType weight_dtype,
                                     std::string transfer_backend) const {
  KvLayout l;
  l.model_id = std::move(model_id);
  l.weight_dtype = weight_dtype;
  l.kv_dtype = layout_.dtype;
  l.layers = layout_.num_layers;
  l.kv_heads = layout_.num_kv_heads;
  l.head_dim = layout_.head_dim;
  l.attention = layout_.attention;
  l.kv_lora_rank = layout_.kv_lora_rank;
  l.qk_rope_head_dim = layout_.rope_dim();
  l.block_tokens = layout_.block_size;
  l.block_layout = layout_.BlockOrder();
  l.bytes_per_block = layout_.bytes_per_block();
  l.memory_type = memory_type();
  l.transfer_backend = std::move(transfer_backend);
  if (groups_.size() > 1 || groups_.any_windowed()) l.group_windows = groups_.windows;
  l.kv_eviction = eviction_;
  return l;
}

}  // namespace pdserve
