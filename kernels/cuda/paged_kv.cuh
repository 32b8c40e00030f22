// Where things sit in the paged KV pool (kernels/kv_cache_layout.h), on the
// device: the GQA layout's offsets, a query row's keys, and a key's K and V.
// Shared by the KV write and both attention families.
#pragma once

#include <cstdint>

#include "kernels/cuda/kv_codec.cuh"
#include "kernels/kv_cache_layout.h"
#include "kernels/step.h"

namespace pdserve::cuda {

// KvCacheLayout's offsets, precomputed on the host for device code (the
// layout header is plain C++).
struct DeviceLayout {
  int64_t num_kv_heads, head_dim, block_size;
  int64_t head_bytes, kv_bytes_per_layer, layer_stride, bytes_per_block;
  int64_t micro_at;  // nvfp4: the micro-scales' offset in a head region
  DType dtype;
  bool has_scales;
  int64_t num_layers;
  float* key_bounds;  // Quest's (KvCacheLayout::key_bounds); null: none kept

  explicit DeviceLayout(const kernels::KvCacheLayout& l)
      : num_kv_heads(l.num_kv_heads),
        head_dim(l.head_dim),
        block_size(l.block_size),
        head_bytes(l.head_bytes()),
        kv_bytes_per_layer(l.kv_bytes_per_layer()),
        layer_stride(l.layer_stride_bytes()),
        bytes_per_block(l.bytes_per_block()),
        micro_at(l.head_value_bytes()),
        dtype(l.dtype),
        has_scales(l.has_scales()),
        num_layers(l.num_layers),
        key_bounds(l.key_bounds) {}

  __device__ int64_t k_offset(int64_t block, int64_t layer, int64_t head) const {
    return block * bytes_per_block + layer * layer_stride + head * head_bytes;
  }
  __device__ int64_t v_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_offset(block, layer, head) + kv_bytes_per_layer;
  }
  __device__ int64_t k_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return block * bytes_per_block + layer * layer_stride + 2 * kv_bytes_per_layer + head * 4;
  }
  __device__ int64_t v_scale_offset(int64_t block, int64_t layer, int64_t head) const {
    return k_scale_offset(block, layer, head) + num_kv_heads * 4;
  }
  // KvCacheLayout::key_bounds_offset: the minima, then the maxima.
  __device__ float* bounds_of(int64_t block, int64_t layer, int64_t head) const {
    return key_bounds + ((block * num_layers + layer) * num_kv_heads + head) * 2 * head_dim;
  }
};

// The keys query row `row` attends to: its sequence's block table and how
// many keys (causal: up to and including the row's own position).
struct RowKeys {
  const int32_t* table;
  int64_t n_keys;
  int64_t q_len;  // query rows of the row's sequence in this step
  int64_t seq;    // the row's sequence
};

// Gemma-2's logit soft-capping (cap 0: none).
__device__ inline float SoftCapScore(float score, float cap) {
  return cap > 0.0f ? cap * tanhf(score / cap) : score;
}

// The first key a row of n_keys keys attends to: n_keys - window under a
// sliding window (the blocks before it are not read), else 0.
__device__ inline int64_t FirstKeyOfRow(const kernels::AttentionBatch& batch, int64_t n_keys) {
  return batch.window > 0 ? max(int64_t{0}, n_keys - batch.window) : 0;
}

__device__ inline RowKeys KeysOfRow(const kernels::AttentionBatch& batch, int64_t row) {
  // The sequence of this row: the last s with query_start[s] <= row.
  int64_t lo = 0, hi = batch.num_seqs - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (batch.query_start[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int64_t q_len = batch.query_start[lo + 1] - batch.query_start[lo];
  return {batch.table(lo), batch.context_lens[lo] - q_len + (row - batch.query_start[lo]) + 1,
          q_len, lo};
}

// Attention sinks (AttentionBatch::sinks): the sink keys a row of n_keys
// keys attends to besides its window, [0, SinkEnd) (0 without sinks, or
// while the window still holds them).
__device__ inline int64_t SinkEnd(const kernels::AttentionBatch& batch, int64_t n_keys) {
  if (batch.window <= 0 || batch.sinks <= 0) return 0;
  return min(batch.sinks, max(int64_t{0}, n_keys - batch.window));
}

// Element d of query row `qrow` (head_dim hd) as a sink key sees it: rotated
// back by shift = n_keys - window - sinks positions when that is positive
// (the window has left the sinks), else unchanged. The angle in double, as
// Rope and the CPU backend take it.
__device__ inline float SinkQuery(const kernels::AttentionBatch& batch, const float* qrow,
                                  int64_t hd, int64_t n_keys, int64_t d) {
  const int64_t shift = n_keys - batch.window - batch.sinks;
  if (shift <= 0) return qrow[d];
  const int64_t half = hd / 2, i = d % half;
  double sd, cd;
  sincos(-static_cast<double>(shift) * batch.rope_inv_freq[i], &sd, &cd);
  const float c = static_cast<float>(cd), s = static_cast<float>(sd);
  return d < half ? qrow[d] * c - qrow[d + half] * s : qrow[d] * c + qrow[d - half] * s;
}

// Quest (AttentionBatch::quest_blocks): whether a row of n_keys keys selects
// blocks, as the CPU backend decides it: a decode row (its sequence has one
// query row and is not prefilling) without a window whose full blocks before its newest number
// more than quest_blocks, with the pool's key bounds kept. Such rows are
// left to the Quest kernels (kernels/cuda/quest.cu) by the dense ones.
__device__ inline bool QuestRow(const kernels::AttentionBatch& batch, const DeviceLayout& layout,
                                const RowKeys& keys) {
  return layout.key_bounds != nullptr && batch.quest_blocks > 0 && keys.q_len == 1 &&
         (batch.prefilling == nullptr || batch.prefilling[keys.seq] == 0) && batch.window == 0 &&
         (keys.n_keys + layout.block_size - 1) / layout.block_size - 1 > batch.quest_blocks;
}

// Where key `key` of KV head g sits in the pool: its K and V rows (element
// index `elem` within the head's block data) and their fp8 scales (1 for
// other dtypes).
struct KvAt {
  const uint8_t* k;
  const uint8_t* v;
  float k_scale, v_scale;
  int64_t elem;
};

__device__ inline KvAt KvOfKey(const DeviceLayout& layout, const uint8_t* pool, int64_t layer,
                               int64_t g, const int32_t* table, int64_t key) {
  const int64_t block = table[key / layout.block_size];
  KvAt a;
  a.k = pool + layout.k_offset(block, layer, g);
  a.v = pool + layout.v_offset(block, layer, g);
  a.k_scale = layout.has_scales
                  ? kernels::LoadScaleBytes(pool + layout.k_scale_offset(block, layer, g))
                  : 1.0f;
  a.v_scale = layout.has_scales
                  ? kernels::LoadScaleBytes(pool + layout.v_scale_offset(block, layer, g))
                  : 1.0f;
  a.elem = (key % layout.block_size) * layout.head_dim;
  return a;
}

}  // namespace pdserve::cuda
