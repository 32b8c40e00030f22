// PrefixIndex against a naive reference model, plus its contracts one by one.
#include "services/router/prefix_index.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <unordered_map>

#include "common/kv_groups.h"
#include "services/router/detail/block_table.h"

namespace pdserve::router {
namespace {

enum class Kind { kStored, kRemoved, kCleared };

KvEvent Event(Kind kind, std::vector<BlockHash> hashes) {
  switch (kind) {
    case Kind::kStored:
      return KvStored{std::move(hashes), std::nullopt};
    case Kind::kRemoved:
      return KvRemoved{std::move(hashes)};
    case Kind::kCleared:
      break;
  }
  return KvCleared{};
}

KvEventBatch Batch(uint64_t seq, Kind kind, std::vector<BlockHash> hashes) {
  KvEventBatch b;
  b.sequence_number = seq;
  b.events.push_back(Event(kind, std::move(hashes)));
  return b;
}

std::vector<uint32_t> Overlap(const PrefixIndex& index, std::vector<BlockHash> hashes,
                              int64_t now_us = 0) {
  std::vector<uint32_t> out;
  index.LeadingOverlap(hashes, now_us, &out);
  return out;
}

// Pending entries as the reference models keep them: by block, the workers
// they name and when they expire.
struct RefPending {
  std::set<WorkerId> workers;
  int64_t expires_us = 0;
};
using RefPendingMap = std::map<BlockHash, RefPending>;

// LeadingOverlap by its definition: per worker, the leading blocks it holds
// or (with `pending`) is pending for with an expiry after `now`.
std::vector<uint32_t> NaiveOverlap(const std::vector<std::set<BlockHash>>& held,
                                   const RefPendingMap* pending,
                                   const std::vector<BlockHash>& prompt, int64_t now) {
  std::vector<uint32_t> out(held.size(), 0);
  for (WorkerId w = 0; w < held.size(); ++w) {
    uint32_t n = 0;
    for (; n < prompt.size(); ++n) {
      if (held[w].contains(prompt[n])) continue;
      if (pending == nullptr) break;
      const auto it = pending->find(prompt[n]);
      if (it == pending->end() || it->second.expires_us <= now || !it->second.workers.contains(w)) {
        break;
      }
    }
    out[w] = n;
  }
  return out;
}

TEST(BlockTableTest, MatchesUnorderedMapUnderChurn) {
  // Small key range (with 0) so inserts, hits and backward-shift erasures
  // interleave constantly; the table grows from 16 slots on the way.
  detail::BlockTable table(2, 1 << 20);
  std::unordered_map<uint64_t, uint64_t> ref;
  std::mt19937_64 rng(7);
  for (int step = 0; step < 200000; ++step) {
    // Keys collide in their low bits to stress probe runs.
    const uint64_t key = (rng() % 3000) << 20;
    if (rng() % 3 != 0) {
      bool inserted = false;
      const size_t slot = table.FindOrInsert(key, &inserted);
      ASSERT_NE(slot, detail::BlockTable::kNotFound);
      EXPECT_EQ(inserted, !ref.contains(key));
      if (inserted) {
        EXPECT_EQ(table.words(slot)[0], 0u);
        EXPECT_EQ(table.words(slot)[1], 0u);
      }
      table.words(slot)[1] = key ^ 0xabc;
      ref[key] = key ^ 0xabc;
    } else {
      EXPECT_EQ(table.Erase(key), ref.erase(key) == 1);
    }
    ASSERT_EQ(table.size(), ref.size());
  }
  size_t seen = 0;
  table.ForEach([&](uint64_t k, const uint64_t* w) {
    ++seen;
    ASSERT_TRUE(ref.contains(k));
    EXPECT_EQ(w[1], ref[k]);
  });
  EXPECT_EQ(seen, ref.size());
  for (const auto& [k, v] : ref) {
    const size_t slot = table.Find(k);
    ASSERT_NE(slot, detail::BlockTable::kNotFound);
    EXPECT_EQ(table.words(slot)[1], v);
  }
}

TEST(BlockTableTest, RefusesNewKeysAtTheBound) {
  detail::BlockTable table(0, 3);
  bool inserted = false;
  for (uint64_t k : {0ull, 5ull, 9ull})
    EXPECT_NE(table.FindOrInsert(k, &inserted), table.kNotFound);
  EXPECT_EQ(table.FindOrInsert(11, &inserted), table.kNotFound);
  EXPECT_NE(table.FindOrInsert(5, &inserted), table.kNotFound);  // present keys still found
  EXPECT_FALSE(inserted);
  EXPECT_TRUE(table.Erase(0));
  EXPECT_NE(table.FindOrInsert(11, &inserted), table.kNotFound);
  EXPECT_TRUE(inserted);
}

TEST(PrefixIndexTest, LeadingOverlapStopsAtTheFirstMiss) {
  PrefixIndex index({.max_workers = 4});
  for (WorkerId w : {0u, 1u, 2u}) {
    ASSERT_TRUE(index.AddWorker(w).ok());
    ASSERT_TRUE(index.ApplySnapshot(w, 0, {}).ok());
  }
  // Each stores the prompt 10, 11, 12 (12's parent 11, 11's 10); then w1
  // evicts 11 and w2 evicts 10, out of order: w0 holds 10,11,12, w1 holds
  // 10 and 12 (not 11), w2 holds 11,12 only.
  for (WorkerId w : {0u, 1u, 2u}) {
    ASSERT_EQ(index.ApplyEvents(w, Batch(1, Kind::kStored, {10, 11, 12})), ApplyOutcome::kApplied);
  }
  ASSERT_EQ(index.ApplyEvents(1, Batch(2, Kind::kRemoved, {11})), ApplyOutcome::kApplied);
  ASSERT_EQ(index.ApplyEvents(2, Batch(2, Kind::kRemoved, {10})), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, {10, 11, 12, 13}), (std::vector<uint32_t>{3, 1, 0, 0}));
  EXPECT_EQ(Overlap(index, {10, 11}), (std::vector<uint32_t>{2, 1, 0, 0}));
  EXPECT_EQ(Overlap(index, {99, 10}), (std::vector<uint32_t>{0, 0, 0, 0}));
  EXPECT_EQ(Overlap(index, {}), (std::vector<uint32_t>{0, 0, 0, 0}));
  // w1's hole made those answers walk; once 12 goes too, its blocks are
  // closed under parents again and the answers bisect.
  const uint64_t walked = index.stats().bisected_queries;
  ASSERT_EQ(index.ApplyEvents(1, Batch(3, Kind::kRemoved, {12})), ApplyOutcome::kApplied);
  ASSERT_EQ(index.ApplyEvents(2, Batch(3, Kind::kRemoved, {11, 12})), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, {10, 11, 12, 13}), (std::vector<uint32_t>{3, 1, 0, 0}));
  EXPECT_EQ(index.stats().bisected_queries, walked + 1);
}

TEST(PrefixIndexTest, SequenceGapsDuplicatesAndResync) {
  PrefixIndex index({.max_workers = 2});
  ASSERT_TRUE(index.AddWorker(0).ok());
  // No snapshot yet: refused, but that is not a gap.
  EXPECT_EQ(index.ApplyEvents(0, Batch(1, Kind::kStored, {1})), ApplyOutcome::kNeedsResync);
  EXPECT_EQ(index.stats().gaps, 0u);
  ASSERT_TRUE(index.ApplySnapshot(0, 5, std::vector<BlockHash>{1, 2}).ok());
  EXPECT_EQ(index.ApplyEvents(0, Batch(6, Kind::kStored, {3})), ApplyOutcome::kApplied);
  EXPECT_EQ(index.ApplyEvents(0, Batch(6, Kind::kStored, {4})), ApplyOutcome::kDuplicate);
  EXPECT_EQ(index.ApplyEvents(0, Batch(2, Kind::kRemoved, {1})), ApplyOutcome::kDuplicate);
  EXPECT_EQ(Overlap(index, {1, 2, 3, 4})[0], 3u);  // neither stale batch applied
  // Gap: 7 is missing.
  EXPECT_EQ(index.ApplyEvents(0, Batch(8, Kind::kRemoved, {1})), ApplyOutcome::kNeedsResync);
  EXPECT_TRUE(index.NeedsResync(0));
  EXPECT_EQ(index.ApplyEvents(0, Batch(7, Kind::kRemoved, {1})), ApplyOutcome::kNeedsResync);
  EXPECT_EQ(index.stats().gaps, 1u);
  EXPECT_EQ(Overlap(index, {1, 2, 3})[0], 3u);  // old knowledge kept until the snapshot
  ASSERT_TRUE(index.ApplySnapshot(0, 9, std::vector<BlockHash>{2, 3}).ok());
  EXPECT_FALSE(index.NeedsResync(0));
  EXPECT_EQ(Overlap(index, {1, 2, 3})[0], 0u);
  EXPECT_EQ(Overlap(index, {2, 3})[0], 2u);
  EXPECT_EQ(index.ApplyEvents(0, Batch(10, Kind::kStored, {1})), ApplyOutcome::kApplied);
  EXPECT_EQ(index.ApplyEvents(1, Batch(1, Kind::kStored, {1})), ApplyOutcome::kUnknownWorker);
  EXPECT_EQ(index.ApplyEvents(77, Batch(1, Kind::kStored, {1})), ApplyOutcome::kUnknownWorker);
  EXPECT_FALSE(index.ApplySnapshot(1, 0, {}).ok());
  EXPECT_FALSE(index.AddWorker(0).ok());  // in use
  EXPECT_FALSE(index.AddWorker(2).ok());  // beyond max_workers
}

TEST(PrefixIndexTest, ClearedAndRemoveWorkerPurgeOnlyThatWorker) {
  PrefixIndex index({.max_workers = 3});
  for (WorkerId w : {0u, 1u}) {
    ASSERT_TRUE(index.AddWorker(w).ok());
    ASSERT_TRUE(index.ApplySnapshot(w, 0, {}).ok());
    ASSERT_EQ(index.ApplyEvents(w, Batch(1, Kind::kStored, {7, 8, 9})), ApplyOutcome::kApplied);
  }
  ASSERT_EQ(index.ApplyEvents(1, Batch(2, Kind::kStored, {100})), ApplyOutcome::kApplied);
  EXPECT_EQ(index.stats().entries, 4u);
  EXPECT_EQ(index.stats().worker_blocks, 7u);
  KvEventBatch clear;
  clear.sequence_number = 2;
  clear.events.push_back(KvCleared{});
  ASSERT_EQ(index.ApplyEvents(0, clear), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, {7, 8, 9}), (std::vector<uint32_t>{0, 3, 0}));
  EXPECT_EQ(index.WorkerBlockCount(0), 0u);
  index.RemoveWorker(1);
  EXPECT_EQ(Overlap(index, {7, 8, 9}), (std::vector<uint32_t>{0, 0, 0}));
  EXPECT_EQ(index.stats().entries, 0u);
  EXPECT_EQ(index.stats().worker_blocks, 0u);
  ASSERT_TRUE(index.AddWorker(1).ok());  // the slot is reusable, empty and unsynced
  EXPECT_TRUE(index.NeedsResync(1));
  EXPECT_EQ(index.WorkerBlockCount(1), 0u);
}

TEST(PrefixIndexTest, MemoryBoundDropsNewHashesAndReportsThem) {
  PrefixIndex index({.max_workers = 2, .max_entries = 4});
  for (WorkerId w : {0u, 1u}) {
    ASSERT_TRUE(index.AddWorker(w).ok());
    ASSERT_TRUE(index.ApplySnapshot(w, 0, {}).ok());
  }
  ASSERT_EQ(index.ApplyEvents(0, Batch(1, Kind::kStored, {1, 2, 3, 4, 5, 6})),
            ApplyOutcome::kApplied);
  PrefixIndexStats s = index.stats();
  EXPECT_EQ(s.entries, 4u);
  EXPECT_EQ(s.rejected_stores, 2u);
  EXPECT_GT(s.bytes, 0u);
  EXPECT_EQ(Overlap(index, {1, 2, 3, 4, 5, 6})[0], 4u);  // under-reports, never over-reports
  // A known hash can still gain holders at the bound.
  ASSERT_EQ(index.ApplyEvents(1, Batch(1, Kind::kStored, {1, 2, 9})), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, {1, 2, 9})[1], 2u);
  EXPECT_EQ(index.stats().rejected_stores, 3u);
  // Room frees up when blocks go.
  ASSERT_EQ(index.ApplyEvents(0, Batch(2, Kind::kRemoved, {3, 4})), ApplyOutcome::kApplied);
  ASSERT_EQ(index.ApplyEvents(0, Batch(3, Kind::kStored, {5})), ApplyOutcome::kApplied);
  EXPECT_EQ(index.stats().entries, 3u);
  EXPECT_EQ(index.stats().rejected_stores, 3u);
}

TEST(PrefixIndexTest, PendingEntriesCountUntilTheyExpireOrAreSuperseded) {
  PrefixIndex index({.max_workers = 2});
  for (WorkerId w : {0u, 1u}) {
    ASSERT_TRUE(index.AddWorker(w).ok());
    ASSERT_TRUE(index.ApplySnapshot(w, 0, {}).ok());
  }
  ASSERT_EQ(index.ApplyEvents(1, Batch(1, Kind::kStored, {1})), ApplyOutcome::kApplied);
  index.AddPending(1, std::vector<BlockHash>{2, 3}, /*now_us=*/0, /*expires_us=*/1000);
  index.AddPending(0, std::vector<BlockHash>{1, 4}, /*now_us=*/0, /*expires_us=*/1500);
  EXPECT_EQ(Overlap(index, {1, 2, 3}, 0), (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(Overlap(index, {1, 4}, 0), (std::vector<uint32_t>{2, 1}));
  EXPECT_EQ(index.stats().pending_entries, 4u);
  EXPECT_EQ(Overlap(index, {1, 2, 3}, 999), (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(Overlap(index, {1, 2, 3}, 1000), (std::vector<uint32_t>{1, 1}));
  EXPECT_EQ(Overlap(index, {1, 4}, 1499), (std::vector<uint32_t>{2, 1}));
  EXPECT_EQ(Overlap(index, {1, 4}, 1500), (std::vector<uint32_t>{0, 1}));
  index.ExpirePending(1000);  // sweeps (1, 2) and (1, 3)
  EXPECT_EQ(index.stats().pending_entries, 2u);
  // The worker's own Stored event supersedes its pending entry: removing the
  // block afterwards leaves nothing behind, even before the expiry.
  ASSERT_EQ(index.ApplyEvents(0, Batch(1, Kind::kStored, {1})), ApplyOutcome::kApplied);
  ASSERT_EQ(index.ApplyEvents(0, Batch(2, Kind::kRemoved, {1})), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, {1, 4}, 0)[0], 0u);
  EXPECT_EQ(index.stats().pending_entries, 1u);  // (0, 4)
  // Routing a block again extends its life.
  index.AddPending(0, std::vector<BlockHash>{4}, 1400, 2400);
  EXPECT_EQ(Overlap(index, {4}, 2000)[0], 1u);
  index.ExpirePending(2400);
  EXPECT_EQ(index.stats().pending_entries, 0u);
  // Removing a worker drops its pending entries.
  index.AddPending(1, std::vector<BlockHash>{8}, 0, 100);
  index.RemoveWorker(1);
  EXPECT_EQ(index.stats().pending_entries, 0u);
}

TEST(PrefixIndexTest, PendingIsBounded) {
  PrefixIndex index({.max_workers = 1, .max_pending = 3});
  ASSERT_TRUE(index.AddWorker(0).ok());
  index.AddPending(0, std::vector<BlockHash>{1, 2}, 0, 50);
  index.AddPending(0, std::vector<BlockHash>{3}, 0, 100);
  EXPECT_EQ(index.stats().pending_entries, 3u);
  // Full: everything pending is dropped, the new blocks kept.
  index.AddPending(0, std::vector<BlockHash>{4, 5}, 10, 110);
  EXPECT_EQ(index.stats().pending_entries, 2u);
  EXPECT_EQ(Overlap(index, {3}, 10)[0], 0u);
  EXPECT_EQ(Overlap(index, {4, 5}, 10)[0], 2u);
  // Over and over (each pair overflows what the last one left, so each call
  // switches tables): the two tables are cleared and reused in turn and no
  // dropped entry comes back.
  for (BlockHash h = 10; h < 1000; h += 2) {
    index.AddPending(0, std::vector<BlockHash>{h, h + 1}, 20, 120);
    ASSERT_EQ(Overlap(index, {h, h + 1}, 20)[0], 2u) << h;
    ASSERT_EQ(Overlap(index, {h - 2}, 20)[0], 0u) << h;
    ASSERT_EQ(Overlap(index, {h - 1}, 20)[0], 0u) << h;
    ASSERT_LE(index.stats().pending_entries, 3u);
  }
}

// The reference: per worker, a set of hashes; a worker's overlap is the
// length of the prompt's longest prefix inside its set.
struct ReferenceIndex {
  struct Worker {
    std::set<BlockHash> blocks;
    bool synced = false;
    uint64_t last = 0;
  };
  std::map<WorkerId, Worker> workers;
  uint64_t gaps = 0;

  ApplyOutcome Apply(WorkerId id, const KvEventBatch& b) {
    auto it = workers.find(id);
    if (it == workers.end()) return ApplyOutcome::kUnknownWorker;
    Worker& w = it->second;
    if (!w.synced) return ApplyOutcome::kNeedsResync;
    if (b.sequence_number <= w.last) return ApplyOutcome::kDuplicate;
    if (b.sequence_number != w.last + 1) {
      ++gaps;
      w.synced = false;
      return ApplyOutcome::kNeedsResync;
    }
    w.last = b.sequence_number;
    for (const KvEvent& e : b.events) {
      if (std::holds_alternative<KvCleared>(e)) w.blocks.clear();
      if (auto* st = std::get_if<KvStored>(&e))
        w.blocks.insert(st->block_hashes.begin(), st->block_hashes.end());
      if (auto* rm = std::get_if<KvRemoved>(&e)) {
        for (BlockHash h : rm->block_hashes) w.blocks.erase(h);
      }
    }
    return ApplyOutcome::kApplied;
  }
  std::vector<uint32_t> Overlap(const std::vector<BlockHash>& prompt, size_t slots) const {
    std::vector<uint32_t> out(slots, 0);
    for (const auto& [id, w] : workers) {
      uint32_t n = 0;
      while (n < prompt.size() && w.blocks.contains(prompt[n])) ++n;
      out[id] = n;
    }
    return out;
  }
};

// Random streams of any blocks in any order, as no engine's hash chains
// could make them (a block named with two parents, prompts in any order):
// the walk's answers, which assume nothing of parents.
TEST(PrefixIndexTest, MatchesReferenceUnderRandomEventStreams) {
  constexpr size_t kSlots = 70;  // two bitset words
  std::mt19937_64 rng(12345);
  PrefixIndex index({.max_workers = kSlots, .chained_parents = false});
  ReferenceIndex ref;
  // A small universe (0 included) makes workers share blocks constantly.
  auto random_hash = [&] { return static_cast<BlockHash>(rng() % 64) * 0x100000001ull; };
  auto random_hashes = [&](size_t max_n) {
    std::vector<BlockHash> v(rng() % (max_n + 1));
    for (auto& h : v) h = random_hash();
    return v;
  };
  // Prompts are drawn from what workers were told to store, so overlaps are long.
  std::vector<std::vector<BlockHash>> prompts;
  uint32_t longest_overlap = 0;
  for (int step = 0; step < 20000; ++step) {
    const WorkerId w = static_cast<WorkerId>(rng() % kSlots);
    const int op = static_cast<int>(rng() % 100);
    if (op < 3) {
      const bool ok = index.AddWorker(w).ok();
      EXPECT_EQ(ok, !ref.workers.contains(w));
      if (ok) ref.workers[w] = {};
    } else if (op < 5) {
      index.RemoveWorker(w);
      ref.workers.erase(w);
    } else if (op < 10) {
      std::vector<BlockHash> snap = random_hashes(20);
      const uint64_t seq = rng() % 50;
      const bool ok = index.ApplySnapshot(w, seq, snap).ok();
      EXPECT_EQ(ok, ref.workers.contains(w));
      if (ok) ref.workers[w] = {{snap.begin(), snap.end()}, true, seq};
    } else {
      KvEventBatch b;
      const auto it = ref.workers.find(w);
      const uint64_t last = it == ref.workers.end() ? 0 : it->second.last;
      const int kind = static_cast<int>(rng() % 20);
      b.sequence_number = kind == 0 ? last + 2 : kind == 1 ? last : last + 1;  // gap, dup, next
      const int events = 1 + static_cast<int>(rng() % 3);
      for (int e = 0; e < events; ++e) {
        const int k = static_cast<int>(rng() % 10);
        const Kind kind = k < 6 ? Kind::kStored : k < 9 ? Kind::kRemoved : Kind::kCleared;
        std::vector<BlockHash> hashes;
        if (kind != Kind::kCleared) hashes = random_hashes(8);
        if (kind == Kind::kStored && !hashes.empty()) prompts.push_back(hashes);
        b.events.push_back(Event(kind, std::move(hashes)));
      }
      ASSERT_EQ(index.ApplyEvents(w, b), ref.Apply(w, b)) << "step " << step;
    }
    if (step % 10 == 0 && !prompts.empty()) {
      std::vector<BlockHash> prompt = prompts[rng() % prompts.size()];
      const auto holder = ref.workers.find(w);
      if (step % 20 == 0 && holder != ref.workers.end()) {
        // A worker's whole block set as the prompt: overlaps long enough
        // to cross the walk's chunks of lookups.
        prompt.assign(holder->second.blocks.begin(), holder->second.blocks.end());
        std::shuffle(prompt.begin(), prompt.end(), rng);
      }
      if (rng() % 2) prompt.push_back(random_hash());
      std::vector<uint32_t> got;
      index.LeadingOverlap(prompt, 0, &got);
      const std::vector<uint32_t> want = ref.Overlap(prompt, kSlots);
      ASSERT_EQ(got, want) << "step " << step;
      longest_overlap = std::max(longest_overlap, *std::max_element(want.begin(), want.end()));
    }
  }
  // Final state, worker by worker.
  size_t pairs = 0;
  std::set<BlockHash> all;
  for (const auto& [id, w] : ref.workers) {
    std::vector<BlockHash> got = index.WorkerBlocks(id);
    std::sort(got.begin(), got.end());
    EXPECT_EQ(got, std::vector<BlockHash>(w.blocks.begin(), w.blocks.end())) << "worker " << id;
    pairs += w.blocks.size();
    all.insert(w.blocks.begin(), w.blocks.end());
  }
  const PrefixIndexStats s = index.stats();
  EXPECT_EQ(s.worker_blocks, pairs);
  EXPECT_EQ(s.entries, all.size());
  EXPECT_EQ(s.gaps, ref.gaps);
  EXPECT_GT(s.gaps, 0u);
  EXPECT_GT(longest_overlap, 32u);  // the walk went past two chunks of lookups
}

// Pending entries against a reference: per block, the workers about to hold
// it and one expiry (the latest AddPending's); a worker's own Stored event
// or a Cleared drops its part. A worker holds a block when it is indexed or
// pending with an expiry after the query's time. The walk looks pending
// entries up only where an alive worker lacks the block, so this drives
// prompts where indexed and pending blocks alternate along long prefixes.
TEST(PrefixIndexTest, PendingMatchesReferenceUnderRandomStreams) {
  constexpr size_t kSlots = 70;  // two bitset words
  std::mt19937_64 rng(777);
  PrefixIndex index({.max_workers = kSlots, .chained_parents = false});  // as above
  std::vector<std::set<BlockHash>> held(kSlots);
  std::vector<uint64_t> seq(kSlots, 0);
  RefPendingMap pending;
  for (WorkerId w = 0; w < kSlots; ++w) {
    ASSERT_TRUE(index.AddWorker(w).ok());
    ASSERT_TRUE(index.ApplySnapshot(w, 0, {}).ok());
  }
  auto random_hash = [&] { return static_cast<BlockHash>(rng() % 64) * 0x100000001ull; };
  auto random_hashes = [&](size_t max_n) {
    std::vector<BlockHash> v(rng() % (max_n + 1));
    for (auto& h : v) h = random_hash();
    return v;
  };
  auto drop_pending = [&](WorkerId w, BlockHash h) {
    auto it = pending.find(h);
    if (it == pending.end()) return;
    it->second.workers.erase(w);
    if (it->second.workers.empty()) pending.erase(it);
  };
  int64_t now = 0;
  int queries_pending_changed = 0;
  uint32_t longest_overlap = 0;
  for (int step = 0; step < 20000; ++step) {
    now += static_cast<int64_t>(rng() % 8);
    // Few workers, so that each holds and is pending for many blocks.
    const WorkerId w = static_cast<WorkerId>(rng() % 6 == 0 ? rng() % kSlots : rng() % 4);
    const int op = static_cast<int>(rng() % 100);
    if (op < 40) {
      const std::vector<BlockHash> hashes = random_hashes(12);
      const int64_t expires = now + 1 + static_cast<int64_t>(rng() % 60);
      index.AddPending(w, hashes, now, expires);
      for (BlockHash h : hashes) {
        pending[h].workers.insert(w);
        pending[h].expires_us = expires;
      }
    } else if (op < 42) {
      index.ExpirePending(now);
      std::erase_if(pending, [&](const auto& e) { return e.second.expires_us <= now; });
    } else if (op < 44) {
      const std::vector<BlockHash> snap = random_hashes(30);
      seq[w] = rng() % 50;
      ASSERT_TRUE(index.ApplySnapshot(w, seq[w], snap).ok());
      held[w] = {snap.begin(), snap.end()};
      for (BlockHash h : snap) drop_pending(w, h);
    } else {
      const int k = static_cast<int>(rng() % 20);
      const Kind kind = k < 12 ? Kind::kStored : k < 19 ? Kind::kRemoved : Kind::kCleared;
      std::vector<BlockHash> hashes;
      if (kind != Kind::kCleared) hashes = random_hashes(8);
      if (kind == Kind::kStored) {
        held[w].insert(hashes.begin(), hashes.end());
        for (BlockHash h : hashes) drop_pending(w, h);
      } else if (kind == Kind::kRemoved) {
        for (BlockHash h : hashes) held[w].erase(h);
      } else {
        held[w].clear();
        std::vector<BlockHash> mine;
        for (const auto& [h, p] : pending) {
          if (p.workers.contains(w)) mine.push_back(h);
        }
        for (BlockHash h : mine) drop_pending(w, h);
      }
      ASSERT_EQ(index.ApplyEvents(w, Batch(++seq[w], kind, std::move(hashes))),
                ApplyOutcome::kApplied);
    }
    if (step % 5 != 0) continue;
    // A prompt of what one worker holds or is pending for, in random order,
    // with a few foreign blocks: long prefixes that switch between the two.
    std::vector<BlockHash> prompt(held[w].begin(), held[w].end());
    for (const auto& [h, p] : pending) {
      if (p.workers.contains(w) && !held[w].contains(h)) prompt.push_back(h);
    }
    std::shuffle(prompt.begin(), prompt.end(), rng);
    for (int extra = static_cast<int>(rng() % 3); extra > 0; --extra) {
      prompt.insert(prompt.begin() + static_cast<std::ptrdiff_t>(rng() % (prompt.size() + 1)),
                    random_hash());
    }
    const int64_t at = now + static_cast<int64_t>(rng() % 40);
    std::vector<uint32_t> got;
    index.LeadingOverlap(prompt, at, &got);
    const std::vector<uint32_t> want = NaiveOverlap(held, &pending, prompt, at);
    ASSERT_EQ(got, want) << "step " << step;
    queries_pending_changed += want != NaiveOverlap(held, nullptr, prompt, at);
    longest_overlap = std::max(longest_overlap, *std::max_element(want.begin(), want.end()));
  }
  // The pending entries decided many answers, and prefixes crossed chunks.
  EXPECT_GT(queries_pending_changed, 500);
  EXPECT_GT(longest_overlap, 32u);
}

// A snapshot names no parents, so its blocks count as holes and queries
// walk, until the router confirms a prompt's blocks it found the worker
// holding (AdoptHeldPrefix) or the blocks go.
TEST(PrefixIndexTest, SnapshotBlocksBisectOnceAPromptConfirmsTheirParents) {
  PrefixIndex index({.max_workers = 2});
  ASSERT_TRUE(index.AddWorker(0).ok());
  ASSERT_TRUE(index.ApplySnapshot(0, 0, std::vector<BlockHash>{30, 10, 20, 99}).ok());
  const std::vector<BlockHash> prompt{10, 20, 30, 40};
  EXPECT_EQ(Overlap(index, prompt)[0], 3u);
  EXPECT_EQ(index.stats().bisected_queries, 0u);
  index.AdoptHeldPrefix(0, std::span(prompt).first(2));  // 10 and 20 only
  EXPECT_EQ(Overlap(index, prompt)[0], 3u);
  EXPECT_EQ(index.stats().bisected_queries, 0u);  // 30 and 99 still without parents
  index.AdoptHeldPrefix(0, prompt);               // stops at 40, which it lacks
  ASSERT_EQ(index.ApplyEvents(0, Batch(1, Kind::kRemoved, {99})), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, prompt)[0], 3u);
  EXPECT_EQ(index.stats().bisected_queries, 1u);
  // Evicting 20 before 30 leaves a hole: the walk answers again, and right.
  ASSERT_EQ(index.ApplyEvents(0, Batch(2, Kind::kRemoved, {20})), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, prompt)[0], 1u);
  EXPECT_EQ(index.stats().bisected_queries, 1u);
  ASSERT_EQ(index.ApplyEvents(0, Batch(3, Kind::kRemoved, {30})), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, prompt)[0], 1u);
  EXPECT_EQ(index.stats().bisected_queries, 2u);
}

// Streams an engine could send: blocks form a forest (each block's parent is
// fixed, as hash chains make it), stored runs name their real parents, and
// prompts are root-to-block paths. Most stores extend a prefix the worker
// holds and most removals take a path's tail first, as an engine's cache
// does; the rest leave holes (a run stored under an absent parent, a block
// evicted before its children), as do snapshots (no parents) and stores
// refused at the memory bound. The answers must be the naive walk's, and
// most must come from the bisection.
TEST(PrefixIndexTest, BisectionMatchesTheWalkOnChainedStreams) {
  constexpr size_t kSlots = 70;  // two bitset words
  constexpr size_t kBlocks = 400;
  constexpr size_t kMaxEntries = 360;  // some stores are refused
  std::mt19937_64 rng(2026);
  PrefixIndex index({.max_workers = kSlots, .max_entries = kMaxEntries});
  // The forest: block b's hash, its parent (or none) and its root-to-b path.
  auto hash_of = [](size_t b) { return static_cast<BlockHash>(b) * 0x9E3779B97F4A7C15ull + 1; };
  std::vector<std::optional<size_t>> parent(kBlocks);
  std::vector<std::vector<BlockHash>> path(kBlocks);
  std::map<BlockHash, std::vector<BlockHash>> children;
  for (size_t b = 0; b < kBlocks; ++b) {
    if (b > 0 && rng() % 12 != 0) parent[b] = b - 1 - rng() % std::min<size_t>(b, 8);
    if (parent[b]) {
      path[b] = path[*parent[b]];
      children[hash_of(*parent[b])].push_back(hash_of(b));
    }
    path[b].push_back(hash_of(b));
  }
  std::vector<std::set<BlockHash>> held(kSlots);
  std::vector<uint64_t> seq(kSlots, 0);
  RefPendingMap pending;
  auto indexed = [&] {
    std::set<BlockHash> all;
    for (const auto& h : held) all.insert(h.begin(), h.end());
    return all;
  };
  auto store = [&](WorkerId w, std::vector<BlockHash> run, std::optional<BlockHash> first_parent) {
    std::set<BlockHash> all = indexed();
    for (BlockHash h : run) {
      if (!all.contains(h) && all.size() >= kMaxEntries) continue;  // refused
      all.insert(h);
      held[w].insert(h);
      if (auto it = pending.find(h); it != pending.end()) it->second.workers.erase(w);
    }
    KvEventBatch b;
    b.sequence_number = ++seq[w];
    b.events.push_back(KvStored{std::move(run), first_parent});
    ASSERT_EQ(index.ApplyEvents(w, b), ApplyOutcome::kApplied);
  };
  for (WorkerId w = 0; w < kSlots; ++w) {
    ASSERT_TRUE(index.AddWorker(w).ok());
    ASSERT_TRUE(index.ApplySnapshot(w, 0, {}).ok());
  }
  int64_t now = 0;
  int queries = 0, with_hole = 0, long_answers = 0, pending_decided = 0, bisected_by_pending = 0;
  for (int step = 0; step < 20000; ++step) {
    now += static_cast<int64_t>(rng() % 4);
    const WorkerId w = static_cast<WorkerId>(rng() % 8 == 0 ? rng() % kSlots : rng() % 6);
    const std::vector<BlockHash>& p = path[rng() % kBlocks];
    const int op = static_cast<int>(rng() % 100);
    if (op < 40) {
      // Store the path from the first block w lacks (an engine's prefill),
      // or now and then from anywhere in it.
      size_t from = 0;
      while (from < p.size() && held[w].contains(p[from])) ++from;
      if (op < 1) from = rng() % p.size();
      if (from == p.size()) continue;
      store(w, {p.begin() + static_cast<std::ptrdiff_t>(from), p.end()},
            from == 0 ? std::nullopt : std::optional<BlockHash>(p[from - 1]));
    } else if (op < 75) {
      // Evict: the path's tail first, or now and then one block anywhere.
      std::vector<BlockHash> gone;
      if (op < 74) {
        // An engine's cache evicts a block only after its children.
        const size_t want = 1 + rng() % 6;
        for (size_t i = p.size(); i-- > 0 && gone.size() < want;) {
          const BlockHash h = p[i];
          const bool leaf = std::none_of(children[h].begin(), children[h].end(),
                                         [&](BlockHash c) { return held[w].contains(c); });
          if (held[w].contains(h) && leaf) {
            gone.push_back(h);
            held[w].erase(h);
          }
        }
      } else {
        gone.push_back(p[rng() % p.size()]);
      }
      for (BlockHash h : gone) held[w].erase(h);
      KvEventBatch b;
      b.sequence_number = ++seq[w];
      b.events.push_back(KvRemoved{std::move(gone)});
      ASSERT_EQ(index.ApplyEvents(w, b), ApplyOutcome::kApplied);
    } else if (op < 76 && rng() % 8 == 0) {
      // A snapshot (rare, as resyncs are): what w holds, its parents
      // unknown until those blocks go.
      std::vector<BlockHash> snap(held[w].begin(), held[w].end());
      if (rng() % 2) snap.resize(snap.size() / 2);
      held[w] = {snap.begin(), snap.end()};
      seq[w] = rng() % 50;
      ASSERT_TRUE(index.ApplySnapshot(w, seq[w], snap).ok());
      for (auto& [h, e] : pending) {
        if (held[w].contains(h)) e.workers.erase(w);
      }
    } else if (op < 77) {
      KvEventBatch b;
      b.sequence_number = ++seq[w];
      b.events.push_back(KvCleared{});
      ASSERT_EQ(index.ApplyEvents(w, b), ApplyOutcome::kApplied);
      held[w].clear();
      for (auto& [h, e] : pending) e.workers.erase(w);
    } else if (op < 86) {
      // A routing decision's pending entries: the path past w's prefix.
      size_t from = 0;
      while (from < p.size() && held[w].contains(p[from])) ++from;
      const std::vector<BlockHash> rest(p.begin() + static_cast<std::ptrdiff_t>(from), p.end());
      const int64_t expires = now + 1 + static_cast<int64_t>(rng() % 60);
      index.AddPending(w, rest, now, expires);
      for (BlockHash h : rest) {
        pending[h].workers.insert(w);
        pending[h].expires_us = expires;
      }
    } else {
      // A query: a path, sometimes with a block no one holds after it.
      std::vector<BlockHash> prompt = p;
      if (rng() % 3 == 0) prompt.push_back(hash_of(kBlocks + rng() % 100));
      std::vector<uint32_t> got;
      const uint64_t bisected_before = index.stats().bisected_queries;
      index.LeadingOverlap(prompt, now, &got);
      const std::vector<uint32_t> want = NaiveOverlap(held, &pending, prompt, now);
      ASSERT_EQ(got, want) << "step " << step;
      ++queries;
      // Pending entries carried a worker past its held blocks, and the
      // bisection answered.
      const bool by_pending = want != NaiveOverlap(held, nullptr, prompt, now);
      pending_decided += by_pending;
      bisected_by_pending += by_pending && index.stats().bisected_queries > bisected_before;
      long_answers += *std::max_element(want.begin(), want.end()) >= 4;
      // As the router does after routing the prompt to w: w's snapshot
      // blocks along it learn their parents.
      if (rng() % 2) index.AdoptHeldPrefix(w, std::span(prompt).first(want[w]));
      for (WorkerId v = 0; v < kSlots; ++v) {
        for (size_t i = 1; i < p.size(); ++i) {
          if (held[v].contains(p[i]) && !held[v].contains(p[i - 1]) && held[v].contains(p[0])) {
            ++with_hole;
            v = kSlots - 1;
            break;
          }
        }
      }
    }
  }
  // Both paths answered many queries, with holes among their holders;
  // prefixes were long enough to bisect; pending entries decided answers,
  // some of them bisected.
  const PrefixIndexStats s = index.stats();
  EXPECT_GT(s.rejected_stores, 0u);
  EXPECT_GT(with_hole, queries / 20);
  EXPECT_GT(long_answers, queries / 4);
  EXPECT_GT(s.bisected_queries, static_cast<uint64_t>(queries) / 8);
  EXPECT_GT(pending_decided, queries / 20);
  EXPECT_GT(bisected_by_pending, pending_decided / 10);
  EXPECT_LT(s.bisected_queries, static_cast<uint64_t>(queries));
}

// Lower tiers: Stored/Removed events of the host and disk tiers and the
// snapshot's lists give each worker's run of blocks past its device prefix;
// a device reset (Cleared) keeps them, removing the worker drops them.
TEST(PrefixIndexTest, LowerTierRunsFollowTheirEventsAndSnapshots) {
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0).ok());
  ASSERT_TRUE(index.AddWorker(1).ok());
  const std::vector<BlockHash> host = {3, 4}, disk = {5};
  ASSERT_TRUE(index.ApplySnapshot(0, 0, std::vector<BlockHash>{1, 2}, host, disk).ok());
  ASSERT_TRUE(index.ApplySnapshot(1, 0, {}).ok());
  const std::vector<BlockHash> prompt = {1, 2, 3, 4, 5, 6};
  EXPECT_EQ(Overlap(index, prompt)[0], 2u);
  TierRun run = index.LowerTierRun(0, prompt, 2);
  EXPECT_EQ(run.host_blocks, 2);
  EXPECT_EQ(run.disk_blocks, 1);
  EXPECT_EQ(index.LowerTierRun(1, prompt, 0).blocks(), 0);
  // Block 4 leaves the host tier for the disk: the run goes on through it.
  KvEventBatch b;
  b.sequence_number = 1;
  b.events.push_back(KvRemoved{{4}, KvTier::kHost});
  b.events.push_back(KvStored{{4}, std::nullopt, KvTier::kDisk});
  ASSERT_EQ(index.ApplyEvents(0, b), ApplyOutcome::kApplied);
  run = index.LowerTierRun(0, prompt, 2);
  EXPECT_EQ(run.host_blocks, 1);
  EXPECT_EQ(run.disk_blocks, 2);
  // Match gives the same overlaps, runs and block counts under one lock.
  std::vector<uint32_t> overlap;
  std::vector<PrefixIndex::WorkerMatch> match;
  index.Match(prompt, 0, &overlap, &match);
  EXPECT_EQ(overlap, Overlap(index, prompt));
  ASSERT_EQ(match.size(), overlap.size());
  EXPECT_EQ(match[0].lower.host_blocks, 1);
  EXPECT_EQ(match[0].lower.disk_blocks, 2);
  EXPECT_EQ(match[0].blocks, index.WorkerBlockCount(0));
  EXPECT_EQ(match[0].blocks, 2u);
  EXPECT_EQ(match[1].lower.blocks(), 0);
  EXPECT_EQ(match[1].blocks, 0u);
  // Block 3 is dropped: the run stops at once.
  ASSERT_EQ(index.ApplyEvents(0, {2, {KvRemoved{{3}, KvTier::kHost}}}), ApplyOutcome::kApplied);
  EXPECT_EQ(index.LowerTierRun(0, prompt, 2).blocks(), 0);
  EXPECT_EQ(index.LowerTierRun(0, prompt, 3).blocks(), 2);
  // Device events never touch the tiers, and tier events never the device.
  EXPECT_EQ(Overlap(index, prompt)[0], 2u);
  ASSERT_EQ(index.ApplyEvents(0, {3, {KvCleared{}}}), ApplyOutcome::kApplied);
  EXPECT_EQ(Overlap(index, prompt)[0], 0u);
  EXPECT_EQ(index.LowerTierRun(0, prompt, 3).blocks(), 2) << "a device reset emptied the tiers";
  EXPECT_EQ(index.stats().lower_tier_blocks, 2u);
  index.RemoveWorker(0);
  EXPECT_EQ(index.LowerTierRun(0, prompt, 3).blocks(), 0);
  EXPECT_EQ(index.stats().lower_tier_blocks, 0u);
}

TEST(PrefixIndexTest, LowerTiersAreBoundedPerWorker) {
  PrefixIndexOptions o;
  o.max_lower_tier_blocks = 3;
  PrefixIndex index(o);
  ASSERT_TRUE(index.AddWorker(0).ok());
  ASSERT_TRUE(index.ApplySnapshot(0, 0, {}, std::vector<BlockHash>{1, 2, 3, 4, 5}, {}).ok());
  EXPECT_EQ(index.stats().lower_tier_blocks, 3u);
  EXPECT_EQ(index.stats().rejected_stores, 2u);
}

}  // namespace
}  // namespace pdserve::router

namespace pdserve::router {
namespace {

// GroupedOverlap against CachedPrefixBlocks evaluated on a plain model of
// what each worker stored (keys per group), pending entries included.
TEST(PrefixIndexGroupsTest, GroupedOverlapIsTheWindowedRulePerWorker) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 40; ++trial) {
    const size_t B = 1 + rng() % 4, workers = 1 + rng() % 70;
    std::vector<int64_t> windows{0, static_cast<int64_t>(1 + rng() % 10),
                                 static_cast<int64_t>(1 + rng() % 10)};
    PrefixIndex index;
    std::vector<BlockHash> hashes(1 + rng() % 10);
    for (auto& h : hashes) h = rng();
    std::vector<std::set<BlockHash>> held(workers);
    for (WorkerId w = 0; w < workers; ++w) {
      ASSERT_TRUE(index.AddWorker(w).ok());
      ASSERT_TRUE(index.ApplySnapshot(w, 0, {}).ok());
      KvEventBatch b;
      b.sequence_number = 1;
      KvStored stored;
      for (size_t g = 0; g < windows.size(); ++g) {
        for (size_t i = 0; i < hashes.size(); ++i) {
          if (rng() % 4 == 0) continue;
          stored.block_hashes.push_back(GroupBlockKey(hashes[i], static_cast<uint32_t>(g)));
          held[w].insert(stored.block_hashes.back());
        }
      }
      b.events.push_back(stored);
      ASSERT_EQ(index.ApplyEvents(w, b), ApplyOutcome::kApplied);
      if (rng() % 3 == 0) {  // a pending block counts until it expires
        const BlockHash key = GroupBlockKey(hashes[rng() % hashes.size()], 1);
        index.AddPending(w, std::span(&key, 1), 0, 100);
        held[w].insert(key);
      }
    }
    std::vector<uint32_t> out;
    index.GroupedOverlap(hashes, windows, B, 50, &out);
    for (WorkerId w = 0; w < workers; ++w) {
      const size_t expected =
          CachedPrefixBlocks(windows, B, hashes.size(), [&](size_t g, size_t i) {
            return held[w].count(GroupBlockKey(hashes[i], static_cast<uint32_t>(g))) > 0;
          });
      ASSERT_EQ(out[w], expected) << "trial " << trial << " worker " << w;
    }
  }
  // One full group is the leading overlap.
  PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0).ok());
  ASSERT_TRUE(index.ApplySnapshot(0, 0, std::vector<BlockHash>{1, 2}).ok());
  std::vector<uint32_t> out;
  const std::vector<int64_t> full{0};
  index.GroupedOverlap(std::vector<BlockHash>{1, 2, 3}, full, 4, 0, &out);
  EXPECT_EQ(out[0], 2u);
}

}  // namespace
}  // namespace pdserve::router
