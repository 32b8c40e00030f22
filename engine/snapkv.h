// SnapKV (Li et al. 2024; --kv-eviction snapkv, common/kv_eviction.h): which
// prompt positions each layer and KV head keeps once a prompt longer than
// the budget has been prefilled, and the gather that packs them into blocks
// of the sequence's own. The engine (engine.h) and the text evaluation
// (text_eval.h) both compress through these two functions.
//
// The rule, for a prompt of P > B tokens, window W, per layer and KV head:
//  - every query head h of the KV head's group and every observation query
//    t in [P - W, P) (its queries after RoPE, as the prefill computed them)
//    gives each key j <= t the softmax weight of q_t.k_j * scale over
//    keys 0..t (tanh soft-capped where the model caps scores);
//  - vote[j] for j < P - W sums those weights over the W queries and the
//    group's heads;
//  - pooled[j] = max of vote over j-3 .. j+3 within [0, P - W) (SnapKV's
//    1-D pooling along positions, kernel 7; this is its max pool);
//  - the B - W positions of highest pooled value (ties: the lower position)
//    are kept, with the window [P - W, P).
// Keys stay rotated by their own positions, so the kept ones need no
// re-rotation and decoding continues at the true positions.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "engine/model_config.h"
#include "kernels/backend.h"
#include "kernels/kv_cache_layout.h"

namespace pdserve {

// The positions kept by every layer and KV head, kept[layer * kv_heads +
// head], ascending, min(B, P) each (all of [0, P) when P <= B). `pool` is the
// KV pool in host memory (any GQA KV dtype: keys are decoded with their
// block's scales), position p of the prompt in block table[p / block_size];
// `queries` the roped queries of the last W prompt positions,
// [layers][W][heads * head_dim] fp32.
std::vector<std::vector<int32_t>> SnapKvSelect(const ModelConfig& config,
                                               const kernels::KvCacheLayout& layout,
                                               const void* pool, std::span<const int32_t> table,
                                               int64_t prompt_len, const float* queries);

// For every layer and KV head, copies the K and V of position kept[..][i]
// (in blocks `from`) to cache index i (in blocks `to`), both tables indexed
// by position / block_size. `to`'s blocks must not be `from`'s. Scaled KV
// dtypes (fp8, nvfp4) hold one scale per block, layer, K|V and head, and
// the kept rows of one destination block come from source blocks of
// different scales: each row is decoded with its source block's scale and
// every destination block is quantised afresh, with the scale its rows
// need, as a prefill chunk writes a block (calibrated scales stay fixed).
// Per-row scales would keep every code but need another pool layout,
// kernels and transfer layout; with power-of-two scales a row whose source
// block had the destination's scale keeps its values exactly, and a row
// from a block of smaller scale loses only what the larger scale cannot
// hold (engine_snapkv_scaled_test).
void SnapKvGather(const kernels::KvCacheLayout& layout, void* pool, std::span<const int32_t> from,
                  std::span<const int32_t> to, const std::vector<std::vector<int32_t>>& kept);

// Quest beside SnapKV (--kv-selection quest): sets the key bounds of the
// compacted blocks `to` from the first `budget` cache indices' keys, as the
// pool stores them, on the backend that holds the pool (every layer and KV
// head; each head's own kept keys). A block holds different positions per
// KV head, so no bound a prefill WriteKv kept applies to it. The last block
// may be partly filled; decode writes continue its bounds. Nothing without
// key bounds in the layout.
void SnapKvBoundKeys(kernels::Backend* backend, const kernels::KvCacheLayout& layout,
                     const void* pool, std::span<const int32_t> to, int64_t budget);

// SnapKvSelect and SnapKvGather for a pool the host cannot read (a device
// backend's): the prompt's blocks are downloaded into a host copy (renumbered
// 0..n-1 in `from`'s order), the selection reads the copy, and Gather packs
// the kept rows into host blocks and uploads them whole into the pool's `to`
// blocks (fresh blocks, whose rows past the budget are written later). It
// costs one download of the prompt's KV (P tokens, every layer, K and V)
// and one upload of ceil(B / block_size) blocks, once per compressed prompt.
class SnapKvHostCopy {
 public:
  SnapKvHostCopy(kernels::Backend* backend, const kernels::KvCacheLayout& layout, const void* pool,
                 std::span<const int32_t> from);
  const void* pool() const { return bytes_.data(); }
  std::span<const int32_t> from() const { return from_; }
  void Gather(void* pool, std::span<const int32_t> to,
              const std::vector<std::vector<int32_t>>& kept);

 private:
  kernels::Backend* backend_;
  kernels::KvCacheLayout layout_;
  std::vector<uint8_t> bytes_;  // the copied blocks, then the gathered ones
  std::vector<int32_t> from_;
};

}  // namespace pdserve
