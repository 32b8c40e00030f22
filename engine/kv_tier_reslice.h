// How a tensor-parallel block is laid out in the KV tiers, and how an entry
// written at another tensor-parallel size is re-sliced (docs/kv-tiers.md).
//
// A tier entry is a block's shards, shard by shard, each one block of a
// rank's pool shard. With n ranks splitting `kv_heads` (n divides them)
// that is n shards, shard s holding heads [s, s + 1) x kv_heads / n. With
// more ranks than KV heads, n / kv_heads consecutive ranks hold one head
// (replicated): the entry keeps one copy, from the first of them, so it is
// kv_heads shards of one head each, and every rank of the group is loaded
// from it. MLA's latent is one head on every rank: one shard. So an entry
// splits its heads TierSplit(kv_heads, n) ways, and its bytes are the same
// at every size; a worker at another size re-slices it head by head.
#pragma once

#include <cstdint>

#include "kernels/kv_cache_layout.h"

namespace pdserve {

// The largest tensor-parallel size a worker runs at (--tensor-parallel,
// engine/model_group.h): the sizes whose entries a tier re-slices.
constexpr int kMaxTensorParallel = 8;

// The shards a tier entry of n ranks holds: min(n, kv_heads).
int TierSplit(int64_t kv_heads, int n);

// The entry shard rank r of n loads from and, when r is the first of its
// head's ranks, offloads into: r / (n / TierSplit).
int TierShardOfRank(int64_t kv_heads, int n, int r);

// The layout of one shard of an entry split `split` ways (divides
// kv_heads), from any rank's pool layout `pool` (only the KV head count
// differs); one block.
kernels::KvCacheLayout TierShardLayout(kernels::KvCacheLayout pool, int64_t kv_heads, int split);

// Copies the entry `from`, split `from_split` ways, into `to`, split
// `to_split` ways (both divide kv_heads): every head's K, V and scales of
// every layer move to the shard and place that hold it in `to`.
void ResliceTierEntry(const kernels::KvCacheLayout& pool, int64_t kv_heads, int from_split,
                      const uint8_t* from, int to_split, uint8_t* to);

}  // namespace pdserve
