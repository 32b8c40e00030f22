// PrefixIndex: the router's global map of which worker holds which KV block.
//
// Fed by each worker's KV events (common/kv_events.h: Stored / Removed /
// Cleared, in batches with a per-worker sequence number) and full snapshots (Resync); answers, for
// a prompt's block hashes (common/block_hash.h), how many LEADING blocks each worker holds: the
// walk stops at a worker's first miss, because a block is only reusable together with its whole
// prefix (hash spec v1 chains parents).
//
// Contracts:
// - Workers are dense slots 0..max_workers-1 (the caller maps names to slots).
//   A worker is trusted only after a snapshot: until ApplySnapshot, and after
//   a detected gap until the next snapshot, its event batches are not applied
//   and ApplyEvents answers kNeedsResync (the caller then asks the worker for
//   a Resync). What the worker held before the gap stays indexed meanwhile:
//   stale knowledge routes better than none, and the snapshot replaces it.
// - Batch sequence numbers: seq == last+1 is applied; seq <= last is a stale
//   or duplicate delivery and is ignored; seq > last+1 is a gap (counted in
//   stats().gaps, the source of pdserve_router_kv_event_gaps_total).
// - Memory bound: at most max_entries distinct block hashes. A Stored event
//   for a new hash while the index is full is dropped and counted in
//   stats().rejected_stores: the index then under-reports that worker's
//   prefix, so routing degrades gracefully and memory never grows. Size the
//   bound to at least the sum of the workers' KV blocks. Memory use is
//   reported in stats().bytes (allocated slots of every table).
// - Pending entries (burst handling): AddPending records blocks a worker is
//   about to compute because the router just sent it a request; queries
//   treat them as held until they expire or the worker's own Stored event for
//   the block arrives. One expiry per block (the latest AddPending's), so an
//   entry lives at most TTL after the block was last routed. At most
//   max_pending blocks are pending: when the table is full, every pending
//   entry is dropped at once (they are a short-lived hint; the real index is
//   untouched) and a spare table, zeroed in small steps by earlier calls,
//   takes over, so no routing call pays for a pass over the table.
// - Lower tiers: what a worker holds in its host-memory and disk tiers
//   (Stored/Removed events of those tiers, and the snapshot's lists) is kept
//   per worker beside the device index, at most max_lower_tier_blocks per
//   worker and tier (more are dropped, counted in rejected_stores). TierRun
//   says how far a prompt continues there past the device prefix.
// - Thread safety: every method may be called from any thread. Queries take a
//   shared lock (many routing threads in parallel); event batches, snapshots,
//   pending updates and purges take it exclusively, for time bounded by the
//   batch size (or the worker's block count for a purge).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <span>
#include <vector>

#include "common/block_hash.h"
#include "common/kv_events.h"
#include "common/status.h"

namespace pdserve::router {

namespace detail {
class BlockTable;
}

using WorkerId = uint32_t;

enum class ApplyOutcome {
  kApplied,        // the batch is reflected in the index
  kDuplicate,      // seq already seen: ignored
  kNeedsResync,    // gap, or no snapshot yet: ignored; ask the worker for a Resync
  kUnknownWorker,  // slot not added
};
const char* ApplyOutcomeName(ApplyOutcome outcome);

struct PrefixIndexOptions {
  size_t max_workers = 256;                 // slots; the bitset per block is max_workers bits
  size_t max_entries = 4u << 20;            // distinct block hashes
  size_t max_pending = 64u << 10;           // blocks with pending entries
  size_t max_lower_tier_blocks = 1u << 20;  // per worker and lower tier
  // Whether device Stored runs name each block's real parent, as KvStored
  // says (hash spec v1 chains a block's hash to its parent's, so an engine
  // cannot name another). Then LeadingOverlap bisects the prompt for
  // workers whose blocks are closed under parents (see there); off, every
  // query walks block by block, whatever the events claim.
  bool chained_parents = true;
};

// The blocks a worker holds past its device prefix: a run of the prompt's
// following blocks, each in its host or disk tier. With windows or sinks
// (GroupedTierRun) only the blocks the first query reaches come back; the
// prefix also spans `skipped_blocks` between them that stay in the tiers.
struct TierRun {
  int64_t host_blocks = 0;
  int64_t disk_blocks = 0;
  int64_t skipped_blocks = 0;
  int64_t blocks() const { return host_blocks + disk_blocks; }                 // copied back
  int64_t span() const { return host_blocks + disk_blocks + skipped_blocks; }  // prefix gained
};

struct PrefixIndexStats {
  size_t entries = 0;            // distinct block hashes indexed
  size_t worker_blocks = 0;      // (worker, block) pairs indexed
  size_t lower_tier_blocks = 0;  // (worker, block) pairs in lower tiers
  size_t pending_entries = 0;    // (worker, block) pending entries not yet swept or dropped
  size_t bytes = 0;              // memory held by the index's tables
  uint64_t events_applied = 0;   // block-level events applied (each hash counts once)
  uint64_t batches_applied = 0;
  uint64_t duplicate_batches = 0;
  uint64_t gaps = 0;               // sequence gaps detected
  uint64_t rejected_stores = 0;    // Stored hashes dropped at the memory bound
  uint64_t unknown_removes = 0;    // Removed hashes the worker was not known to hold
  uint64_t snapshots_applied = 0;  // Resyncs
  uint64_t bisected_queries = 0;   // LeadingOverlap answers found by bisection (the rest walk)
};

class PrefixIndex {
 public:
  explicit PrefixIndex(PrefixIndexOptions options = {});
  ~PrefixIndex();
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  const PrefixIndexOptions& options() const { return options_; }

  // Opens `worker`'s slot (empty, awaiting a snapshot). InvalidArgument if
  // the slot is out of range or already open.
  Status AddWorker(WorkerId worker);
  // Forgets everything about `worker` (its blocks and pending entries) and
  // frees the slot. No-op for a closed slot.
  void RemoveWorker(WorkerId worker);

  ApplyOutcome ApplyEvents(WorkerId worker, const KvEventBatch& batch);
  // Resync: `worker` holds exactly `hashes` in its device pool (and `host`,
  // `disk` in its lower tiers), as of its batch `seq`; the next batch
  // expected is seq+1. NotFound for a closed slot.
  Status ApplySnapshot(WorkerId worker, uint64_t seq, std::span<const BlockHash> hashes,
                       std::span<const BlockHash> host = {}, std::span<const BlockHash> disk = {});
  // Whether `worker`'s batches are being refused until a snapshot.
  bool NeedsResync(WorkerId worker) const;

  // out->at(w) = number of leading blocks of `hashes` worker w holds
  // (indexed, or pending with an expiry after now_us), for every slot
  // w < max_workers (0 for closed slots).
  // Cost: one lookup per block up to the longest overlap (a walk), or, when
  // every holder of the first block, and every worker pending there, has
  // its blocks closed under parents (it holds each held block's parent: no
  // holes from evictions out of order, stores refused at the memory bound,
  // or snapshots, which name no parents), about log2(blocks) lookups per
  // distinct overlap (a bisection): holding block i then means holding
  // blocks 0..i, and past its held blocks only pending entries carry a
  // worker on (one pending lookup per block). The answer is the same
  // either way.
  void LeadingOverlap(std::span<const BlockHash> hashes, int64_t now_us,
                      std::vector<uint32_t>* out) const;

  // The same for a model whose KV has layer groups (common/kv_groups.h)
  // of these windows (0: full attention): out->at(w) = the longest prefix,
  // in blocks, that worker w can start a prompt from by CachedPrefixBlocks,
  // a block of group g being held when its key GroupBlockKey(hash, g) is
  // indexed or pending. With one full group this is LeadingOverlap.
  // `sink_tokens`: a worker with attention sinks (--kv-eviction streaming),
  // whose windowed groups also need the sink blocks.
  void GroupedOverlap(std::span<const BlockHash> hashes, std::span<const int64_t> windows,
                      size_t block_size, int64_t now_us, std::vector<uint32_t>* out,
                      int64_t sink_tokens = 0) const;

  // Blocks hashes[from], hashes[from + 1], ... that `worker` holds in its
  // lower tiers, up to the first it does not (0 for a closed slot).
  TierRun LowerTierRun(WorkerId worker, std::span<const BlockHash> hashes, size_t from) const;

  // LeadingOverlap, and under the same lock what a routing decision reads
  // of every worker besides (one lock per decision rather than two per
  // worker): its lower-tier run after its overlap and its device block count.
  struct WorkerMatch {
    TierRun lower;
    size_t blocks = 0;
  };
  void Match(std::span<const BlockHash> hashes, int64_t now_us, std::vector<uint32_t>* overlap,
             std::vector<WorkerMatch>* workers) const;
  // Match's lower-tier runs for a model with layer groups or sinks (GroupedOverlap's
  // windows and sink_tokens), for every worker under one lock, into
  // (*workers)[w].lower, by the engine's rule (Engine::TierPrefix): the
  // prefix grows to the longest one CachedPrefixBlocks finds when worker
  // w's first device_blocks[w] blocks count as held (its device prefix) and
  // the others when a lower tier holds their group key; of the blocks past
  // the device prefix only those its first query reaches (BlockInReach) are
  // copied back, each prompt block counted once, at its slowest tier (host
  // when a key is in both); the rest are skipped_blocks. `workers` has a
  // slot per worker (Match's).
  void GroupedTierRuns(std::span<const BlockHash> hashes, std::span<const int64_t> windows,
                       size_t block_size, std::span<const uint32_t> device_blocks,
                       int64_t sink_tokens, std::vector<WorkerMatch>* workers) const;

  // Marks `hashes` as about to be held by `worker` until expires_us.
  void AddPending(WorkerId worker, std::span<const BlockHash> hashes, int64_t now_us,
                  int64_t expires_us);
  // The caller found `worker` holding `prefix`, a prompt's leading blocks
  // (the router hashed them, so each one's parent is the one before it):
  // those of them the index holds without a parent (from a snapshot) get
  // it, so that a worker's blocks can count as closed under parents again
  // (see LeadingOverlap) without waiting for them to be evicted. Stops at
  // the first block the worker does not hold. Cheap for a worker without
  // such blocks.
  void AdoptHeldPrefix(WorkerId worker, std::span<const BlockHash> prefix);
  // Removes pending entries whose expiry is <= now_us (queries already
  // ignore them; this returns their memory). O(max_pending).
  void ExpirePending(int64_t now_us);

  // Block hashes `worker` holds, unordered (for tests and debugging).
  std::vector<BlockHash> WorkerBlocks(WorkerId worker) const;
  size_t WorkerBlockCount(WorkerId worker) const;
  PrefixIndexStats stats() const;

 private:
  struct WorkerState;

  // How a Stored run's blocks name their parents: kChain as KvStored does
  // (the first's is first_parent, nullopt for a prompt's first block; each
  // later one's the hash before it); kUnknown for a snapshot's set.
  enum class StoredParents { kChain, kUnknown };
  void StoreLocked(WorkerId worker, std::span<const BlockHash> hashes, StoredParents parents,
                   std::optional<BlockHash> first_parent = std::nullopt);
  void NoteHeldLocked(WorkerState& w, BlockHash h, bool orphan, std::optional<BlockHash> parent);
  bool NoteRemovedLocked(WorkerState& w, BlockHash h);
  void StoreLowerLocked(WorkerId worker, KvTier tier, std::span<const BlockHash> hashes);
  void RemoveLocked(WorkerId worker, std::span<const BlockHash> hashes);
  void PurgeBlocksLocked(WorkerId worker);
  void PurgePendingLocked(WorkerId worker);
  void ClearPendingBitLocked(BlockHash hash, WorkerId worker);
  void SweepPendingLocked(int64_t now_us);
  // For both: `out` already sized and zeroed; `hashes` not empty.
  // LeadingOverlap's answer: by bisection when ClosedPrefixOverlapLocked
  // can give it, else by the walk.
  void LeadingOverlapLocked(std::span<const BlockHash> hashes, int64_t now_us,
                            std::vector<uint32_t>* out) const;
  // The bisection, in about log2(blocks) lookups per distinct overlap
  // instead of one per block (and, for workers pending past their held
  // blocks, one pending lookup per block they are pending for), when its
  // answer is sure to be the walk's: false (out partly written) when a
  // holder of block 0, or a worker pending there, may have a hole.
  bool ClosedPrefixOverlapLocked(std::span<const BlockHash> hashes, int64_t now_us,
                                 std::vector<uint32_t>* out) const;
  TierRun LowerTierRunLocked(WorkerId worker, std::span<const BlockHash> hashes, size_t from) const;

  const PrefixIndexOptions options_;
  const size_t words_;  // 64-bit words per worker bitset
  mutable std::shared_mutex mu_;
  std::unique_ptr<detail::BlockTable> blocks_;  // hash -> workers holding it
  // hash -> [workers about to hold it (words_), expiry in microseconds]
  std::unique_ptr<detail::BlockTable> pending_;
  // The next pending table, zeroed a few slots per AddPending (see there).
  std::unique_ptr<detail::BlockTable> spare_pending_;
  std::vector<WorkerState> workers_;
  PrefixIndexStats counters_;  // the counter fields; sizes are computed on demand
  // Counted under the shared lock, by concurrent queries.
  mutable std::atomic<uint64_t> bisected_queries_{0};
};

}  // namespace pdserve::router
