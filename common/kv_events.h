// KV events: how an engine tells the routers which prompt blocks it holds.
// One model for both ends: the engine's block manager records these, the
// router's prefix index applies them, and services/protocol/kv_events.h maps
// them to and from the control plane's KvEvents message.
//
// The block manager records one event batch per call that changes the set of
// cached block hashes (a commit, an allocation that evicted, an explicit
// eviction, a reset). Batches are numbered 1, 2, 3, ... per engine, with no
// gaps; the worker drains them and publishes them in order as `KvEvents`
// messages (docs/architecture.md section 5). A router that applies every batch in
// order to a set of hashes (ApplyKvEventBatch) holds exactly the engine's
// cached-hash set. After a gap or a reconnect it asks for a snapshot
// (KvCacheSnapshot) and then applies only the batches numbered above the
// snapshot's `last_sequence_number`.
#pragma once

#include <cstdint>
#include <optional>
#include <unordered_set>
#include <variant>
#include <vector>

#include "common/block_hash.h"

namespace pdserve {

// Where a worker holds a block: its device pool, or a lower tier (host
// memory, local disk: engine/kv_tier_store.h) from which it is copied back
// into the pool before a prompt uses it. The values are on the wire.
enum class KvTier : uint8_t { kDevice = 0, kHost = 1, kDisk = 2 };

// Full blocks whose KV became available in `tier`. Device blocks come in
// prompt order: block_hashes[0]'s parent is `parent_hash` (nullopt for the
// first block of a prompt), and each later hash's parent is the hash before
// it; lower-tier blocks come in no particular order, without a parent.
//
// Layer groups (common/kv_groups.h): the blocks of a model with several
// groups are announced per group, under their keys GroupBlockKey(hash,
// group) (the hash itself for group 0), with `group` saying which layer group
// they belong to; a stored run's parent is then the previous block's key in
// the same group. Lower-tier events carry keys too (group 0: the tiers hold
// blocks by key). Applying events and snapshots needs no group: a router
// indexes keys.
struct KvStored {
  std::vector<BlockHash> block_hashes;
  std::optional<BlockHash> parent_hash;
  KvTier tier = KvTier::kDevice;
  uint32_t group = 0;
  bool operator==(const KvStored&) const = default;
};

// Blocks that left `tier` (evicted, moved down, dropped as corrupt): their
// hashes no longer match anything there.
struct KvRemoved {
  std::vector<BlockHash> block_hashes;
  KvTier tier = KvTier::kDevice;
  uint32_t group = 0;
  bool operator==(const KvRemoved&) const = default;
};

// Every hash cached in the device pool was dropped (prefix-cache reset);
// lower tiers keep theirs.
struct KvCleared {
  bool operator==(const KvCleared&) const = default;
};

using KvEvent = std::variant<KvStored, KvRemoved, KvCleared>;

// The events of one state change, applied in order.
struct KvEventBatch {
  uint64_t sequence_number = 0;  // 1 for the engine's first batch, +1 per batch
  std::vector<KvEvent> events;
  bool operator==(const KvEventBatch&) const = default;
};

// Every hash (key, for several layer groups) cached at the moment the batch
// numbered `last_sequence_number` was recorded (0: before any batch), in no
// particular order: in the device pool, and in the lower tiers.
struct KvCacheSnapshot {
  uint64_t last_sequence_number = 0;
  std::vector<BlockHash> block_hashes;  // device
  std::vector<BlockHash> host_block_hashes;
  std::vector<BlockHash> disk_block_hashes;
};

// Applies one batch to a replica of one tier's cached-hash set (what a router
// keeps per worker and tier): events of other tiers are skipped. Idempotent
// in the sense that matters for Resync: applying a batch already reflected
// in `hashes` leaves it unchanged.
void ApplyKvEventBatch(const KvEventBatch& batch, std::unordered_set<BlockHash>* hashes,
                       KvTier tier = KvTier::kDevice);

}  // namespace pdserve
