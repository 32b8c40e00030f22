// ApplyKvEventBatch: the replay a router does per worker, and the
// idempotence that lets it apply batches already covered by a snapshot.
#include "common/kv_events.h"

#include <gtest/gtest.h>

#include <random>
#include <unordered_set>

namespace pdserve {
namespace {

TEST(KvEventsTest, StoredRemovedClearedInOrder) {
  std::unordered_set<BlockHash> set = {1};
  KvEventBatch batch{
      7,
      {KvStored{{10, 11, 12}, std::nullopt}, KvRemoved{{11, 99}}, KvStored{{13}, BlockHash{12}}}};
  ApplyKvEventBatch(batch, &set);
  EXPECT_EQ(set, (std::unordered_set<BlockHash>{1, 10, 12, 13}));
  ApplyKvEventBatch({8, {KvCleared{}, KvStored{{5}, std::nullopt}}}, &set);
  EXPECT_EQ(set, (std::unordered_set<BlockHash>{5}));
}

// Random batches over a small hash space: applying a batch to a set that
// already reflects it changes nothing, and the result equals an independent
// per-hash "last event wins" evaluation.
TEST(KvEventsTest, ReplayIsIdempotentAndLastEventWins) {
  std::mt19937_64 rng(4);
  for (int trial = 0; trial < 500; ++trial) {
    KvEventBatch batch{static_cast<uint64_t>(trial + 1), {}};
    for (int e = static_cast<int>(rng() % 6); e > 0; --e) {
      std::vector<BlockHash> hashes;
      for (int h = 1 + static_cast<int>(rng() % 4); h > 0; --h) hashes.push_back(rng() % 12);
      switch (rng() % 5) {
        case 0:
          batch.events.push_back(KvCleared{});
          break;
        case 1:
        case 2:
          batch.events.push_back(KvRemoved{hashes});
          break;
        default:
          batch.events.push_back(KvStored{hashes, std::nullopt});
      }
    }
    std::unordered_set<BlockHash> start;
    for (BlockHash h = 0; h < 12; ++h) {
      if (rng() % 2) start.insert(h);
    }
    // Reference: membership of each hash after the batch.
    std::unordered_set<BlockHash> expected;
    for (BlockHash h = 0; h < 12; ++h) {
      bool in = start.count(h) > 0;
      for (const auto& ev : batch.events) {
        if (std::holds_alternative<KvCleared>(ev)) in = false;
        if (auto* s = std::get_if<KvStored>(&ev)) {
          for (BlockHash x : s->block_hashes) in = in || x == h;
        }
        if (auto* r = std::get_if<KvRemoved>(&ev)) {
          for (BlockHash x : r->block_hashes) in = in && x != h;
        }
      }
      if (in) expected.insert(h);
    }
    auto once = start;
    ApplyKvEventBatch(batch, &once);
    EXPECT_EQ(once, expected);
    auto twice = once;
    ApplyKvEventBatch(batch, &twice);
    EXPECT_EQ(twice, once);
  }
}

}  // namespace
}  // namespace pdserve
