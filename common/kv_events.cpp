#include "common/kv_events.h"

#include <type_traits>

namespace pdserve {

void ApplyKvEventBatch(const KvEventBatch& batch, std::unordered_set<BlockHash>* hashes,
                       KvTier tier) {
  for (const KvEvent& event : batch.events) {
    std::visit(
        [hashes, tier](const auto& e) {
          using T = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<T, KvStored>) {
            if (e.tier == tier) hashes->insert(e.block_hashes.begin(), e.block_hashes.end());
          } else if constexpr (std::is_same_v<T, KvRemoved>) {
            if (e.tier == tier) {
              for (BlockHash h : e.block_hashes) hashes->erase(h);
            }
          } else if (tier == KvTier::kDevice) {
            hashes->clear();
          }
        },
        event);
  }
}

}  // namespace pdserve
