#include "common/kv_eviction.h"

namespace pdserve {

std::string KvEviction::Describe() const {
  std::string s;
  if (mode == Mode::kSnapKv) {
    s = "snapkv budget=" + std::to_string(budget_tokens) +
        " window=" + std::to_string(observation_window);
  } else if (mode != Mode::kNone) {
    s = std::string(KvEvictionModeName(mode)) + " sinks=" + std::to_string(sink_tokens) +
        " window=" + std::to_string(window_tokens);
  }
  if (quest_blocks > 0)
    s += (s.empty() ? "" : " ") + ("quest blocks=" + std::to_string(quest_blocks));
  return s;
}

std::optional<KvEviction::Mode> ParseKvEvictionMode(std::string_view name) {
  if (name == "none") return KvEviction::Mode::kNone;
  if (name == "streaming") return KvEviction::Mode::kStreaming;
  if (name == "snapkv") return KvEviction::Mode::kSnapKv;
  return std::nullopt;
}

std::string_view KvEvictionModeName(KvEviction::Mode mode) {
  switch (mode) {
    case KvEviction::Mode::kStreaming:
      return "streaming";
    case KvEviction::Mode::kSnapKv:
      return "snapkv";
    default:
      return "none";
  }
}

}  // namespace pdserve
