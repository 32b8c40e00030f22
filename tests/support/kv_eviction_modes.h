// The worker's eviction modes (common/kv_eviction.h) as tests write them.
#pragma once

#include <cstdint>

#include "common/kv_eviction.h"
#include "engine/make_model.h"

namespace pdserve::testing {

inline KvEviction Streaming(int64_t sinks, int64_t window) {
  KvEviction e;
  e.mode = KvEviction::Mode::kStreaming;
  e.sink_tokens = sinks;
  e.window_tokens = window;
  return e;
}

inline KvEviction SnapKv(int64_t budget, int64_t observation_window) {
  KvEviction e;
  e.mode = KvEviction::Mode::kSnapKv;
  e.budget_tokens = budget;
  e.observation_window = observation_window;
  return e;
}

inline KvEviction Quest(int64_t blocks) {
  KvEviction e;
  e.quest_blocks = blocks;
  return e;
}

// The tiny preset (4 query heads over 2 KV heads) with two more layers:
// Quest reads every block in the first kQuestDenseLayers, so its tests need
// layers past them.
inline ModelSpec TinyForQuest() {
  ModelSpec s = *PresetModelSpec("tiny");
  s.num_layers = kQuestDenseLayers + 2;
  return s;
}

}  // namespace pdserve::testing
