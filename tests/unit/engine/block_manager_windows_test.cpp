// The block manager with layer groups (common/kv_groups.h): windowed groups
// hold only the blocks later queries reach, released blocks stay cached
// until evicted, a prefix is a hit by the windowed rule, and every event
// names its group and key.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <unordered_set>

#include "common/kv_groups.h"
#include "engine/block_manager.h"

namespace pdserve {
namespace {

std::unique_ptr<BlockManager> Make(size_t blocks, size_t block_size, std::vector<int64_t> windows) {
  BlockManagerOptions o;
  o.num_blocks = blocks;
  o.block_size = block_size;
  o.group_windows = std::move(windows);
  auto bm = BlockManager::Create(o);
  EXPECT_TRUE(bm.ok()) << bm.status().ToString();
  return std::move(bm).value();
}

size_t Held(const BlockManager& bm, SeqId seq, uint32_t group) {
  const auto& t = bm.BlockTable(seq, group);
  return static_cast<size_t>(
      std::count_if(t.begin(), t.end(), [](BlockId b) { return b != kNoBlock; }));
}

std::vector<BlockHash> Hashes(size_t n, BlockHash base) {
  std::vector<BlockHash> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = base + i * 7919;
  return h;
}

// Decoding far past the window: the windowed group holds the blocks of the
// last W-1 positions and the current one, never more; the full group all.
TEST(BlockManagerWindowsTest, WindowedGroupHoldsOnlyWhatQueriesReach) {
  const size_t B = 4, W = 10;
  auto bm = Make(200, B, {0, static_cast<int64_t>(W)});
  ASSERT_TRUE(bm->Admit({1, {}, 5, 0, {}, {}}).ok());
  EXPECT_EQ(Held(*bm, 1, 0), 2u);
  EXPECT_EQ(Held(*bm, 1, 1), 2u);
  const size_t bound = (W - 1 + B - 1) / B + 1;  // ceil((W-1)/B) + 1
  for (size_t pos = 5; pos < 8 * W; ++pos) {
    ASSERT_TRUE(bm->AllocateSlots(1, pos + 1, pos).ok());
    const size_t first = static_cast<size_t>(FirstBlockInReach(W, pos, B));
    EXPECT_EQ(Held(*bm, 1, 1), pos / B + 1 - first) << pos;
    EXPECT_LE(Held(*bm, 1, 1), bound) << pos;
    EXPECT_EQ(Held(*bm, 1, 0), pos / B + 1) << pos;
    const auto& t = bm->BlockTable(1, 1);
    for (size_t i = 0; i < t.size(); ++i)
      EXPECT_EQ(t[i] != kNoBlock, i >= first) << pos << " " << i;
    ASSERT_TRUE(bm->CheckInvariants().ok()) << bm->CheckInvariants().ToString();
  }
  const auto stats = bm->GetStats();
  EXPECT_EQ(stats.used_blocks, Held(*bm, 1, 0) + Held(*bm, 1, 1));
  ASSERT_TRUE(bm->Free(1).ok());
  EXPECT_EQ(bm->GetStats().used_blocks, 0u);
}

// A long prompt computed in chunks and committed: its windowed blocks leave
// the sequence but stay cached (evictable), so the same prompt again is a
// hit by the windowed rule and reuses exactly the blocks the rule names.
TEST(BlockManagerWindowsTest, RepeatedPromptHitsThroughReleasedWindowedBlocks) {
  const size_t B = 4, W = 6;
  auto bm = Make(100, B, {static_cast<int64_t>(W), 0});
  const auto hashes = Hashes(10, 100);  // 40 tokens
  AdmitRequest req{1, {}, 8, 40, {}, {}};
  ASSERT_TRUE(bm->Admit(req).ok());
  for (size_t done = 8; done <= 40; done += 8) {
    ASSERT_TRUE(bm->CommitBlocks(1, std::span(hashes).first(done / B)).ok());
    if (done < 40) {
      ASSERT_TRUE(bm->AllocateSlots(1, done + 8, done).ok());
    }
  }
  ASSERT_TRUE(bm->CheckInvariants().ok());
  // Released windowed blocks of the early prompt are cached, not held.
  EXPECT_TRUE(bm->IsCached(hashes[0], 0));
  EXPECT_TRUE(bm->IsCached(hashes[0], 1));
  EXPECT_GT(bm->GetStats().evictable_blocks, 0u);
  ASSERT_TRUE(bm->Free(1).ok());
  EXPECT_EQ(bm->FindCachedPrefix(hashes), 10u);
  auto again = bm->Admit({2, hashes, 41, 41, {}, {}});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->num_cached_blocks, 10u);
  EXPECT_EQ(bm->GetStats().prefix_cache_hit_tokens, 40u);
  // The windowed group took only the blocks of the last W-1 tokens.
  const size_t first = static_cast<size_t>(FirstBlockInReach(W, 40, B));
  EXPECT_EQ(first, 8u);
  EXPECT_EQ(Held(*bm, 2, 0), 11u - first);  // group 0 is the windowed one here
  EXPECT_EQ(Held(*bm, 2, 1), 11u);
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

// Losing the early windowed blocks (out of the last query's reach) keeps the
// whole prompt a hit, but a shorter prefix of it, whose last query reaches
// back into them, is not: the windowed rule is not monotone.
TEST(BlockManagerWindowsTest, HitFollowsTheWindowedRule) {
  const size_t B = 2, W = 5;
  auto bm = Make(64, B, {0, static_cast<int64_t>(W)});
  const auto hashes = Hashes(8, 5);
  ASSERT_TRUE(bm->Admit({1, {}, 4, 0, {}, {}}).ok());
  for (size_t done = 4; done <= 16; done += 4) {
    ASSERT_TRUE(bm->CommitBlocks(1, std::span(hashes).first(done / B)).ok());
    if (done < 16) {
      ASSERT_TRUE(bm->AllocateSlots(1, done + 4, done).ok());
    }
  }
  // Sequence 1 still holds every full block and the windowed tail; the
  // windowed blocks it released are the only evictable ones.
  const size_t released = bm->GetStats().evictable_blocks;
  EXPECT_EQ(released, static_cast<size_t>(FirstBlockInReach(W, 12, B)));
  EXPECT_EQ(bm->Evict(1000), released);
  EXPECT_FALSE(bm->IsCached(hashes[0], 1));
  EXPECT_TRUE(bm->IsCached(hashes[0], 0));
  EXPECT_EQ(bm->FindCachedPrefix(hashes), 8u);
  auto held = [&](size_t g, size_t i) { return bm->IsCached(hashes[i], static_cast<uint32_t>(g)); };
  const std::vector<int64_t> windows{0, static_cast<int64_t>(W)};
  const auto shorter = std::span(hashes).first(4);
  const size_t k = bm->FindCachedPrefix(shorter);
  EXPECT_EQ(k, CachedPrefixBlocks(windows, B, 4, held));
  EXPECT_LT(k, 4u);
}

// Events name the group, carry keys, chain parents per group, and a replica
// replaying them equals the snapshot.
TEST(BlockManagerWindowsTest, EventsCarryGroupsAndKeys) {
  const size_t B = 2;
  auto bm = Make(8, B, {0, 3});
  const auto hashes = Hashes(3, 9);
  ASSERT_TRUE(bm->Admit({1, {}, 6, 0, {}, {}}).ok());
  ASSERT_TRUE(bm->CommitBlocks(1, hashes).ok());
  auto batches = bm->DrainEvents();
  ASSERT_EQ(batches.size(), 1u);
  ASSERT_EQ(batches[0].events.size(), 2u);
  const auto& full = std::get<KvStored>(batches[0].events[0]);
  const auto& win = std::get<KvStored>(batches[0].events[1]);
  EXPECT_EQ(full.group, 0u);
  EXPECT_EQ(full.block_hashes, hashes);
  EXPECT_FALSE(full.parent_hash.has_value());
  EXPECT_EQ(win.group, 1u);
  EXPECT_EQ(win.block_hashes,
            (std::vector<BlockHash>{GroupBlockKey(hashes[0], 1), GroupBlockKey(hashes[1], 1),
                                    GroupBlockKey(hashes[2], 1)}));
  // Fill the pool with another sequence: evictions come out per group.
  ASSERT_TRUE(bm->Free(1).ok());
  ASSERT_TRUE(bm->Admit({2, {}, 8, 0, {}, {}}).ok());
  std::unordered_set<BlockHash> replica;
  ApplyKvEventBatch(batches[0], &replica);
  for (const auto& b : bm->DrainEvents()) {
    for (const auto& e : b.events) {
      if (const auto* r = std::get_if<KvRemoved>(&e)) {
        for (BlockHash k : r->block_hashes) {
          EXPECT_EQ(k == GroupBlockKey(hashes[0], 1) || k == GroupBlockKey(hashes[1], 1) ||
                        k == GroupBlockKey(hashes[2], 1),
                    r->group == 1);
        }
      }
    }
    ApplyKvEventBatch(b, &replica);
  }
  const auto snap = bm->Snapshot();
  EXPECT_EQ(replica,
            std::unordered_set<BlockHash>(snap.block_hashes.begin(), snap.block_hashes.end()));
}

// computed_tokens: the blocks a peer (or a lower tier) fills are returned,
// and a windowed group gets none before the first query's reach.
TEST(BlockManagerWindowsTest, ComputedTokensListsTheBlocksToFill) {
  const size_t B = 4, W = 6;
  auto bm = Make(64, B, {0, static_cast<int64_t>(W)});
  const auto hashes = Hashes(8, 77);
  // Cache the first 2 blocks.
  ASSERT_TRUE(bm->Admit({1, {}, 8, 0, {}, {}}).ok());
  ASSERT_TRUE(bm->CommitBlocks(1, std::span(hashes).first(2)).ok());
  ASSERT_TRUE(bm->Free(1).ok());
  // A prompt of 30 tokens whose KV a peer writes: 8 cached, 22 to fill.
  AdmitRequest req{2, std::span(hashes).first(7), 30, 0, 30, {}};
  auto r = bm->Admit(req);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->num_cached_blocks, 2u);
  const size_t first = static_cast<size_t>(FirstBlockInReach(W, 30, B));  // 25 / 4 = 6
  std::vector<BlockSlot> expected;
  for (size_t i = 2; i < 8; ++i) {
    expected.push_back({0, i, bm->BlockTable(2, 0)[i]});
    if (i >= first) expected.push_back({1, i, bm->BlockTable(2, 1)[i]});
  }
  EXPECT_EQ(r->to_fill, expected);
  EXPECT_EQ(Held(*bm, 2, 1), 8 - first);
  // Pins hold every group's entries from a given index.
  auto pin = bm->Pin(2, 2);
  ASSERT_TRUE(pin.ok());
  EXPECT_EQ(bm->PinnedSlots(*pin), expected);
  ASSERT_TRUE(bm->Free(2).ok());
  ASSERT_TRUE(bm->CheckInvariants().ok());
  ASSERT_TRUE(bm->Unpin(*pin).ok());
  EXPECT_EQ(bm->GetStats().used_blocks, 0u);
  // Out of range.
  EXPECT_EQ(bm->Admit({3, hashes, 30, 0, 31, {}}).status().code(), StatusCode::kInvalidArgument);
}

// Random traffic over shared prefixes on a small pool: invariants hold,
// FindCachedPrefix is the rule over what is cached, windowed groups never
// hold more than their reach, events replay to the snapshot.
TEST(BlockManagerWindowsTest, RandomTrafficKeepsInvariants) {
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    std::mt19937_64 rng(seed);
    const size_t B = 1 + rng() % 4;
    std::vector<int64_t> windows{static_cast<int64_t>(2 + rng() % 9), 0,
                                 static_cast<int64_t>(2 + rng() % 9)};
    auto bm = Make(60, B, windows);
    std::vector<std::vector<BlockHash>> bases;
    for (int i = 0; i < 3; ++i) bases.push_back(Hashes(12, 1000 * (i + 1)));
    struct Live {
      std::vector<BlockHash> hashes;
      size_t len = 0, computed = 0;
    };
    std::map<SeqId, Live> live;
    std::unordered_set<BlockHash> replica;
    SeqId next = 1;
    for (int step = 0; step < 600; ++step) {
      const int op = static_cast<int>(rng() % 10);
      if (op < 3 || live.empty()) {
        Live s;
        s.hashes = bases[rng() % bases.size()];
        s.len = (1 + rng() % 12) * B;
        const size_t limit = s.len / B - (s.len % B == 0 ? 1 : 0);
        const auto prefix = std::span(s.hashes).first(std::min(limit, s.hashes.size()));
        const size_t expect_hit = bm->FindCachedPrefix(prefix);
        auto held = [&](size_t g, size_t i) {
          return bm->IsCached(prefix[i], static_cast<uint32_t>(g));
        };
        ASSERT_EQ(expect_hit, CachedPrefixBlocks(windows, B, prefix.size(), held));
        auto r = bm->Admit({next, prefix, std::min(s.len, expect_hit * B + 2 * B), 0, {}, {}});
        if (r.ok()) {
          ASSERT_EQ(r->num_cached_blocks, expect_hit);
          s.computed = expect_hit * B;
          live[next] = s;
        } else {
          ASSERT_EQ(r.status().code(), StatusCode::kResourceExhausted);
        }
        ++next;
      } else if (op < 8) {
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        Live& s = it->second;
        const auto& t0 = bm->BlockTable(it->first, 0);
        const size_t covered = t0.size() * B;
        if (s.computed < covered) {
          s.computed = std::min(covered, s.computed + 1 + rng() % (2 * B));
          const size_t full = std::min(s.computed / B, s.hashes.size());
          ASSERT_TRUE(bm->CommitBlocks(it->first, std::span(s.hashes).first(full)).ok());
        }
        const Status st =
            bm->AllocateSlots(it->first, s.computed + 1 + rng() % (2 * B), s.computed);
        ASSERT_TRUE(st.ok() || st.code() == StatusCode::kResourceExhausted) << st.ToString();
        for (size_t g = 0; g < windows.size(); ++g) {
          const auto& t = bm->BlockTable(it->first, static_cast<uint32_t>(g));
          const size_t first = static_cast<size_t>(FirstBlockInReach(
              windows[g], static_cast<int64_t>(s.computed), static_cast<int64_t>(B)));
          for (size_t i = 0; i < t.size(); ++i) {
            ASSERT_EQ(t[i] != kNoBlock, windows[g] == 0 || i >= std::min(first, t.size()))
                << "group " << g << " entry " << i;
          }
        }
      } else if (op < 9) {
        auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
        ASSERT_TRUE(bm->Free(it->first).ok());
        live.erase(it);
      } else {
        bm->Evict(rng() % 4);
      }
      const Status inv = bm->CheckInvariants();
      ASSERT_TRUE(inv.ok()) << "seed " << seed << " step " << step << ": " << inv.ToString();
      for (const auto& b : bm->DrainEvents()) ApplyKvEventBatch(b, &replica);
      const auto snap = bm->Snapshot();
      ASSERT_EQ(replica,
                std::unordered_set<BlockHash>(snap.block_hashes.begin(), snap.block_hashes.end()));
    }
  }
}

}  // namespace
}  // namespace pdserve
