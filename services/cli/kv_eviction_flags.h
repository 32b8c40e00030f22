// Token eviction and selection flags shared by `pdserve worker`, `generate`,
// `eval`, `bench engine` and `up` (common/kv_eviction.h; docs/kv-eviction.md):
// --kv-eviction, --kv-sink-tokens, --kv-window-tokens, --kv-budget-tokens,
// --kv-observation-window, --kv-selection, --kv-selection-blocks.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "common/flags.h"
#include "common/kv_eviction.h"

namespace pdserve::cli {

class KvEvictionFlags {
 public:
  void AddTo(FlagSet& flags, bool selection = true);
  // Exits 2 with one line naming the flag for an unknown mode, budgets
  // given without a mode, or a mode without its budget. What depends on
  // the model and the pool is checked when they load (Model::Load,
  // Engine::Create), which name the flag too.
  KvEviction EvictionOrExit(std::string_view command) const;
  // The same flags with their values, for a child process (`pdserve up`).
  std::vector<std::string> Args() const;

 private:
  std::string mode_ = "none";
  static constexpr int64_t kUnset = -(int64_t{1} << 62);
  int64_t sink_tokens_ = kUnset;  // 4 under streaming
  int64_t window_tokens_ = kUnset;
  int64_t budget_tokens_ = kUnset;
  int64_t observation_window_ = kUnset;
  std::string selection_ = "none";
  int64_t selection_blocks_ = kUnset;
};

}  // namespace pdserve::cli
