// Layer groups of a paged KV cache whose layers attend over different spans
// (sliding-window layers beside full-attention ones), and the rules that
// say which blocks a sequence needs. docs/kv-windows.md tells the design.
//
// The layers are cut into groups of equal size, each holding layers of one
// window only (0: full attention), so that a pool block holds one group's
// layers for block_size tokens and every group's block has the same bytes.
// The group size is the greatest common divisor of the layer counts per
// window: a model whose layers all share one window (Llama: all full;
// Mistral-7B-v0.1: all 4096) has one group of every layer, Gemma-2 (21
// local, 21 global) two, Gemma-3-12B (40 local, 8 global) six. A sequence
// has one block table per group; block i of every table holds positions
// [i*B, (i+1)*B), and a windowed group's blocks that no later query reaches
// are released as the sequence moves on.
//
// Window rule (transformers' sliding_window_overlay, which Gemma-2/3,
// Mistral and Qwen2/3 share): with window W a query at position p attends
// to positions p-W+1 .. p, itself included. Mistral's reference code keeps
// one more (p-W .. p, `torch.triu(mask, diagonal=-sliding_window)`), and
// flash-attention's window_size=(W, 0) too; pdserve follows transformers.
//
// Index keys: the block manager, the KV events, the lower tiers and the
// router's prefix index name a block of group g by GroupBlockKey(hash, g):
// its token-run hash (common/block_hash.h) for group 0, so one-group models
// keep the hash-spec-v1 values; XXH3_64_withSeed(le64(hash), g) for g > 0.
// Workers and routers must agree on this bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "common/block_hash.h"

namespace pdserve {

struct KvGroups {
  // Per group: its window (0: full attention) and its layers, ascending.
  // Groups are ordered by their first layer.
  std::vector<int64_t> windows;
  std::vector<std::vector<int64_t>> layers;
  int64_t layers_per_group = 0;
  // Per model layer: its group and its index inside the group's block.
  std::vector<int32_t> group_of_layer;
  std::vector<int32_t> slot_of_layer;
  // Attention sinks (StreamingLLM, --kv-eviction streaming): every windowed
  // group also keeps positions [0, sink_tokens), which each query attends
  // to beside its window; their blocks are never released. 0: none.
  int64_t sink_tokens = 0;

  // The groups of a model whose layer l attends over layer_windows[l]
  // positions (0: all). An empty list gives no groups.
  static KvGroups FromLayerWindows(std::span<const int64_t> layer_windows);
  // One group of `layers` full-attention layers.
  static KvGroups Full(int64_t layers);

  size_t size() const { return windows.size(); }
  bool any_windowed() const;
  // "2 groups of 21 layers: window 4096, full" (for logs and layouts).
  std::string Describe() const;
};

BlockHash GroupBlockKey(BlockHash hash, uint32_t group);

// The first block a query at position `pos` reaches through `window`
// (0 for full attention, and while the window covers the whole prefix).
inline int64_t FirstBlockInReach(int64_t window, int64_t pos, int64_t block_size) {
  if (window <= 0) return 0;
  const int64_t first = pos - window + 1;
  return first <= 0 ? 0 : first / block_size;
}

// Blocks holding the first `sink_tokens` positions: kept by windowed groups
// whatever the sequence's length.
inline int64_t SinkBlocks(int64_t sink_tokens, int64_t block_size) {
  return sink_tokens <= 0 ? 0 : (sink_tokens + block_size - 1) / block_size;
}

// Whether block `block` is reached by the query at `pos` in a group of
// `window` with `sink_tokens` sinks: every block of a full group; the sink
// blocks and those from FirstBlockInReach on of a windowed one.
inline bool BlockInReach(int64_t window, int64_t sink_tokens, int64_t pos, int64_t block_size,
                         int64_t block) {
  return window <= 0 || block < SinkBlocks(sink_tokens, block_size) ||
         block >= FirstBlockInReach(window, pos, block_size);
}

// The longest cached prefix a sequence can start from, in blocks: the
// largest k <= limit such that for every group g the blocks the query at
// position k * block_size reaches below it (BlockInReach) are all held
// (held(g, i)). For full-attention groups that is every block before k; for
// windowed ones the blocks of the last W-1 tokens (vLLM's rule for sliding
// windows), and the sink blocks when there are sinks. 0 is always a valid
// answer.
size_t CachedPrefixBlocks(std::span<const int64_t> windows, size_t block_size, size_t limit,
                          const std::function<bool(size_t group, size_t block)>& held,
                          int64_t sink_tokens = 0);

}  // namespace pdserve
