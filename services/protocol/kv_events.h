// KV events (common/kv_events.h) on the wire: a KvEventBatch is one KvEvents
// message, event for event, so that what a worker's block manager recorded
// is exactly what a router's prefix index applies.
#pragma once

#include <optional>

#include "common/kv_events.h"
#include "common/proto/pdserve.pb.h"

namespace pdserve {

void ToProto(const KvEventBatch& batch, proto::KvEvents* p);
proto::KvTier ToProto(KvTier tier);
// nullopt for a value this build does not know.
std::optional<KvTier> FromProto(proto::KvTier tier);
// An event whose kind this build does not know (none set, or a newer one) is
// skipped: the rest of the batch still applies.
KvEventBatch FromProto(const proto::KvEvents& p);

}  // namespace pdserve
