#include "services/router/sim_kv_cache.h"

#include <algorithm>
#include <unordered_set>

namespace pdserve::router {

bool SimKvCache::Lru::Touch(uint64_t h) {
  if (auto it = where_.find(h); it != where_.end()) {
    order_.splice(order_.begin(), order_, it->second);
    return false;
  }
  order_.push_front(h);
  where_.emplace(h, order_.begin());
  return true;
}

void SimKvCache::Lru::Erase(uint64_t h) {
  if (auto it = where_.find(h); it != where_.end()) {
    order_.erase(it->second);
    where_.erase(it);
  }
}

uint64_t SimKvCache::Lru::PopOldest() {
  const uint64_t h = order_.back();
  order_.pop_back();
  where_.erase(h);
  return h;
}

SimKvCache::SimKvCache(int64_t device_blocks, int64_t host_blocks, int64_t disk_blocks)
    : device_capacity_(device_blocks), host_capacity_(host_blocks), disk_capacity_(disk_blocks) {}

int64_t SimKvCache::DevicePrefix(std::span<const uint64_t> hashes) const {
  int64_t n = 0;
  for (uint64_t h : hashes) {
    if (!device_.contains(h)) break;
    ++n;
  }
  return n;
}

SimLowerRun SimKvCache::LowerRun(std::span<const uint64_t> hashes, int64_t from) const {
  SimLowerRun run;
  for (size_t i = static_cast<size_t>(from); i < hashes.size(); ++i) {
    if (host_.contains(hashes[i])) {
      ++run.host;
    } else if (disk_.contains(hashes[i])) {
      ++run.disk;
    } else {
      break;
    }
  }
  return run;
}

void SimKvCache::Admit(std::span<const uint64_t> hashes, std::vector<SimKvChange>* changes,
                       std::vector<uint64_t>* device_stored) {
  std::vector<uint64_t> fresh;
  for (size_t i = hashes.size(); i-- > 0;) {
    const uint64_t h = hashes[i];
    if (host_.contains(h)) host_.Touch(h);
    if (disk_.contains(h)) disk_.Touch(h);
    if (device_.Touch(h)) fresh.push_back(h);
  }
  std::vector<uint64_t> evicted;
  while (device_.size() > device_capacity_) evicted.push_back(device_.PopOldest());
  // New blocks evicted again at once were never computed into the pool.
  std::unordered_set<uint64_t> gone(evicted.begin(), evicted.end());
  std::erase_if(fresh, [&](uint64_t h) {
    if (!gone.contains(h)) return false;
    std::erase(evicted, h);
    return true;
  });
  for (uint64_t h : evicted) {
    changes->push_back({h, KvTier::kDevice, false});
    Offload(h, changes);
  }
  device_stored->insert(device_stored->end(), fresh.rbegin(), fresh.rend());
}

void SimKvCache::Offload(uint64_t h, std::vector<SimKvChange>* changes) {
  if (host_capacity_ == 0) {
    if (disk_capacity_ > 0) PutOnDisk(h, changes);
    return;
  }
  if (!host_.Touch(h)) return;  // refreshed
  if (disk_.contains(h)) {
    disk_.Erase(h);
    changes->push_back({h, KvTier::kDisk, false});
  }
  changes->push_back({h, KvTier::kHost, true});
  while (host_.size() > host_capacity_) {
    const uint64_t victim = host_.PopOldest();
    changes->push_back({victim, KvTier::kHost, false});
    if (disk_capacity_ > 0) PutOnDisk(victim, changes);
  }
}

void SimKvCache::PutOnDisk(uint64_t h, std::vector<SimKvChange>* changes) {
  if (!disk_.Touch(h)) return;
  changes->push_back({h, KvTier::kDisk, true});
  while (disk_.size() > disk_capacity_) {
    changes->push_back({disk_.PopOldest(), KvTier::kDisk, false});
  }
}

}  // namespace pdserve::router
