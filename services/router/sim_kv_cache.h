// The KV cache of one simulated worker (services/router/simulator.h): a
// device pool with a host-memory and a local-disk tier behind it, each LRU,
// with the placement rules of the engine's tiers (engine/kv_tier_store.h) so
// that the events the router sees have the same shape:
// - a block the device evicts is put into the host tier (refreshed when it is
//   already there), else into the disk tier when there is no host tier; a
//   full host tier moves its least recently used block down to disk, a full
//   disk drops its least recently used one;
// - host and disk never hold the same block; the device may hold a block
//   that a lower tier also holds (an onload copies, it does not move);
// - a prompt is served by its leading device blocks, then by the run of
//   blocks after them that a lower tier holds (onloaded), then computed.
// Block ids are the trace's hash ids, standing in for block hashes.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/kv_events.h"

namespace pdserve::router {

// One block entering or leaving one tier, in the order it happened.
struct SimKvChange {
  uint64_t hash = 0;
  KvTier tier = KvTier::kDevice;
  bool stored = true;  // false: removed
  bool operator==(const SimKvChange&) const = default;
};

// Blocks after a prompt's device prefix that come back from lower tiers.
struct SimLowerRun {
  int64_t host = 0;
  int64_t disk = 0;
  int64_t blocks() const { return host + disk; }
};

class SimKvCache {
 public:
  // Capacities in blocks; 0 for host or disk: no such tier.
  SimKvCache(int64_t device_blocks, int64_t host_blocks, int64_t disk_blocks);

  // Leading blocks of `hashes` in the device pool.
  int64_t DevicePrefix(std::span<const uint64_t> hashes) const;
  // The blocks from `from` on that the lower tiers hold, up to the first
  // they do not.
  SimLowerRun LowerRun(std::span<const uint64_t> hashes, int64_t from) const;

  // Makes `hashes` (a prompt's leading blocks) device-resident, earlier
  // blocks more recent, and refreshes the lower-tier copies of those it
  // finds there. Appends the device blocks it had to evict and where they
  // went (in order) to *changes, and the blocks new to the device to
  // *device_stored in prompt order (the caller announces them once they
  // are computed). A block that is new and evicted again by the same call
  // (a prompt longer than the pool) is in neither and goes nowhere.
  void Admit(std::span<const uint64_t> hashes, std::vector<SimKvChange>* changes,
             std::vector<uint64_t>* device_stored);

  int64_t device_size() const { return device_.size(); }
  int64_t host_size() const { return host_.size(); }
  int64_t disk_size() const { return disk_.size(); }

 private:
  // Recency order over a set of ids, bounded by the caller.
  class Lru {
   public:
    bool contains(uint64_t h) const { return where_.contains(h); }
    int64_t size() const { return static_cast<int64_t>(order_.size()); }
    // Moves `h` to the most recent end, inserting it; true when new.
    bool Touch(uint64_t h);
    void Erase(uint64_t h);
    uint64_t PopOldest();

   private:
    std::list<uint64_t> order_;  // front = most recent
    std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where_;
  };

  // A block leaving the device: into the host tier, else the disk tier.
  void Offload(uint64_t h, std::vector<SimKvChange>* changes);
  void PutOnDisk(uint64_t h, std::vector<SimKvChange>* changes);

  int64_t device_capacity_, host_capacity_, disk_capacity_;
  Lru device_, host_, disk_;
};

}  // namespace pdserve::router
