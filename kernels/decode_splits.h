// How decode attention cuts each row's keys into splits (split-K
// flash-decoding, kernels/cuda/decode_attention.cu), in plain C++ so that
// the CUDA kernels and the host tests compute the very same ranges.
//
// The split count is the step's: it depends on the rows, the KV heads and
// the device's multiprocessors, never on the block table's width, so a
// graph captured for a bucket of rows holds for every context it replays.
// Each split's keys are cut on the device from the row's own context.
#pragma once

#include <cstdint>

#include "kernels/step.h"  // AttentionPlan, PDSERVE_HOST_DEVICE

namespace pdserve::kernels {

inline constexpr int kDecodeMaxGroup = 8;  // query heads per KV head on this path
inline constexpr int kDecodeMaxSplits = 64;
// Thread blocks a step aims at per multiprocessor: several waves of the
// 2 to 4 resident ones, so the last wave's tail is a small share.
inline constexpr int64_t kDecodeBlocksPerSm = 16;
// A plan whose longest context is known takes no split shorter than this.
inline constexpr int64_t kDecodeMinSplitKeys = 256;
// Steps of more rows than this that are not all decode rows are prefill
// steps: the prefill kernel's.
inline constexpr int64_t kDecodeMaxRows = 1024;

// The keys [begin, end) of split `split` of a row whose keys are
// [first, n_keys) (first: the window's first key, else 0): the blocks
// holding them cut into `splits` runs of whole blocks. Empty (begin >= end)
// for splits past the row's keys.
struct KeyRange {
  int64_t begin, end;
};
PDSERVE_HOST_DEVICE inline KeyRange KeysOfSplit(int64_t first, int64_t n_keys, int64_t block_size,
                                                int split, int splits) {
  const int64_t first_block = first / block_size;
  const int64_t blocks = (n_keys + block_size - 1) / block_size - first_block;
  const int64_t per = blocks > 0 ? (blocks + splits - 1) / splits : 1;  // blocks a split
  const int64_t b0 = first_block + split * per;
  const int64_t begin = b0 * block_size > first ? b0 * block_size : first;
  const int64_t end = (b0 + per) * block_size < n_keys ? (b0 + per) * block_size : n_keys;
  return {begin, end};
}

// How many splits of a row leave a result: split 0 always (it also takes
// the sink keys, and stands for a row without keys), then those whose key
// range is not empty, which are the first ones (KeysOfSplit cuts the
// blocks in order). The split kernels and the merge agree on it.
PDSERVE_HOST_DEVICE inline int SplitsWritten(int64_t first, int64_t n_keys, int64_t block_size,
                                             int splits) {
  const int64_t blocks = (n_keys + block_size - 1) / block_size - first / block_size;
  if (blocks <= 0) return 1;
  const int64_t per = (blocks + splits - 1) / splits;
  return static_cast<int>((blocks + per - 1) / per);
}

namespace detail {

// Splits that bring `units` thread blocks (each split a block) to
// kDecodeBlocksPerSm per multiprocessor: none under kDecodeMinSplitKeys keys
// of the longest context where known (max_context_len > 0), at most
// kDecodeMaxSplits, at least 1.
inline int SplitsForUnits(int64_t units, int64_t max_context_len, int multiprocessors) {
  units = units > 1 ? units : 1;
  const int64_t target = (multiprocessors > 1 ? multiprocessors : 1) * kDecodeBlocksPerSm;
  int64_t splits = (target + units - 1) / units;
  if (max_context_len > 0) {
    const int64_t by_keys = (max_context_len + kDecodeMinSplitKeys - 1) / kDecodeMinSplitKeys;
    if (by_keys < splits) splits = by_keys;
  }
  if (splits > kDecodeMaxSplits) splits = kDecodeMaxSplits;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

// The largest floats(plan, splits(plan)) over decode steps of any row count:
// more than one split only while the units are under the target, and
// splits never grow with rows, so every row count that matters is visited.
template <typename Splits, typename Floats>
int64_t MaxPartialFloats(const KvCacheLayout& layout, int64_t num_heads, Splits splits,
                         Floats floats) {
  AttentionPlan plan;
  plan.layout = layout;
  plan.num_heads = num_heads;
  plan.max_query_len = 1;
  int64_t most = 0;
  for (int64_t rows = 1;; ++rows) {
    plan.batch.num_tokens = rows;
    const int n = splits(plan);
    if (n <= 1) break;
    const int64_t f = floats(plan, n);
    if (f > most) most = f;
  }
  return most;
}

}  // namespace detail

// The number of key splits each row of a plan's step takes: enough thread
// blocks (rows x KV heads x splits) to fill `multiprocessors` several
// times over, at most kDecodeMaxSplits, and no split under
// kDecodeMinSplitKeys keys of the plan's longest context where known. 1:
// the split kernel writes the output directly. 0: the plan does not take
// this path (a group too wide or uneven, a head_dim past 256, or a step of
// more than kDecodeMaxRows rows that are not all decode rows).
inline int DecodeSplits(const AttentionPlan& plan, int multiprocessors) {
  const KvCacheLayout& l = plan.layout;
  const int64_t group = l.num_kv_heads > 0 ? plan.num_heads / l.num_kv_heads : 0;
  const int64_t rows = plan.batch.num_tokens;
  if (group < 1 || group > kDecodeMaxGroup || group * l.num_kv_heads != plan.num_heads ||
      l.head_dim < 1 || l.head_dim > 256 || (plan.max_query_len != 1 && rows > kDecodeMaxRows)) {
    return 0;
  }
  return detail::SplitsForUnits(rows * l.num_kv_heads, plan.max_context_len, multiprocessors);
}

// Floats of partials `splits` splits need (0 for one: no partials).
inline int64_t DecodePartialFloats(const AttentionPlan& plan, int splits) {
  if (splits <= 1) return 0;
  return plan.batch.num_tokens * plan.num_heads * splits * (plan.layout.head_dim + 2);
}

// The most partials any step of the layout can need: the largest
// DecodePartialFloats of any row count's DecodeSplits. Backend::Reserve
// sizes them once for every step, captured or not.
inline int64_t DecodeMaxPartialFloats(const KvCacheLayout& layout, int64_t num_heads,
                                      int multiprocessors) {
  return detail::MaxPartialFloats(
      layout, num_heads, [&](const AttentionPlan& p) { return DecodeSplits(p, multiprocessors); },
      DecodePartialFloats);
}

// Multi-head latent attention (kernels/cuda/mla_attention.cu): a thread
// block per (row, query head) and key split, every head reading the row's
// latents. The split count of a step as DecodeSplits counts it, its units
// being rows x query heads, for steps of decode rows (or of at most
// kDecodeMaxRows rows); 1 otherwise (prefill rows are many blocks already).
inline int MlaDecodeSplits(const AttentionPlan& plan, int multiprocessors) {
  const int64_t rows = plan.batch.num_tokens;
  if (plan.num_heads < 1 || (plan.max_query_len != 1 && rows > kDecodeMaxRows)) return 1;
  return detail::SplitsForUnits(rows * plan.num_heads, plan.max_context_len, multiprocessors);
}

// Floats of MLA partials: per (row, head, split) the kv_lora_rank outputs,
// then a (max, sum) pair each (0 for one split: no partials).
inline int64_t MlaPartialFloats(const AttentionPlan& plan, int splits) {
  if (splits <= 1) return 0;
  return plan.batch.num_tokens * plan.num_heads * splits * (plan.layout.kv_lora_rank + 2);
}

// The most MLA partials any step can need (DecodeMaxPartialFloats' rule).
inline int64_t MlaMaxPartialFloats(const KvCacheLayout& layout, int64_t num_heads,
                                   int multiprocessors) {
  return detail::MaxPartialFloats(
      layout, num_heads,
      [&](const AttentionPlan& p) { return MlaDecodeSplits(p, multiprocessors); },
      MlaPartialFloats);
}

}  // namespace pdserve::kernels
