#include "common/kv_events.h"

#include <type_traits>

namespace pdserve {

void ApplyKvEventBatch(const KvEventBatch& batch, std::unordered_set<BlockHash>* hashes) {
  for (const KvEvent& event : batch.events) {
    std::visit(
        [hashes](const auto& e) {
          using T = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<T, KvStored>) {
            hashes->insert(e.block_hashes.begin(), e.block_hashes.end());
          } else if constexpr (std::is_same_v<T, KvRemoved>) {
            for (BlockHash h : e.block_hashes) hashes->erase(h);
          } else {
            hashes->clear();
          }
        },
        event);
  }
}

}  // namespace pdserve
