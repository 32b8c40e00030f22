#include "services/router/prefix_index.h"

#include <algorithm>
#include <bit>
#include <limits>
#include <mutex>
#include <unordered_set>

#include "common/kv_groups.h"
#include "services/router/detail/block_table.h"

namespace pdserve::router {

using detail::BlockTable;

namespace {
// Blocks whose table slots are loaded together (BlockTable::Warm) before
// they are looked up one by one: enough misses in flight to cover memory
// latency, few enough that a walk ending early wastes little.
constexpr size_t kWarmChunk = 16;
// The bisection of LeadingOverlapLocked handles up to this many bitset words
// (1,024 workers); more take the walk.
constexpr size_t kMaxSearchWords = 16;

inline void SetBit(uint64_t* words, WorkerId w) { words[w >> 6] |= uint64_t{1} << (w & 63); }
inline void ClearBit(uint64_t* words, WorkerId w) { words[w >> 6] &= ~(uint64_t{1} << (w & 63)); }
inline bool TestBit(const uint64_t* words, WorkerId w) { return (words[w >> 6] >> (w & 63)) & 1; }
// Whether `held` (null: nobody) has every bit of `alive`.
inline bool Covers(const uint64_t* held, const uint64_t* alive, size_t n) {
  if (held == nullptr) return false;
  for (size_t i = 0; i < n; ++i) {
    if ((alive[i] & ~held[i]) != 0) return false;
  }
  return true;
}
inline bool AllZero(const uint64_t* words, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (words[i] != 0) return false;
  }
  return true;
}
}  // namespace

const char* ApplyOutcomeName(ApplyOutcome outcome) {
  switch (outcome) {
    case ApplyOutcome::kApplied:
      return "applied";
    case ApplyOutcome::kDuplicate:
      return "duplicate";
    case ApplyOutcome::kNeedsResync:
      return "needs_resync";
    case ApplyOutcome::kUnknownWorker:
      return "unknown_worker";
  }
  return "?";
}

// A worker's own device blocks, for purges and for the chain bookkeeping
// that lets a query bisect (see LeadingOverlapLocked): per block its
// parent (kParent) and state (kState: held and parent flags, and in the
// high half how many of the worker's held blocks name it as their parent).
// A block the worker does not hold stays as a "ghost" while held children
// name it, so that its return (or a child's removal) finds their count.
struct PrefixIndex::WorkerState {
  static constexpr size_t kParent = 0, kState = 1, kWords = 2;
  static constexpr uint64_t kHeld = 1, kHasParent = 2, kOrphan = 4;
  static constexpr int kChildShift = 32;

  bool open = false;
  bool synced = false;  // a snapshot was applied and no gap seen since
  uint64_t last_seq = 0;
  std::unique_ptr<BlockTable> blocks;  // held blocks and ghosts (above)
  size_t held = 0;                     // blocks held (ghosts not counted)
  // Held blocks whose parent the worker does not hold, or does not say
  // (snapshots): while there are none, the blocks it holds are closed
  // under parents, so holding a prompt's block i means holding blocks 0..i.
  size_t holes = 0;
  size_t orphans = 0;                        // of them, snapshot blocks (parent unknown)
  bool untracked = false;                    // a ghost did not fit: holes unknown until a purge
  std::unordered_set<BlockHash> host, disk;  // its lower tiers

  bool PrefixClosed() const { return holes == 0 && !untracked; }
};

PrefixIndex::PrefixIndex(PrefixIndexOptions options)
    : options_(options),
      words_((std::max<size_t>(options.max_workers, 1) + 63) / 64),
      blocks_(std::make_unique<BlockTable>(words_, options.max_entries)),
      pending_(std::make_unique<BlockTable>(words_ + 1, options.max_pending)),
      spare_pending_(std::make_unique<BlockTable>(words_ + 1, options.max_pending)),
      workers_(options.max_workers) {
  // The pending tables fill and empty with bursts; allocating them once
  // keeps rehashing off the routing path.
  pending_->Reserve(options.max_pending);
  spare_pending_->Reserve(options.max_pending);
}

PrefixIndex::~PrefixIndex() = default;

Status PrefixIndex::AddWorker(WorkerId worker) {
  std::unique_lock lock(mu_);
  if (worker >= workers_.size()) {
    return Status::InvalidArgument("worker slot " + std::to_string(worker) +
                                   " is beyond the index's " + std::to_string(workers_.size()) +
                                   " slots");
  }
  WorkerState& w = workers_[worker];
  if (w.open) return Status::InvalidArgument("worker slot " + std::to_string(worker) + " in use");
  w.open = true;
  w.synced = false;
  w.last_seq = 0;
  // A worker never holds more distinct blocks than the index does; its
  // ghosts are at most as many again.
  w.blocks = std::make_unique<BlockTable>(WorkerState::kWords, 2 * options_.max_entries);
  return Status::Ok();
}

void PrefixIndex::RemoveWorker(WorkerId worker) {
  std::unique_lock lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].open) return;
  PurgeBlocksLocked(worker);
  PurgePendingLocked(worker);
  workers_[worker] = WorkerState{};
}

void PrefixIndex::StoreLowerLocked(WorkerId worker, KvTier tier,
                                   std::span<const BlockHash> hashes) {
  auto& set = tier == KvTier::kHost ? workers_[worker].host : workers_[worker].disk;
  for (BlockHash h : hashes) {
    if (set.size() >= options_.max_lower_tier_blocks && !set.count(h)) {
      ++counters_.rejected_stores;
      continue;
    }
    set.insert(h);
  }
}

TierRun PrefixIndex::LowerTierRun(WorkerId worker, std::span<const BlockHash> hashes,
                                  size_t from) const {
  std::shared_lock lock(mu_);
  return LowerTierRunLocked(worker, hashes, from);
}

TierRun PrefixIndex::LowerTierRunLocked(WorkerId worker, std::span<const BlockHash> hashes,
                                        size_t from) const {
  TierRun run;
  if (worker >= workers_.size() || !workers_[worker].open) return run;
  const WorkerState& w = workers_[worker];
  if (w.host.empty() && w.disk.empty()) return run;
  for (size_t i = from; i < hashes.size(); ++i) {
    if (w.host.count(hashes[i])) {
      ++run.host_blocks;
    } else if (w.disk.count(hashes[i])) {
      ++run.disk_blocks;
    } else {
      break;
    }
  }
  return run;
}

void PrefixIndex::GroupedTierRuns(std::span<const BlockHash> hashes,
                                  std::span<const int64_t> windows, size_t block_size,
                                  std::span<const uint32_t> device_blocks, int64_t sink_tokens,
                                  std::vector<WorkerMatch>* workers) const {
  auto key = [&](size_t g, size_t i) { return GroupBlockKey(hashes[i], static_cast<uint32_t>(g)); };
  std::shared_lock lock(mu_);
  const size_t n = std::min({workers_.size(), device_blocks.size(), workers->size()});
  for (WorkerId id = 0; id < n; ++id) {
    const WorkerState& w = workers_[id];
    if (!w.open || (w.host.empty() && w.disk.empty())) continue;
    const size_t device = device_blocks[id];
    TierRun& run = (*workers)[id].lower;
    run = TierRun{};
    const size_t end = CachedPrefixBlocks(
        windows, block_size, hashes.size(),
        [&](size_t g, size_t i) {
          return i < device || w.host.count(key(g, i)) > 0 || w.disk.count(key(g, i)) > 0;
        },
        sink_tokens);
    const auto pos = static_cast<int64_t>(end * block_size);  // the first query's
    for (size_t i = device; i < end; ++i) {
      bool reached = false, disk = false;
      for (size_t g = 0; g < windows.size(); ++g) {
        if (!BlockInReach(windows[g], sink_tokens, pos, static_cast<int64_t>(block_size),
                          static_cast<int64_t>(i))) {
          continue;
        }
        reached = true;
        disk |= w.host.count(key(g, i)) == 0;
      }
      ++(!reached ? run.skipped_blocks : disk ? run.disk_blocks : run.host_blocks);
    }
  }
}

void PrefixIndex::StoreLocked(WorkerId worker, std::span<const BlockHash> hashes,
                              StoredParents parents, std::optional<BlockHash> first_parent) {
  WorkerState& w = workers_[worker];
  BlockTable& mine = *w.blocks;
  const size_t n = hashes.size();
  for (size_t i = 0; i < n; ++i) {
    if (i % kWarmChunk == 0) {
      const auto chunk = hashes.subspan(i, std::min(kWarmChunk, n - i));
      blocks_->Warm(chunk);
      mine.Warm(chunk);
    }
    const BlockHash h = hashes[i];
    bool inserted = false;
    const size_t slot = blocks_->FindOrInsert(h, &inserted);
    if (slot == BlockTable::kNotFound) {
      ++counters_.rejected_stores;
      continue;  // not held, as far as the index knows: its children are holes
    }
    SetBit(blocks_->words(slot), worker);
    if (pending_->size() != 0) ClearPendingBitLocked(h, worker);  // the real event supersedes
    std::optional<BlockHash> parent;
    if (parents == StoredParents::kChain) parent = i == 0 ? first_parent : hashes[i - 1];
    NoteHeldLocked(w, h, parents == StoredParents::kUnknown, parent);
  }
  counters_.events_applied += n;
}

void PrefixIndex::NoteHeldLocked(WorkerState& w, BlockHash h, bool orphan,
                                 std::optional<BlockHash> parent) {
  using WS = WorkerState;
  BlockTable& mine = *w.blocks;
  bool inserted = false;
  const size_t slot = mine.FindOrInsert(h, &inserted);
  if (slot == BlockTable::kNotFound) {
    w.untracked = true;  // unreachable while ghosts fit (see AddWorker)
    return;
  }
  uint64_t* e = mine.words(slot);
  if ((e[WS::kState] & WS::kHeld) != 0) return;  // already held: nothing changes
  const uint64_t children = e[WS::kState] >> WS::kChildShift;
  w.holes -= children;  // they were holes (a ghost's children) and are not now
  ++w.held;
  e[WS::kState] = WS::kHeld | (children << WS::kChildShift);
  if (orphan) {
    e[WS::kState] |= WS::kOrphan;
    ++w.holes;
    ++w.orphans;
    return;
  }
  if (!parent) return;  // the first block of a prompt
  e[WS::kState] |= WS::kHasParent;
  e[WS::kParent] = *parent;
  const size_t p = mine.FindOrInsert(*parent, &inserted);  // may move h's slot: done with it
  if (p == BlockTable::kNotFound) {
    w.untracked = true;
    return;
  }
  uint64_t* pe = mine.words(p);
  pe[WS::kState] += uint64_t{1} << WS::kChildShift;
  if ((pe[WS::kState] & WS::kHeld) == 0) ++w.holes;  // a ghost parent: h is a hole
}

// Whether `h` was held (and is not now). Keeps the holes count: h's held
// children become holes, and h stops being one.
bool PrefixIndex::NoteRemovedLocked(WorkerState& w, BlockHash h) {
  using WS = WorkerState;
  BlockTable& mine = *w.blocks;
  const size_t slot = mine.Find(h);
  if (slot == BlockTable::kNotFound) return false;
  uint64_t* e = mine.words(slot);
  const uint64_t state = e[WS::kState];
  if ((state & WS::kHeld) == 0) return false;  // a ghost
  const BlockHash parent = e[WS::kParent];
  const uint64_t children = state >> WS::kChildShift;
  --w.held;
  if (children != 0) {
    w.holes += children;
    e[WS::kState] = children << WS::kChildShift;  // a ghost
  } else {
    mine.EraseSlot(slot);
  }
  if ((state & WS::kOrphan) != 0) {
    --w.holes;
    --w.orphans;
  } else if ((state & WS::kHasParent) != 0) {
    const size_t p = mine.Find(parent);
    if (p == BlockTable::kNotFound) return true;  // only after an untracked insert
    uint64_t* pe = mine.words(p);
    pe[WS::kState] -= uint64_t{1} << WS::kChildShift;
    if ((pe[WS::kState] & WS::kHeld) == 0) {
      --w.holes;  // h was a hole
      if ((pe[WS::kState] >> WS::kChildShift) == 0) mine.EraseSlot(p);
    }
  }
  return true;
}

void PrefixIndex::RemoveLocked(WorkerId worker, std::span<const BlockHash> hashes) {
  WorkerState& w = workers_[worker];
  BlockTable& mine = *w.blocks;
  const size_t n = hashes.size();
  for (size_t i = 0; i < n; ++i) {
    if (i % kWarmChunk == 0) {
      const auto chunk = hashes.subspan(i, std::min(kWarmChunk, n - i));
      blocks_->Warm(chunk);
      mine.Warm(chunk);
    }
    const BlockHash h = hashes[i];
    if (!NoteRemovedLocked(w, h)) {
      ++counters_.unknown_removes;
      continue;
    }
    const size_t slot = blocks_->Find(h);
    if (slot == BlockTable::kNotFound) continue;  // unreachable: held ⊆ blocks_
    uint64_t* words = blocks_->words(slot);
    ClearBit(words, worker);
    if (AllZero(words, words_)) blocks_->EraseSlot(slot);
  }
  counters_.events_applied += n;
}

void PrefixIndex::PurgeBlocksLocked(WorkerId worker) {
  WorkerState& w = workers_[worker];
  w.blocks->ForEach([&](uint64_t h, const uint64_t* e) {
    if ((e[WorkerState::kState] & WorkerState::kHeld) == 0) return;  // a ghost
    const size_t slot = blocks_->Find(h);
    if (slot == BlockTable::kNotFound) return;
    uint64_t* words = blocks_->words(slot);
    ClearBit(words, worker);
    if (AllZero(words, words_)) blocks_->EraseSlot(slot);
  });
  w.blocks->Clear();
  w.held = 0;
  w.holes = 0;
  w.orphans = 0;
  w.untracked = false;
}

void PrefixIndex::ClearPendingBitLocked(BlockHash hash, WorkerId worker) {
  const size_t slot = pending_->Find(hash);
  if (slot == BlockTable::kNotFound) return;
  uint64_t* words = pending_->words(slot);
  ClearBit(words, worker);
  if (AllZero(words, words_)) pending_->EraseSlot(slot);
}

void PrefixIndex::PurgePendingLocked(WorkerId worker) {
  // Collect first: erasing shifts entries, which would upset the iteration.
  std::vector<BlockHash> hashes;
  pending_->ForEach([&](uint64_t h, const uint64_t* words) {
    if (TestBit(words, worker)) hashes.push_back(h);
  });
  for (BlockHash h : hashes) ClearPendingBitLocked(h, worker);
}

void PrefixIndex::SweepPendingLocked(int64_t now_us) {
  std::vector<BlockHash> expired;
  pending_->ForEach([&](uint64_t h, const uint64_t* words) {
    if (static_cast<int64_t>(words[words_]) <= now_us) expired.push_back(h);
  });
  for (BlockHash h : expired) pending_->Erase(h);
}

ApplyOutcome PrefixIndex::ApplyEvents(WorkerId worker, const KvEventBatch& batch) {
  std::unique_lock lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].open) return ApplyOutcome::kUnknownWorker;
  WorkerState& w = workers_[worker];
  if (!w.synced) return ApplyOutcome::kNeedsResync;
  if (batch.sequence_number <= w.last_seq) {
    ++counters_.duplicate_batches;
    return ApplyOutcome::kDuplicate;
  }
  if (batch.sequence_number != w.last_seq + 1) {
    ++counters_.gaps;
    w.synced = false;
    return ApplyOutcome::kNeedsResync;
  }
  w.last_seq = batch.sequence_number;
  for (const KvEvent& event : batch.events) {
    if (const auto* e = std::get_if<KvStored>(&event)) {
      if (e->tier == KvTier::kDevice) {
        StoreLocked(worker, e->block_hashes, StoredParents::kChain, e->parent_hash);
      } else {
        StoreLowerLocked(worker, e->tier, e->block_hashes);
      }
    } else if (const auto* e = std::get_if<KvRemoved>(&event)) {
      if (e->tier == KvTier::kDevice) {
        RemoveLocked(worker, e->block_hashes);
      } else {
        auto& set = e->tier == KvTier::kHost ? w.host : w.disk;
        for (BlockHash h : e->block_hashes) set.erase(h);
      }
    } else {
      PurgeBlocksLocked(worker);  // KvCleared
      PurgePendingLocked(worker);
    }
  }
  ++counters_.batches_applied;
  return ApplyOutcome::kApplied;
}

Status PrefixIndex::ApplySnapshot(WorkerId worker, uint64_t seq, std::span<const BlockHash> hashes,
                                  std::span<const BlockHash> host,
                                  std::span<const BlockHash> disk) {
  std::unique_lock lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].open) {
    return Status::NotFound("snapshot for unknown worker slot " + std::to_string(worker));
  }
  PurgeBlocksLocked(worker);
  workers_[worker].host.clear();
  workers_[worker].disk.clear();
  StoreLowerLocked(worker, KvTier::kHost, host);
  StoreLowerLocked(worker, KvTier::kDisk, disk);
  const uint64_t applied_before = counters_.events_applied;
  StoreLocked(worker, hashes, StoredParents::kUnknown);  // a set: no parents
  counters_.events_applied = applied_before;             // a snapshot is not a stream of events
  WorkerState& w = workers_[worker];
  w.synced = true;
  w.last_seq = seq;
  ++counters_.snapshots_applied;
  return Status::Ok();
}

bool PrefixIndex::NeedsResync(WorkerId worker) const {
  std::shared_lock lock(mu_);
  return worker < workers_.size() && workers_[worker].open && !workers_[worker].synced;
}

void PrefixIndex::LeadingOverlap(std::span<const BlockHash> hashes, int64_t now_us,
                                 std::vector<uint32_t>* out) const {
  out->assign(workers_.size(), 0);
  if (hashes.empty()) return;
  std::shared_lock lock(mu_);
  LeadingOverlapLocked(hashes, now_us, out);
}

void PrefixIndex::Match(std::span<const BlockHash> hashes, int64_t now_us,
                        std::vector<uint32_t>* overlap, std::vector<WorkerMatch>* workers) const {
  overlap->assign(workers_.size(), 0);
  workers->assign(workers_.size(), WorkerMatch{});
  std::shared_lock lock(mu_);
  if (!hashes.empty()) LeadingOverlapLocked(hashes, now_us, overlap);
  for (WorkerId w = 0; w < workers_.size(); ++w) {
    const WorkerState& state = workers_[w];
    if (!state.open) continue;
    (*workers)[w].blocks = state.held;
    if (!state.host.empty() || !state.disk.empty()) {
      (*workers)[w].lower = LowerTierRunLocked(w, hashes, (*overlap)[w]);
    }
  }
}

bool PrefixIndex::ClosedPrefixOverlapLocked(std::span<const BlockHash> hashes, int64_t now_us,
                                            std::vector<uint32_t>* out) const {
  static constexpr uint64_t kNobody[kMaxSearchWords] = {};
  if (!options_.chained_parents || words_ > kMaxSearchWords) return false;
  const size_t n = hashes.size();
  const bool any_pending = pending_->size() != 0;
  auto held = [&](size_t i) {
    const size_t slot = blocks_->Find(hashes[i]);
    return slot == BlockTable::kNotFound ? kNobody : blocks_->words(slot);
  };
  // The workers a live pending entry names at block i (kNobody: none).
  auto pending = [&](size_t i) {
    if (!any_pending) return kNobody;
    const size_t p = pending_->Find(hashes[i]);
    if (p == BlockTable::kNotFound) return kNobody;
    const uint64_t* words = pending_->words(p);
    return static_cast<int64_t>(words[words_]) > now_us ? words : kNobody;
  };
  auto all_closed = [&](const uint64_t* who) {
    for (size_t k = 0; k < words_; ++k) {
      for (uint64_t rest = who[k]; rest != 0; rest &= rest - 1) {
        if (!workers_[k * 64 + std::countr_zero(rest)].PrefixClosed()) return false;
      }
    }
    return true;
  };
  // Workers `who` (closed under parents) hold nothing of the prompt from
  // block `from` on: holding a later block would mean holding this one. So
  // only pending entries can carry them on, and each stops at the first
  // block from `from` whose live pending entry does not name it.
  auto carry_on = [&](size_t from, uint64_t* who) {
    for (size_t i = from; i < n; ++i) {
      if ((i - from) % kWarmChunk == 0) {
        pending_->Warm(hashes.subspan(i, std::min(kWarmChunk, n - i)));
      }
      const uint64_t* p = pending(i);
      bool any = false;
      for (size_t k = 0; k < words_; ++k) {
        for (uint64_t stop = who[k] & ~p[k]; stop != 0; stop &= stop - 1) {
          (*out)[k * 64 + std::countr_zero(stop)] = static_cast<uint32_t>(i);
        }
        who[k] &= p[k];
        any |= who[k] != 0;
      }
      if (!any) return;
    }
    for (size_t k = 0; k < words_; ++k) {
      for (uint64_t rest = who[k]; rest != 0; rest &= rest - 1) {
        (*out)[k * 64 + std::countr_zero(rest)] = static_cast<uint32_t>(n);
      }
    }
  };
  blocks_->Warm(hashes.subspan(n - 1));  // its miss overlaps block 0's
  const uint64_t* first = held(0);
  // Every holder of block 0 must have its blocks closed under parents; so
  // must every worker pending there without holding it, whose overlap the
  // pending entries alone then give.
  if (!all_closed(first)) return false;
  uint64_t who[kMaxSearchWords];
  {
    const uint64_t* p = pending(0);
    bool any = false;
    for (size_t k = 0; k < words_; ++k) {
      who[k] = p[k] & ~first[k];
      any |= who[k] != 0;
    }
    if (any && !all_closed(who)) return false;
    if (any) carry_on(0, who);
  }
  const uint64_t* last = held(n - 1);
  // Then, among them, who holds block i is a shrinking set as i grows: each
  // step of it is found by bisection between two blocks whose holders differ.
  struct Span {
    size_t lo, hi;
    const uint64_t *at_lo, *at_hi;
  };
  Span stack[64];
  size_t depth = 0;
  auto differ = [&](const uint64_t* a, const uint64_t* b) {
    for (size_t k = 0; k < words_; ++k) {
      if (((a[k] ^ b[k]) & first[k]) != 0) return true;
    }
    return false;
  };
  if (n > 1 && differ(first, last)) stack[depth++] = {0, n - 1, first, last};
  while (depth > 0) {
    const Span sp = stack[--depth];
    if (sp.hi == sp.lo + 1) {
      // Those holding block lo but not hi stop at hi, unless pending
      // entries carry them further.
      for (size_t k = 0; k < words_; ++k) who[k] = sp.at_lo[k] & ~sp.at_hi[k] & first[k];
      carry_on(sp.hi, who);
      continue;
    }
    const size_t mid = sp.lo + (sp.hi - sp.lo) / 2;
    // The next probe is the middle of one half or the other: both load
    // while this one does, so the search waits on one miss a level, not two.
    const BlockHash next[2] = {hashes[sp.lo + (mid - sp.lo) / 2], hashes[mid + (sp.hi - mid) / 2]};
    blocks_->Warm(next);
    const uint64_t* at_mid = held(mid);
    if (depth + 2 > std::size(stack)) return false;
    if (differ(at_mid, sp.at_hi)) stack[depth++] = {mid, sp.hi, at_mid, sp.at_hi};
    if (differ(sp.at_lo, at_mid)) stack[depth++] = {sp.lo, mid, sp.at_lo, at_mid};
  }
  // Those holding the last block hold the whole prompt.
  for (size_t k = 0; k < words_; ++k) {
    for (uint64_t rest = first[k] & last[k]; rest != 0; rest &= rest - 1) {
      (*out)[k * 64 + std::countr_zero(rest)] = static_cast<uint32_t>(n);
    }
  }
  bisected_queries_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void PrefixIndex::LeadingOverlapLocked(std::span<const BlockHash> hashes, int64_t now_us,
                                       std::vector<uint32_t>* out) const {
  if (ClosedPrefixOverlapLocked(hashes, now_us, out)) return;
  std::fill(out->begin(), out->end(), 0);  // what the search wrote before it gave up
  const bool any_pending = pending_->size() != 0;
  const size_t n = hashes.size();

  // `alive` = workers holding every block so far. When a worker drops out at
  // block i, its leading overlap is i.
  constexpr size_t kMaxWordsOnStack = 16;  // 1024 workers
  uint64_t alive_stack[kMaxWordsOnStack];
  std::vector<uint64_t> heap;
  uint64_t* alive = alive_stack;
  if (words_ > kMaxWordsOnStack) {
    heap.assign(words_, 0);
    alive = heap.data();
  }
  std::fill_n(alive, words_, ~uint64_t{0});  // narrowed to block 0's holders first

  // The walk goes a chunk of blocks at a time: the chunk's slots are warmed,
  // then looked up and combined in order, stopping at the block where the
  // last worker drops out. The pending table is consulted only for a block
  // that some alive worker does not hold: along a cached prefix its holders
  // hold every block and pending entries cannot change the answer, so a
  // decision usually looks up two pending slots (block 0, where every worker
  // is alive, and the block where the longest prefix ends) instead of one per
  // block. Once a chunk's pending lookup finds a live entry, a burst is
  // running on pending entries: the chunk's remaining pending slots are
  // warmed together.
  for (size_t base = 0; base < n; base += kWarmChunk) {
    const size_t m = std::min(kWarmChunk, n - base);
    blocks_->Warm(hashes.subspan(base, m));
    bool pending_warm = false;
    for (size_t i = base; i < base + m; ++i) {
      const size_t slot = blocks_->Find(hashes[i]);
      const uint64_t* held = slot == BlockTable::kNotFound ? nullptr : blocks_->words(slot);
      const uint64_t* pending = nullptr;
      if (any_pending && !Covers(held, alive, words_)) {
        const size_t p = pending_->Find(hashes[i]);
        if (p != BlockTable::kNotFound &&
            static_cast<int64_t>(pending_->words(p)[words_]) > now_us) {
          pending = pending_->words(p);
          if (!pending_warm && i + 1 < base + m) {
            pending_->Warm(hashes.subspan(i + 1, base + m - i - 1));
            pending_warm = true;
          }
        }
      }
      bool any_alive = false;
      for (size_t k = 0; k < words_; ++k) {
        const uint64_t here = (held ? held[k] : 0) | (pending ? pending[k] : 0);
        // Who drops out at block 0 keeps the 0 `out` already holds.
        uint64_t dropped = i == 0 ? 0 : alive[k] & ~here;
        while (dropped != 0) {
          const int bit = std::countr_zero(dropped);
          (*out)[k * 64 + bit] = static_cast<uint32_t>(i);
          dropped &= dropped - 1;
        }
        alive[k] &= here;
        any_alive |= alive[k] != 0;
      }
      if (!any_alive) return;
    }
  }
  for (size_t k = 0; k < words_; ++k) {
    for (uint64_t rest = alive[k]; rest != 0; rest &= rest - 1) {
      (*out)[k * 64 + std::countr_zero(rest)] = static_cast<uint32_t>(n);
    }
  }
}

void PrefixIndex::GroupedOverlap(std::span<const BlockHash> hashes,
                                 std::span<const int64_t> windows, size_t block_size,
                                 int64_t now_us, std::vector<uint32_t>* out,
                                 int64_t sink_tokens) const {
  if (windows.size() <= 1 && (windows.empty() || windows[0] <= 0)) {
    return LeadingOverlap(hashes, now_us, out);
  }
  out->assign(workers_.size(), 0);
  if (hashes.empty()) return;
  const size_t n = hashes.size(), groups = windows.size();
  // held[(g * n + i) * words_ + k]: the workers holding block i of group g.
  std::vector<uint64_t> held(groups * n * words_, 0);
  std::vector<uint64_t> any(words_, 0);
  {
    std::shared_lock lock(mu_);
    const bool any_pending = pending_->size() != 0;
    for (size_t g = 0; g < groups; ++g) {
      for (size_t i = 0; i < n; ++i) {
        const BlockHash key = GroupBlockKey(hashes[i], static_cast<uint32_t>(g));
        uint64_t* dst = &held[(g * n + i) * words_];
        if (const size_t slot = blocks_->Find(key); slot != BlockTable::kNotFound) {
          const uint64_t* w = blocks_->words(slot);
          for (size_t k = 0; k < words_; ++k) dst[k] |= w[k];
        }
        if (any_pending) {
          const size_t p = pending_->Find(key);
          if (p != BlockTable::kNotFound &&
              static_cast<int64_t>(pending_->words(p)[words_]) > now_us) {
            const uint64_t* w = pending_->words(p);
            for (size_t k = 0; k < words_; ++k) dst[k] |= w[k];
          }
        }
        for (size_t k = 0; k < words_; ++k) any[k] |= dst[k];
      }
    }
  }
  // Only workers holding some block can have a prefix.
  for (size_t k = 0; k < words_; ++k) {
    for (uint64_t rest = any[k]; rest != 0; rest &= rest - 1) {
      const size_t w = k * 64 + static_cast<size_t>(std::countr_zero(rest));
      if (w >= out->size()) break;
      const uint64_t bit = uint64_t{1} << (w % 64);
      (*out)[w] = static_cast<uint32_t>(CachedPrefixBlocks(
          windows, block_size, n,
          [&](size_t g, size_t i) { return (held[(g * n + i) * words_ + k] & bit) != 0; },
          sink_tokens));
    }
  }
}

void PrefixIndex::AddPending(WorkerId worker, std::span<const BlockHash> hashes, int64_t now_us,
                             int64_t expires_us) {
  if (options_.max_pending == 0 || hashes.empty() || expires_us <= now_us) return;
  std::unique_lock lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].open) return;
  // Make room for the whole request at once, so that its own blocks never
  // push each other out; the leading blocks matter most when it is too long.
  hashes = hashes.first(std::min(hashes.size(), options_.max_pending));
  if (pending_->size() + hashes.size() > options_.max_pending) {
    // Full: start over on the spare table, whose zeroing earlier inserts
    // have spread out (sweeping or clearing this one here would cost a
    // routing call the time of a pass over the whole table).
    spare_pending_->ClearStep(SIZE_MAX);  // normally already done
    std::swap(pending_, spare_pending_);
    spare_pending_->StartClear();
  }
  // A few spare slots per insert: the spare is clean long before the active
  // table (half its slots, at most) fills again.
  spare_pending_->ClearStep(4 * hashes.size());
  for (size_t i = 0; i < hashes.size(); ++i) {
    if (i % kWarmChunk == 0) {
      pending_->Warm(hashes.subspan(i, std::min(kWarmChunk, hashes.size() - i)));
    }
    const BlockHash h = hashes[i];
    bool inserted = false;
    const size_t slot = pending_->FindOrInsert(h, &inserted);
    if (slot == BlockTable::kNotFound) continue;  // unreachable: room was made above
    uint64_t* words = pending_->words(slot);
    SetBit(words, worker);
    words[words_] = static_cast<uint64_t>(expires_us);
  }
}

void PrefixIndex::AdoptHeldPrefix(WorkerId worker, std::span<const BlockHash> prefix) {
  using WS = WorkerState;
  if (!options_.chained_parents || prefix.empty()) return;
  std::unique_lock lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].open) return;
  WorkerState& w = workers_[worker];
  if (w.orphans == 0) return;  // other holes are not the chain's to mend
  BlockTable& mine = *w.blocks;
  for (size_t i = 0; i < prefix.size() && w.orphans > 0; ++i) {
    const size_t slot = mine.Find(prefix[i]);
    if (slot == BlockTable::kNotFound) return;
    uint64_t* e = mine.words(slot);
    if ((e[WS::kState] & WS::kHeld) == 0) return;
    if ((e[WS::kState] & WS::kOrphan) == 0) continue;
    e[WS::kState] &= ~WS::kOrphan;
    --w.holes;
    --w.orphans;
    if (i == 0) continue;  // the prompt's first block: no parent
    e[WS::kState] |= WS::kHasParent;
    e[WS::kParent] = prefix[i - 1];
    // Held (the loop got past it), so found, and Find moves nothing.
    mine.words(mine.Find(prefix[i - 1]))[WS::kState] += uint64_t{1} << WS::kChildShift;
  }
}

void PrefixIndex::ExpirePending(int64_t now_us) {
  std::unique_lock lock(mu_);
  SweepPendingLocked(now_us);
}

std::vector<BlockHash> PrefixIndex::WorkerBlocks(WorkerId worker) const {
  std::shared_lock lock(mu_);
  std::vector<BlockHash> out;
  if (worker >= workers_.size() || !workers_[worker].open) return out;
  workers_[worker].blocks->ForEach([&](uint64_t h, const uint64_t* e) {
    if ((e[WorkerState::kState] & WorkerState::kHeld) != 0) out.push_back(h);
  });
  return out;
}

size_t PrefixIndex::WorkerBlockCount(WorkerId worker) const {
  std::shared_lock lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].open) return 0;
  return workers_[worker].held;
}

PrefixIndexStats PrefixIndex::stats() const {
  std::shared_lock lock(mu_);
  PrefixIndexStats s = counters_;
  s.bisected_queries = bisected_queries_.load(std::memory_order_relaxed);
  s.entries = blocks_->size();
  s.bytes = blocks_->bytes() + pending_->bytes() + spare_pending_->bytes() +
            workers_.capacity() * sizeof(WorkerState);
  s.worker_blocks = 0;
  s.lower_tier_blocks = 0;
  for (const WorkerState& w : workers_) {
    if (!w.open) continue;
    s.worker_blocks += w.held;
    s.lower_tier_blocks += w.host.size() + w.disk.size();
    s.bytes += w.blocks->bytes();
  }
  s.pending_entries = 0;
  pending_->ForEach([&](uint64_t, const uint64_t* words) {
    for (size_t k = 0; k < words_; ++k) s.pending_entries += std::popcount(words[k]);
  });
  return s;
}

}  // namespace pdserve::router
