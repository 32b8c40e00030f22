#include "services/protocol/kv_events.h"

#include <type_traits>
#include <utility>

namespace pdserve {

proto::KvTier ToProto(KvTier tier) {
  switch (tier) {
    case KvTier::kHost:
      return proto::KV_TIER_HOST;
    case KvTier::kDisk:
      return proto::KV_TIER_DISK;
    case KvTier::kDevice:
      break;
  }
  return proto::KV_TIER_DEVICE;
}

std::optional<KvTier> FromProto(proto::KvTier tier) {
  switch (tier) {
    case proto::KV_TIER_DEVICE:
      return KvTier::kDevice;
    case proto::KV_TIER_HOST:
      return KvTier::kHost;
    case proto::KV_TIER_DISK:
      return KvTier::kDisk;
    default:
      return std::nullopt;
  }
}

void ToProto(const KvEventBatch& batch, proto::KvEvents* p) {
  p->set_sequence(batch.sequence_number);
  p->mutable_events()->Reserve(static_cast<int>(batch.events.size()));
  for (const KvEvent& event : batch.events) {
    proto::KvEvent* pe = p->add_events();
    std::visit(
        [pe](const auto& e) {
          using T = std::decay_t<decltype(e)>;
          if constexpr (std::is_same_v<T, KvStored>) {
            auto* s = pe->mutable_stored();
            s->mutable_block_hashes()->Add(e.block_hashes.begin(), e.block_hashes.end());
            if (e.parent_hash) s->set_parent_hash(*e.parent_hash);
            s->set_tier(ToProto(e.tier));
            s->set_group(e.group);
          } else if constexpr (std::is_same_v<T, KvRemoved>) {
            auto* r = pe->mutable_removed();
            r->mutable_block_hashes()->Add(e.block_hashes.begin(), e.block_hashes.end());
            r->set_tier(ToProto(e.tier));
            r->set_group(e.group);
          } else {
            static_assert(std::is_same_v<T, KvCleared>);
            pe->mutable_cleared();
          }
        },
        event);
  }
}

KvEventBatch FromProto(const proto::KvEvents& p) {
  KvEventBatch batch;
  batch.sequence_number = p.sequence();
  batch.events.reserve(static_cast<size_t>(p.events_size()));
  for (const proto::KvEvent& pe : p.events()) {
    switch (pe.kind_case()) {
      case proto::KvEvent::kStored: {
        const auto tier = FromProto(pe.stored().tier());
        if (!tier) break;  // a tier this build does not know
        KvStored s;
        s.block_hashes.assign(pe.stored().block_hashes().begin(), pe.stored().block_hashes().end());
        if (pe.stored().has_parent_hash()) s.parent_hash = pe.stored().parent_hash();
        s.tier = *tier;
        s.group = pe.stored().group();
        batch.events.emplace_back(std::move(s));
        break;
      }
      case proto::KvEvent::kRemoved: {
        const auto tier = FromProto(pe.removed().tier());
        if (!tier) break;
        KvRemoved r{{pe.removed().block_hashes().begin(), pe.removed().block_hashes().end()},
                    *tier,
                    pe.removed().group()};
        batch.events.emplace_back(std::move(r));
        break;
      }
      case proto::KvEvent::kCleared:
        batch.events.emplace_back(KvCleared{});
        break;
      default:
        break;
    }
  }
  return batch;
}

}  // namespace pdserve
