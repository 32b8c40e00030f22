// Edge cases of the block manager, one behaviour per test. The randomized
// property test lives in block_manager_property_test.cpp.
#include "engine/block_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <unordered_set>
#include <vector>

#include "common/block_hash.h"

namespace pdserve {
namespace {

constexpr size_t kBs = 4;

std::unique_ptr<BlockManager> Make(size_t num_blocks, bool caching = true, bool events = true) {
  BlockManagerOptions o;
  o.num_blocks = num_blocks;
  o.block_size = kBs;
  o.enable_prefix_caching = caching;
  o.record_kv_events = events;
  auto bm = BlockManager::Create(o);
  EXPECT_TRUE(bm.ok()) << bm.status().ToString();
  return std::move(bm).value();
}

std::vector<TokenId> Tokens(size_t n, TokenId first = 100) {
  std::vector<TokenId> t(n);
  std::iota(t.begin(), t.end(), first);
  return t;
}

// Hashes of the full blocks of `tokens` (the reference spec implementation).
std::vector<BlockHash> Hashes(const std::vector<TokenId>& tokens) {
  return HashPrompt(BlockHashSeed("test-model"), tokens, kBs);
}

AdmitResult AdmitOk(BlockManager& bm, SeqId seq, const std::vector<BlockHash>& hashes,
                    size_t num_tokens, size_t stats_tokens = 0) {
  auto r = bm.Admit({seq, hashes, num_tokens, stats_tokens, {}, {}});
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? *r : AdmitResult{};
}

std::vector<BlockHash> RemovedHashes(const std::vector<KvEventBatch>& batches) {
  std::vector<BlockHash> out;
  for (const auto& b : batches) {
    for (const auto& e : b.events) {
      if (auto* r = std::get_if<KvRemoved>(&e)) {
        out.insert(out.end(), r->block_hashes.begin(), r->block_hashes.end());
      }
    }
  }
  return out;
}

TEST(BlockManagerTest, RejectsEmptyPoolAndZeroBlockSize) {
  BlockManagerOptions empty;
  empty.num_blocks = 0;
  EXPECT_EQ(BlockManager::Create(empty).status().code(), StatusCode::kInvalidArgument);
  BlockManagerOptions zero_block;
  zero_block.num_blocks = 8;
  zero_block.block_size = 0;
  EXPECT_EQ(BlockManager::Create(zero_block).status().code(), StatusCode::kInvalidArgument);
}

TEST(BlockManagerTest, ExactFitAllocationAndCleanFailure) {
  auto bm = Make(4);
  // 16 tokens = exactly 4 blocks.
  AdmitOk(*bm, 1, {}, 16);
  EXPECT_EQ(bm->BlockTable(1).size(), 4u);
  auto s = bm->GetStats();
  EXPECT_EQ(s.used_blocks, 4u);
  EXPECT_EQ(s.free_blocks, 0u);
  EXPECT_DOUBLE_EQ(s.usage_ratio, 1.0);
  // Growing within the last block needs nothing.
  EXPECT_TRUE(bm->AllocateSlots(1, 16).ok());
  EXPECT_EQ(*bm->BlocksNeeded(1, 17), 1u);
  // One more token fails and changes nothing.
  EXPECT_EQ(bm->AllocateSlots(1, 17).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(bm->BlockTable(1).size(), 4u);
  EXPECT_EQ(bm->Admit({2, {}, 1, 0, {}, {}}).status().code(), StatusCode::kResourceExhausted);
  EXPECT_FALSE(bm->HasSequence(2));
  ASSERT_TRUE(bm->Free(1).ok());
  EXPECT_EQ(bm->GetStats().free_blocks, 4u);
  ASSERT_TRUE(bm->CheckInvariants().ok()) << bm->CheckInvariants().ToString();
}

TEST(BlockManagerTest, FailedAdmitLeavesCachedPrefixUntouched) {
  auto bm = Make(4);
  auto tokens = Tokens(8);
  auto h = Hashes(tokens);
  AdmitOk(*bm, 1, h, 8);
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  ASSERT_TRUE(bm->Free(1).ok());  // 2 evictable + 2 free
  bm->DrainEvents();
  // Reusing the 2 cached blocks leaves only 2 allocatable: 20 tokens need 3 fresh.
  auto r = bm->Admit({2, h, 20, 20, {}, {}});
  EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(bm->GetStats().evictable_blocks, 2u);
  EXPECT_EQ(bm->GetStats().prefix_cache_query_tokens, 0u);
  EXPECT_TRUE(bm->DrainEvents().empty());
  EXPECT_EQ(bm->FindCachedPrefix(h), 2u);
  // 16 tokens fit exactly: 2 reused + 2 fresh, nothing evicted.
  EXPECT_EQ(AdmitOk(*bm, 2, h, 16).num_cached_blocks, 2u);
  EXPECT_EQ(bm->GetStats().allocatable_blocks, 0u);
  EXPECT_TRUE(bm->DrainEvents().empty());
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, SharedPrefixBetweenTwoLiveSequences) {
  auto bm = Make(16);
  auto a = Tokens(10);  // 2 full blocks + 2 tokens
  auto ha = Hashes(a);
  EXPECT_EQ(AdmitOk(*bm, 1, ha, a.size(), a.size()).num_cached_blocks, 0u);
  ASSERT_TRUE(bm->CommitBlocks(1, ha).ok());

  // Same first 8 tokens, different tail.
  auto b = a;
  b.resize(8);
  b.push_back(7);
  b.push_back(8);
  b.push_back(9);
  auto hb = Hashes(b);
  ASSERT_EQ(hb.size(), 2u);
  auto r = AdmitOk(*bm, 2, hb, b.size(), b.size());
  EXPECT_EQ(r.num_cached_blocks, 2u);
  EXPECT_EQ(r.num_cached_tokens, 8u);
  const auto& ta = bm->BlockTable(1);
  const auto& tb = bm->BlockTable(2);
  ASSERT_EQ(tb.size(), 3u);
  EXPECT_EQ(ta[0], tb[0]);
  EXPECT_EQ(ta[1], tb[1]);
  EXPECT_NE(ta[2], tb[2]);
  EXPECT_EQ(bm->RefCount(ta[0]), 2u);
  EXPECT_EQ(bm->RefCount(ta[2]), 1u);
  EXPECT_EQ(bm->NumCommittedBlocks(2), 2u);
  EXPECT_EQ(bm->GetStats().used_blocks, 4u);

  auto s = bm->GetStats();
  EXPECT_EQ(s.prefix_cache_query_tokens, 21u);
  EXPECT_EQ(s.prefix_cache_hit_tokens, 8u);

  // Freeing one sharer leaves the shared blocks in use.
  ASSERT_TRUE(bm->Free(1).ok());
  EXPECT_EQ(bm->RefCount(tb[0]), 1u);
  EXPECT_EQ(bm->GetStats().used_blocks, 3u);
  EXPECT_EQ(bm->GetStats().evictable_blocks, 0u);
  ASSERT_TRUE(bm->Free(2).ok());
  EXPECT_EQ(bm->GetStats().evictable_blocks, 2u);
  EXPECT_EQ(bm->GetStats().cached_blocks, 2u);
  EXPECT_EQ(bm->Free(2).code(), StatusCode::kNotFound);  // no double free
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

// SnapKV's compaction: a sequence adopts another's fresh blocks; its own
// committed blocks stay cached (evictable, matchable, no events), its
// uncommitted tail is freed, and the entries it gave up count as released.
TEST(BlockManagerTest, AdoptBlocksKeepsTheCachedPromptAndCountsTheRelease) {
  auto bm = Make(16);
  const auto t = Tokens(18);  // 4 full blocks + 2 tokens: 5 blocks
  const auto h = Hashes(t);
  AdmitOk(*bm, 1, h, t.size());
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  (void)bm->DrainEvents();
  const std::vector<BlockId> prompt = bm->BlockTable(1);
  AdmitOk(*bm, 99, {}, 8);  // 2 fresh blocks
  const std::vector<BlockId> fresh = bm->BlockTable(99);
  ASSERT_TRUE(bm->AdoptBlocks(1, 99).ok());
  EXPECT_EQ(bm->BlockTable(1), fresh);
  EXPECT_FALSE(bm->HasSequence(99));
  EXPECT_EQ(bm->ReleasedBlocks(1), 3u);
  EXPECT_EQ(bm->GetStats().released_out_of_reach_blocks_total, 3u);
  EXPECT_EQ(bm->NumCommittedBlocks(1), 0u);
  EXPECT_EQ(bm->GetStats().evictable_blocks, 4u);  // the committed prompt blocks
  EXPECT_EQ(bm->RefCount(prompt[4]), 0u);
  EXPECT_EQ(bm->FindCachedPrefix(h), 4u);
  EXPECT_TRUE(bm->DrainEvents().empty());
  EXPECT_EQ(bm->AdoptBlocks(1, 99).code(), StatusCode::kNotFound);
  EXPECT_EQ(bm->AdoptBlocks(1, 1).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(bm->Free(1).ok());
  EXPECT_EQ(bm->GetStats().used_blocks, 0u);
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, ReuseIsCappedByNumTokens) {
  auto bm = Make(16);
  auto t = Tokens(16);
  auto h = Hashes(t);
  AdmitOk(*bm, 1, h, 16);
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  // Only 9 tokens wanted: at most 2 whole blocks can be reused.
  auto r = AdmitOk(*bm, 2, h, 9);
  EXPECT_EQ(r.num_cached_blocks, 2u);
  EXPECT_EQ(bm->BlockTable(2).size(), 3u);
}

TEST(BlockManagerTest, StoredEventsCarryParentAndOrder) {
  auto bm = Make(16);
  auto t = Tokens(13);
  auto h = Hashes(t);  // 3 full blocks
  AdmitOk(*bm, 1, {}, 13);
  ASSERT_TRUE(bm->CommitBlocks(1, std::span(h).first(1)).ok());
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());  // nothing new: no batch
  auto batches = bm->DrainEvents();
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0].sequence_number, 1u);
  EXPECT_EQ(batches[1].sequence_number, 2u);
  ASSERT_EQ(batches[0].events.size(), 1u);
  EXPECT_EQ(std::get<KvStored>(batches[0].events[0]),
            (KvStored{{h[0]}, std::nullopt, KvTier::kDevice}));
  ASSERT_EQ(batches[1].events.size(), 1u);
  EXPECT_EQ(std::get<KvStored>(batches[1].events[0]),
            (KvStored{{h[1], h[2]}, h[0], KvTier::kDevice}));
  EXPECT_TRUE(bm->DrainEvents().empty());
  EXPECT_EQ(bm->last_event_sequence_number(), 2u);
}

TEST(BlockManagerTest, CommitErrors) {
  auto bm = Make(16);
  auto t = Tokens(8);
  auto h = Hashes(t);
  AdmitOk(*bm, 1, {}, 4);
  EXPECT_EQ(bm->CommitBlocks(1, h).code(), StatusCode::kInvalidArgument);  // 2 hashes, 1 block
  ASSERT_TRUE(bm->CommitBlocks(1, std::span(h).first(1)).ok());
  std::vector<BlockHash> wrong = {h[0] ^ 1};
  EXPECT_EQ(bm->CommitBlocks(1, wrong).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bm->CommitBlocks(99, h).code(), StatusCode::kNotFound);
  EXPECT_EQ(bm->Admit({1, {}, 4, 0, {}, {}}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(bm->AllocateSlots(99, 4).code(), StatusCode::kNotFound);
  EXPECT_EQ(bm->BlocksNeeded(99, 4).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(bm->BlockTable(99).empty());
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, DuplicateContentStaysPrivate) {
  auto bm = Make(16);
  auto t = Tokens(8);
  auto h = Hashes(t);
  // Two sequences compute the same prompt concurrently (neither could hit).
  AdmitOk(*bm, 1, h, 8);
  AdmitOk(*bm, 2, h, 8);
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  ASSERT_TRUE(bm->CommitBlocks(2, h).ok());
  auto batches = bm->DrainEvents();
  ASSERT_EQ(batches.size(), 1u);  // only the first commit is announced
  EXPECT_EQ(bm->GetStats().cached_blocks, 2u);
  ASSERT_TRUE(bm->Free(2).ok());
  // Sequence 2's duplicates went back to the free list, not to the LRU.
  EXPECT_EQ(bm->GetStats().evictable_blocks, 0u);
  EXPECT_EQ(bm->GetStats().free_blocks, 14u);
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, EvictionIsLeastRecentlyReleasedTailFirst) {
  auto bm = Make(6);
  auto a = Tokens(8, 0);
  auto b = Tokens(8, 1000);
  auto ha = Hashes(a), hb = Hashes(b);
  AdmitOk(*bm, 1, {}, 8);
  AdmitOk(*bm, 2, {}, 8);
  ASSERT_TRUE(bm->CommitBlocks(1, ha).ok());
  ASSERT_TRUE(bm->CommitBlocks(2, hb).ok());
  ASSERT_TRUE(bm->Free(1).ok());  // released first: evicted first
  ASSERT_TRUE(bm->Free(2).ok());
  bm->DrainEvents();
  // 2 free blocks + 4 evictable. 3 fresh blocks: 2 free, then 1 eviction.
  AdmitOk(*bm, 3, {}, 12);
  EXPECT_EQ(RemovedHashes(bm->DrainEvents()), (std::vector<BlockHash>{ha[1]}));
  EXPECT_EQ(bm->Evict(2), 2u);
  EXPECT_EQ(RemovedHashes(bm->DrainEvents()), (std::vector<BlockHash>{ha[0], hb[1]}));
  EXPECT_EQ(bm->FindCachedPrefix(hb), 1u);
  EXPECT_EQ(bm->GetStats().evicted_blocks_total, 3u);
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, ReuseRefreshesRecency) {
  auto bm = Make(4);
  auto a = Tokens(4, 0), b = Tokens(4, 1000);
  auto ha = Hashes(a), hb = Hashes(b);
  AdmitOk(*bm, 1, ha, 4);
  ASSERT_TRUE(bm->CommitBlocks(1, ha).ok());
  AdmitOk(*bm, 2, hb, 4);
  ASSERT_TRUE(bm->CommitBlocks(2, hb).ok());
  ASSERT_TRUE(bm->Free(1).ok());
  ASSERT_TRUE(bm->Free(2).ok());
  // Touch A again: B becomes the least recently released.
  EXPECT_EQ(AdmitOk(*bm, 3, ha, 4).num_cached_blocks, 1u);
  ASSERT_TRUE(bm->Free(3).ok());
  bm->DrainEvents();
  EXPECT_EQ(bm->Evict(1), 1u);
  EXPECT_EQ(RemovedHashes(bm->DrainEvents()), (std::vector<BlockHash>{hb[0]}));
}

TEST(BlockManagerTest, ReservedBlocksAreInvisibleUntilCommitted) {
  // A decode worker reserves blocks for KV that arrives by transfer.
  auto bm = Make(8);
  auto t = Tokens(12);
  auto h = Hashes(t);
  auto r = AdmitOk(*bm, 1, h, 12, /*stats_tokens=*/0);
  EXPECT_EQ(r.num_cached_blocks, 0u);
  EXPECT_EQ(bm->BlockTable(1).size(), 3u);
  EXPECT_EQ(bm->FindCachedPrefix(h), 0u);
  EXPECT_TRUE(bm->Snapshot().block_hashes.empty());
  EXPECT_TRUE(bm->DrainEvents().empty());
  // Another sequence with the same prompt cannot match reserved blocks.
  EXPECT_EQ(AdmitOk(*bm, 2, h, 12).num_cached_blocks, 0u);
  ASSERT_TRUE(bm->Free(2).ok());
  // The KV has landed: commit.
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  EXPECT_EQ(bm->FindCachedPrefix(h), 3u);
  auto batches = bm->DrainEvents();
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(std::get<KvStored>(batches[0].events[0]).block_hashes, h);
  // Transfer admissions are not prefix-cache lookups.
  EXPECT_EQ(bm->GetStats().prefix_cache_query_tokens, 0u);
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, PinKeepsBlocksThroughFreeUntilUnpin) {
  auto bm = Make(4);
  auto t = Tokens(10);
  auto h = Hashes(t);
  AdmitOk(*bm, 1, h, 10);
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  const std::vector<BlockId> table = bm->BlockTable(1);
  auto pin = bm->Pin(1);
  ASSERT_TRUE(pin.ok());
  EXPECT_EQ(bm->PinnedBlocks(*pin), table);
  ASSERT_TRUE(bm->Free(1).ok());
  auto s = bm->GetStats();
  EXPECT_EQ(s.used_blocks, 3u);
  EXPECT_EQ(s.num_pins, 1u);
  // Only one block is allocatable: the pinned ones cannot be taken or evicted.
  EXPECT_EQ(bm->Admit({2, {}, 8, 0, {}, {}}).status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(bm->Evict(10), 0u);
  ASSERT_TRUE(bm->Unpin(*pin).ok());
  EXPECT_EQ(bm->Unpin(*pin).code(), StatusCode::kNotFound);
  s = bm->GetStats();
  EXPECT_EQ(s.evictable_blocks, 2u);  // the two committed blocks
  EXPECT_EQ(s.free_blocks, 2u);       // the partial block went back
  EXPECT_EQ(bm->Pin(1).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, ResetPrefixCacheClearsHashesButNotSequences) {
  auto bm = Make(8);
  auto a = Tokens(8, 0), b = Tokens(8, 1000);
  auto ha = Hashes(a), hb = Hashes(b);
  AdmitOk(*bm, 1, ha, 8);
  ASSERT_TRUE(bm->CommitBlocks(1, ha).ok());
  AdmitOk(*bm, 2, hb, 8);
  ASSERT_TRUE(bm->CommitBlocks(2, hb).ok());
  ASSERT_TRUE(bm->Free(1).ok());
  bm->DrainEvents();
  bm->ResetPrefixCache();
  auto batches = bm->DrainEvents();
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(batches[0].events, (std::vector<KvEvent>{KvCleared{}}));
  auto s = bm->GetStats();
  EXPECT_EQ(s.cached_blocks, 0u);
  EXPECT_EQ(s.evictable_blocks, 0u);
  EXPECT_EQ(s.used_blocks, 2u);
  EXPECT_EQ(bm->FindCachedPrefix(hb), 0u);
  EXPECT_TRUE(bm->Snapshot().block_hashes.empty());
  // The live sequence goes on; its old blocks are not re-announced.
  ASSERT_TRUE(bm->AllocateSlots(2, 12).ok());
  auto b12 = Tokens(12, 1000);
  ASSERT_TRUE(bm->CommitBlocks(2, Hashes(b12)).ok());
  batches = bm->DrainEvents();
  ASSERT_EQ(batches.size(), 1u);
  EXPECT_EQ(std::get<KvStored>(batches[0].events[0]),
            (KvStored{{Hashes(b12)[2]}, Hashes(b12)[1], KvTier::kDevice}));
  ASSERT_TRUE(bm->Free(2).ok());
  EXPECT_EQ(bm->GetStats().evictable_blocks, 1u);
  ASSERT_TRUE(bm->CheckInvariants().ok());
}

TEST(BlockManagerTest, SnapshotMatchesEventStreamNumbering) {
  // Pool of 4 blocks, 2 per prompt: later prompts evict earlier ones, so the
  // stream mixes Stored and Removed.
  auto bm = Make(4);
  std::unordered_set<BlockHash> replica;
  uint64_t next_expected = 1;
  for (SeqId seq = 1; seq <= 6; ++seq) {
    auto h = Hashes(Tokens(8, static_cast<TokenId>(seq * 100)));
    AdmitOk(*bm, seq, h, 8);
    ASSERT_TRUE(bm->CommitBlocks(seq, h).ok());
    ASSERT_TRUE(bm->Free(seq).ok());
    if (seq == 3) {
      // The router lost batches: it resyncs from a snapshot taken while
      // batches are still pending, then skips those the snapshot covers.
      auto snap = bm->Snapshot();
      replica = {snap.block_hashes.begin(), snap.block_hashes.end()};
      for (const auto& batch : bm->DrainEvents()) {
        EXPECT_EQ(batch.sequence_number, next_expected++);
        if (batch.sequence_number > snap.last_sequence_number) ApplyKvEventBatch(batch, &replica);
      }
      EXPECT_EQ(next_expected - 1, snap.last_sequence_number);
    } else {
      for (const auto& batch : bm->DrainEvents()) {
        EXPECT_EQ(batch.sequence_number, next_expected++);
        ApplyKvEventBatch(batch, &replica);
      }
    }
  }
  auto snap = bm->Snapshot();
  EXPECT_EQ(snap.last_sequence_number, next_expected - 1);
  EXPECT_EQ(std::unordered_set<BlockHash>(snap.block_hashes.begin(), snap.block_hashes.end()),
            replica);
  EXPECT_EQ(replica.size(), 4u);
}

TEST(BlockManagerTest, EventsCanBeDisabledButStayNumbered) {
  auto bm = Make(4, /*caching=*/true, /*events=*/false);
  auto h = Hashes(Tokens(8));
  AdmitOk(*bm, 1, h, 8);
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  EXPECT_TRUE(bm->DrainEvents().empty());
  EXPECT_EQ(bm->last_event_sequence_number(), 1u);
  EXPECT_EQ(bm->Snapshot().block_hashes.size(), 2u);
}

TEST(BlockManagerTest, CachingDisabledNeverMatches) {
  auto bm = Make(8, /*caching=*/false);
  auto h = Hashes(Tokens(8));
  AdmitOk(*bm, 1, h, 8, 8);
  ASSERT_TRUE(bm->CommitBlocks(1, h).ok());
  EXPECT_EQ(AdmitOk(*bm, 2, h, 8, 8).num_cached_blocks, 0u);
  EXPECT_EQ(bm->GetStats().prefix_cache_hit_tokens, 0u);
  EXPECT_EQ(bm->GetStats().prefix_cache_query_tokens, 16u);
  ASSERT_TRUE(bm->Free(1).ok());
  EXPECT_EQ(bm->GetStats().evictable_blocks, 0u);
  EXPECT_TRUE(bm->DrainEvents().empty());
}

}  // namespace
}  // namespace pdserve
