// Greedy requests through the engine as the KV eviction and window tests run them,
// a hand-off's blocks moved between two engines' pools as a KV transfer
// would, and the reference's kept sets in the engine's order.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "engine/engine.h"

namespace pdserve::testing {

// What one greedy request produced, and what the engine held for it when
// its first token came out (a prompt over the budget is compressed by then).
struct Generated {
  std::vector<SampledToken> sampled;
  std::vector<std::vector<int32_t>> kept;  // Engine::SnapKvKept, [layer * KV heads + head]
  int64_t cached_tokens = 0;               // the prompt's prefix-cache hits
  size_t held_after_prompt = 0;            // blocks the request held then
  int64_t blocks_released = 0;             // when it finished
  FinishReason finish = FinishReason::kNone;
};

// One greedy request with logprobs (ignoring EOS), stepped to the end;
// `after_step` runs after every engine step.
inline Generated Generate(Engine& e, RequestId id, const std::vector<int32_t>& prompt,
                          int max_tokens, const std::function<void()>& after_step = {}) {
  EngineRequest r;
  r.id = id;
  r.prompt = prompt;
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.params.logprobs = 0;
  EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
  Generated g;
  while (e.HasUnfinished()) {
    auto step = e.Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step) {
      if (o.id != id) continue;
      if (!o.new_token_ids.empty() && g.sampled.empty()) {
        g.cached_tokens = o.num_cached_tokens;
        g.kept = e.SnapKvKept(id);
        if (e.block_manager().HasSequence(id)) {
          const auto& t = e.block_manager().BlockTable(id);
          g.held_after_prompt = static_cast<size_t>(
              std::count_if(t.begin(), t.end(), [](BlockId b) { return b != kNoBlock; }));
        }
      }
      g.sampled.insert(g.sampled.end(), o.logprobs.begin(), o.logprobs.end());
      if (o.finished) {
        g.blocks_released = o.kv_blocks_released;
        g.finish = o.finish_reason;
      }
    }
    if (after_step) after_step();
  }
  return g;
}

// Copies the blocks the prefill-only request `done` left in `prefill`'s
// pool into those `plan` gave it in `decode`'s, matched by block index (what
// a KV transfer moves), then releases the prefill side's pin.
inline void MoveHandedOffBlocks(Engine& prefill, const RequestOutput& done,
                                const RemotePrefillPlan& plan, Engine& decode) {
  ASSERT_TRUE(done.kv_pin.has_value());
  ASSERT_EQ(done.kv_slots.size(), plan.fill.size());
  const auto bytes = static_cast<size_t>(prefill.kv_pool().bytes_per_block());
  for (const BlockSlot& to : plan.fill) {
    auto from = std::find_if(done.kv_slots.begin(), done.kv_slots.end(),
                             [&](const BlockSlot& s) { return s.index == to.index; });
    ASSERT_NE(from, done.kv_slots.end());
    std::memcpy(decode.kv_pool().block(to.block), prefill.kv_pool().block(from->block), bytes);
  }
  ASSERT_TRUE(prefill.ReleaseKvBlocks(*done.kv_pin).ok());
}

// The reference's kept sets, [layer][KV head], as the engine lists them.
inline std::vector<std::vector<int32_t>> Flatten(
    const std::vector<std::vector<std::vector<int64_t>>>& kept) {
  std::vector<std::vector<int32_t>> out;
  for (const auto& layer : kept) {
    for (const auto& head : layer) out.emplace_back(head.begin(), head.end());
  }
  return out;
}

}  // namespace pdserve::testing
