// Token-level KV eviction modes of a worker (docs/kv-eviction.md): which
// tokens' keys and values each sequence keeps, chosen once per worker with
// --kv-eviction and announced to the router and to transfer peers, since a
// worker with another mode computes other KV for the same tokens.
//
// streaming (StreamingLLM, Xiao et al. 2023): each sequence keeps its first
// `sink_tokens` tokens (the attention sinks) and its last `window_tokens`;
// the query at position p attends to positions [0, S) and p-N+1 .. p, with
// the positions of the keys numbered by their rank in that cache
// (kernels/step.h, AttentionBatch::sinks), so a sequence may run far past
// the model's trained context. A plain window is streaming with 0 sinks.
//
// snapkv (SnapKV, Li et al. 2024): when a prompt longer than
// `budget_tokens` (B) finishes prefill, each layer and KV head keeps the
// B - W prompt positions that the prompt's last `observation_window` (W)
// queries attended to most, plus those last W; the rest is released. The
// score of a position is its softmax weight summed over the W queries and
// the query heads of the KV head's group, then max-pooled over positions
// with a kernel of 7 (engine/snapkv.h). Kept keys keep their own rotation,
// and decoding continues at the true positions.
//
// Quest (Tang et al. 2024; --kv-selection quest, quest_blocks = K) keeps
// every token but has each decode query head read only the K blocks whose
// keys can score highest, by per-channel key bounds, plus the newest block
// (kernels/step.h, AttentionBatch::quest_blocks): it saves reads, not
// memory. The first kQuestDenseLayers layers attend densely, as the
// authors' code has them (its `_quest_skip_layer`): their attention is
// spread too widely for a few blocks to stand for the rest.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace pdserve {

inline constexpr int64_t kQuestDenseLayers = 2;

struct KvEviction {
  enum class Mode { kNone, kStreaming, kSnapKv };
  Mode mode = Mode::kNone;
  int64_t sink_tokens = 0;         // streaming: S >= 0
  int64_t window_tokens = 0;       // streaming: N > 0
  int64_t budget_tokens = 0;       // snapkv: B >= W
  int64_t observation_window = 0;  // snapkv: W >= 1
  int64_t quest_blocks = 0;        // Quest's K; 0: no selection

  bool enabled() const { return mode != Mode::kNone || quest_blocks > 0; }
  // "" for none; "streaming sinks=4 window=64", "snapkv budget=64
  // window=8", "quest blocks=8" (logs, layouts, registration).
  std::string Describe() const;
};

// "none", "streaming" or "snapkv"; nullopt otherwise.
std::optional<KvEviction::Mode> ParseKvEvictionMode(std::string_view name);
std::string_view KvEvictionModeName(KvEviction::Mode mode);

}  // namespace pdserve
