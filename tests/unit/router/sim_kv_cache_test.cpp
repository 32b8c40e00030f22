// The simulated worker's tiered cache: placement rules as the engine's tiers
// (engine/kv_tier_store.h), checked move by move.
#include "services/router/sim_kv_cache.h"

#include <gtest/gtest.h>

namespace pdserve::router {
namespace {

using Changes = std::vector<SimKvChange>;

constexpr KvTier kDev = KvTier::kDevice;
constexpr KvTier kHost = KvTier::kHost;
constexpr KvTier kDisk = KvTier::kDisk;

TEST(SimKvCacheTest, EvictionsCascadeDeviceHostDiskGone) {
  SimKvCache cache(/*device=*/1, /*host=*/1, /*disk=*/1);
  Changes changes;
  std::vector<uint64_t> stored;
  cache.Admit(std::vector<uint64_t>{1}, &changes, &stored);
  EXPECT_TRUE(changes.empty());
  EXPECT_EQ(stored, (std::vector<uint64_t>{1}));

  changes.clear();
  cache.Admit(std::vector<uint64_t>{2}, &changes, &stored);
  EXPECT_EQ(changes, (Changes{{1, kDev, false}, {1, kHost, true}}));

  changes.clear();
  cache.Admit(std::vector<uint64_t>{3}, &changes, &stored);
  EXPECT_EQ(changes,
            (Changes{{2, kDev, false}, {2, kHost, true}, {1, kHost, false}, {1, kDisk, true}}));

  changes.clear();
  cache.Admit(std::vector<uint64_t>{4}, &changes, &stored);
  EXPECT_EQ(changes, (Changes{{3, kDev, false},
                              {3, kHost, true},
                              {2, kHost, false},
                              {2, kDisk, true},
                              {1, kDisk, false}}));  // gone
  EXPECT_EQ(cache.device_size(), 1);
  EXPECT_EQ(cache.host_size(), 1);
  EXPECT_EQ(cache.disk_size(), 1);
}

TEST(SimKvCacheTest, PromptsAreServedByDevicePrefixThenLowerTierRun) {
  SimKvCache cache(2, 2, 4);
  Changes changes;
  std::vector<uint64_t> stored;
  cache.Admit(std::vector<uint64_t>{1, 2, 3, 4, 5, 6}, &changes, &stored);
  // The pool keeps the earlier (more recent) blocks 1 and 2; 3 to 6 were new
  // and evicted by the same call: never in the pool, they go nowhere.
  EXPECT_TRUE(changes.empty());
  EXPECT_EQ(stored, (std::vector<uint64_t>{1, 2}));

  stored.clear();
  cache.Admit(std::vector<uint64_t>{7, 8}, &changes, &stored);
  cache.Admit(std::vector<uint64_t>{9, 10}, &changes, &stored);
  // Device {9, 10}; host {7, 8}; disk {1, 2}.
  const std::vector<uint64_t> prompt{9, 10, 7, 8, 11};
  EXPECT_EQ(cache.DevicePrefix(prompt), 2);
  const SimLowerRun run = cache.LowerRun(prompt, 2);
  EXPECT_EQ(run.host, 2);
  EXPECT_EQ(run.disk, 0);
  const std::vector<uint64_t> from_disk{1, 2, 12};
  EXPECT_EQ(cache.DevicePrefix(from_disk), 0);
  EXPECT_EQ(cache.LowerRun(from_disk, 0).disk, 2);
  // A gap ends the run.
  EXPECT_EQ(cache.LowerRun(std::vector<uint64_t>{7, 12, 8}, 0).blocks(), 1);
}

TEST(SimKvCacheTest, OnloadCopiesAndAnEvictedCopyIsRefreshedNotStoredAgain) {
  SimKvCache cache(1, 2, 0);
  Changes changes;
  std::vector<uint64_t> stored;
  cache.Admit(std::vector<uint64_t>{1}, &changes, &stored);
  cache.Admit(std::vector<uint64_t>{2}, &changes, &stored);  // 1 -> host
  changes.clear();
  stored.clear();
  // Onload of 1: the device takes it again (new there: announced once
  // computed), the host keeps its copy; 2 goes to the host.
  cache.Admit(std::vector<uint64_t>{1}, &changes, &stored);
  EXPECT_EQ(stored, (std::vector<uint64_t>{1}));
  EXPECT_EQ(changes, (Changes{{2, kDev, false}, {2, kHost, true}}));
  EXPECT_EQ(cache.host_size(), 2);
  changes.clear();
  // 1 leaves the device again: its host copy is refreshed (no event).
  cache.Admit(std::vector<uint64_t>{3}, &changes, &stored);
  EXPECT_EQ(changes, (Changes{{1, kDev, false}}));
}

TEST(SimKvCacheTest, EachTierIsLruAndHitsRefreshLowerTierCopies) {
  SimKvCache cache(1, 2, 0);
  Changes changes;
  std::vector<uint64_t> stored;
  for (uint64_t h : {1, 2, 3}) cache.Admit(std::vector<uint64_t>{h}, &changes, &stored);
  // Host {2, 1}, 1 the least recent. Onloading 1 refreshes its host copy,
  // so when 3 comes down the host drops 2, not 1.
  cache.Admit(std::vector<uint64_t>{1}, &changes, &stored);
  changes.clear();
  cache.Admit(std::vector<uint64_t>{4}, &changes, &stored);
  // 1 leaves the device and is already in the host: refreshed.
  EXPECT_EQ(changes, (Changes{{1, kDev, false}}));
  EXPECT_EQ(cache.LowerRun(std::vector<uint64_t>{1, 3}, 0).host, 2);
  EXPECT_EQ(cache.LowerRun(std::vector<uint64_t>{2}, 0).blocks(), 0);
}

TEST(SimKvCacheTest, WithoutAHostTierEvictionsGoToDisk) {
  SimKvCache cache(1, 0, 2);
  Changes changes;
  std::vector<uint64_t> stored;
  cache.Admit(std::vector<uint64_t>{1}, &changes, &stored);
  cache.Admit(std::vector<uint64_t>{2}, &changes, &stored);
  EXPECT_EQ(changes, (Changes{{1, kDev, false}, {1, kDisk, true}}));
  SimKvCache none(1, 0, 0);
  changes.clear();
  none.Admit(std::vector<uint64_t>{1}, &changes, &stored);
  none.Admit(std::vector<uint64_t>{2}, &changes, &stored);
  EXPECT_EQ(changes, (Changes{{1, kDev, false}}));
}

TEST(SimKvCacheTest, HostAndDiskNeverHoldTheSameBlock) {
  SimKvCache cache(1, 1, 4);
  Changes changes;
  std::vector<uint64_t> stored;
  cache.Admit(std::vector<uint64_t>{1}, &changes, &stored);
  cache.Admit(std::vector<uint64_t>{2}, &changes, &stored);  // host {1}
  cache.Admit(std::vector<uint64_t>{3}, &changes, &stored);  // host {2}, disk {1}
  changes.clear();
  cache.Admit(std::vector<uint64_t>{1}, &changes, &stored);  // onload from disk
  // Host {3}, disk {2, 1}.
  changes.clear();
  cache.Admit(std::vector<uint64_t>{4}, &changes, &stored);
  // 1 leaves the device for the host, and its disk copy is dropped.
  EXPECT_EQ(changes, (Changes{{1, kDev, false},
                              {1, kDisk, false},
                              {1, kHost, true},
                              {3, kHost, false},
                              {3, kDisk, true}}));
  EXPECT_EQ(cache.host_size(), 1);
  EXPECT_EQ(cache.disk_size(), 2);  // 2 and 3
}

}  // namespace
}  // namespace pdserve::router
