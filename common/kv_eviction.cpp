#include "common/kv_eviction.h"

namespace pdserve {

std::string KvEviction::Describe() const {
  if (mode == Mode::kNone) return "";
  return std::string(KvEvictionModeName(mode)) + " sinks=" + std::to_string(sink_tokens) +
         " window=" + std::to_string(window_tokens);
}

std::optional<KvEviction::Mode> ParseKvEvictionMode(std::string_view name) {
  if (name == "none") return KvEviction::Mode::kNone;
  if (name == "streaming") return KvEviction::Mode::kStreaming;
  return std::nullopt;
}

std::string_view KvEvictionModeName(KvEviction::Mode mode) {
  return mode == KvEviction::Mode::kStreaming ? "streaming" : "none";
}

}  // namespace pdserve
