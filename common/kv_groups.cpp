#include "common/kv_groups.h"

#include <algorithm>
#include <map>
#include <numeric>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace pdserve {

KvGroups KvGroups::FromLayerWindows(std::span<const int64_t> layer_windows) {
  KvGroups g;
  if (layer_windows.empty()) return g;
  std::map<int64_t, std::vector<int64_t>> by_window;
  for (size_t l = 0; l < layer_windows.size(); ++l) {
    by_window[std::max<int64_t>(layer_windows[l], 0)].push_back(static_cast<int64_t>(l));
  }
  int64_t size = 0;
  for (const auto& [window, layers] : by_window) {
    size = std::gcd(size, static_cast<int64_t>(layers.size()));
  }
  g.layers_per_group = size;
  std::vector<std::pair<int64_t, std::vector<int64_t>>> groups;
  for (const auto& [window, layers] : by_window) {
    for (size_t at = 0; at < layers.size(); at += static_cast<size_t>(size)) {
      groups.emplace_back(window,
                          std::vector<int64_t>(layers.begin() + at, layers.begin() + at + size));
    }
  }
  std::sort(groups.begin(), groups.end(),
            [](const auto& a, const auto& b) { return a.second.front() < b.second.front(); });
  g.group_of_layer.assign(layer_windows.size(), 0);
  g.slot_of_layer.assign(layer_windows.size(), 0);
  for (size_t i = 0; i < groups.size(); ++i) {
    g.windows.push_back(groups[i].first);
    for (size_t s = 0; s < groups[i].second.size(); ++s) {
      g.group_of_layer[groups[i].second[s]] = static_cast<int32_t>(i);
      g.slot_of_layer[groups[i].second[s]] = static_cast<int32_t>(s);
    }
    g.layers.push_back(std::move(groups[i].second));
  }
  return g;
}

KvGroups KvGroups::Full(int64_t layers) {
  return FromLayerWindows(std::vector<int64_t>(static_cast<size_t>(std::max<int64_t>(layers, 0))));
}

bool KvGroups::any_windowed() const {
  return std::any_of(windows.begin(), windows.end(), [](int64_t w) { return w > 0; });
}

std::string KvGroups::Describe() const {
  std::string s = std::to_string(size()) + (size() == 1 ? " group of " : " groups of ") +
                  std::to_string(layers_per_group) + " layers:";
  for (size_t i = 0; i < windows.size(); ++i) {
    s += (i == 0 ? " " : ", ");
    s += windows[i] > 0 ? "window " + std::to_string(windows[i]) : "full";
  }
  return s;
}

BlockHash GroupBlockKey(BlockHash hash, uint32_t group) {
  if (group == 0) return hash;
  unsigned char buf[8];
  for (int i = 0; i < 8; ++i) buf[i] = static_cast<unsigned char>(hash >> (8 * i));
  return XXH3_64bits_withSeed(buf, sizeof(buf), group);
}

size_t CachedPrefixBlocks(std::span<const int64_t> windows, size_t block_size, size_t limit,
                          const std::function<bool(size_t group, size_t block)>& held,
                          int64_t sink_tokens) {
  const int64_t B = static_cast<int64_t>(block_size);
  size_t k = limit;
  // Sink blocks are needed by every windowed group's query: a prefix holds
  // no more than the run of them that is held.
  const auto sinks = static_cast<size_t>(SinkBlocks(sink_tokens, B));
  for (size_t g = 0; g < windows.size(); ++g) {
    if (windows[g] <= 0) continue;
    size_t n = 0;
    while (n < std::min(k, sinks) && held(g, n)) ++n;
    if (n < std::min(k, sinks)) k = n;
  }
  // Per windowed group, whether each block below the first k is held, and
  // the run of held blocks ending at each index (computed once, for the
  // first limit blocks; k only shrinks).
  std::vector<std::vector<size_t>> runs(windows.size());
  for (size_t g = 0; g < windows.size(); ++g) {
    if (windows[g] > 0) {
      runs[g].resize(limit);
      for (size_t i = 0; i < limit; ++i) {
        runs[g][i] = held(g, i) ? (i > 0 ? runs[g][i - 1] : 0) + 1 : 0;
      }
    } else {
      size_t n = 0;
      while (n < k && held(g, n)) ++n;
      k = n;
    }
  }
  // A windowed group's rule is not monotone in k (a shorter prefix may need
  // blocks a longer one does not), so shrink k until every group agrees.
  for (bool changed = true; changed && k > 0;) {
    changed = false;
    for (size_t g = 0; g < windows.size() && k > 0; ++g) {
      if (windows[g] <= 0) continue;
      size_t best = k;
      while (best > 0) {
        // The window's blocks below best, not counting those the sinks hold.
        const int64_t first =
            std::max(FirstBlockInReach(windows[g], static_cast<int64_t>(best) * B, B),
                     std::min<int64_t>(static_cast<int64_t>(sinks), static_cast<int64_t>(best)));
        const int64_t need = static_cast<int64_t>(best) - first;
        if (static_cast<int64_t>(runs[g][best - 1]) >= need) break;
        --best;
      }
      if (best != k) {
        k = best;
        changed = true;
      }
    }
  }
  return k;
}

}  // namespace pdserve
