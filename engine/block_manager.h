// Block manager: which KV-cache blocks hold what, and who uses them.
//
// The KV pool (engine/kv_cache) owns the memory: `num_blocks` blocks of
// `block_size` tokens each. The block manager owns the block *ids*
// 0..num_blocks-1 and decides their fate, in vLLM's vocabulary:
//
//  - block table: per sequence, the ids of the blocks holding its tokens, in
//    order (token t lives in block table[t / block_size], slot t % block_size);
//  - reference count: how many sequences (and pins) use a block;
//  - prefix cache: a full block whose KV has been computed is "committed"
//    under its hash (spec v1, common/block_hash.h) and can then be shared by
//    any sequence whose prompt starts with the same blocks: shared blocks are
//    reused, never copied. Only committed blocks ever match.
//  - eviction: a cached block that nobody references stays cached but is
//    evictable; when the free list is empty, allocation takes the least
//    recently released evictable block and drops its hash (KvRemoved).
//
// Layer groups (common/kv_groups.h): a model whose layers attend over
// different spans has G > 1 groups, or one windowed group; a pool block
// then holds one group's layers, and a sequence has one block table per
// group, entry i of each covering positions [i*B, (i+1)*B). Entries of a
// windowed group that no later query reaches hold no block (kNoBlock):
// admission leaves out the blocks before the first query's window, and
// AllocateSlots releases them as the sequence moves on (to the LRU list
// when cached, so a released prefix stays matchable). A block of group g
// with token-run hash h is cached under GroupBlockKey(h, g): that key is
// what the prefix cache matches, what KV events and snapshots carry (with
// the group) and what on_evict hands down. With attention sinks
// (sink_tokens), windowed groups also keep the sink blocks at the start of
// their tables and release only the entries between them and the window. A prefix of k blocks is a
// hit when every group holds what the query at position k*B reaches (CachedPrefixBlocks: all k
// blocks of a full group, the blocks of the last W-1 tokens of a windowed one). With one full group
// (every model without windows) all of this is the plain single-table manager.
//
// Every block is in exactly one state at all times:
//   free       (refcount 0, no hash)  - on the free list
//   evictable  (refcount 0, hash)     - on the LRU list, still matchable
//   used       (refcount > 0)         - in some block table or pin; it is
//                                       "cached" too if it carries a hash
// so free + used + evictable == num_blocks, always (CheckInvariants()).
//
// Allocation never leaves partial state: Admit and AllocateSlots either get
// every block they need or change nothing and return ResourceExhausted, so the
// scheduler can preempt a sequence (Free) and retry.
//
// Disaggregation:
//  - a decode worker admits a sequence whose prompt KV will arrive by
//    transfer: Admit reuses its own cached prefix and allocates the rest
//    (reserved: uncommitted, so neither matchable nor announced); the peer
//    writes into those block ids; once the KV is really there, CommitBlocks
//    registers them. Pass prompt_tokens_for_stats = 0 for such admissions:
//    blocks received by transfer are not prefix-cache hits.
//  - a prefill worker that finished a prompt pins its blocks (Pin) while they
//    are being sent, frees the sequence, and unpins once the transfer is done.
//
// Thread safety: all methods are safe to call concurrently (one internal
// mutex), so a publisher thread may DrainEvents/Snapshot/GetStats while the
// engine loop allocates. BlockTable's reference is valid until the next call
// that changes that sequence, which must come from the same thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "common/block_hash.h"
#include "common/kv_events.h"
#include "common/status.h"
#include "engine/kv_tier_store.h"

namespace pdserve {

using BlockId = uint32_t;  // index of a block in the KV pool
using SeqId = uint64_t;    // chosen by the caller, unique among live sequences
using PinId = uint64_t;    // returned by Pin, never reused

// A block table entry that holds no block (a windowed group's released or
// never needed positions).
inline constexpr BlockId kNoBlock = 0xFFFFFFFFu;

// One entry of a sequence's block tables: block `block` holds positions
// [index*B, (index+1)*B) of layer group `group`.
struct BlockSlot {
  uint32_t group = 0;
  size_t index = 0;
  BlockId block = kNoBlock;
  bool operator==(const BlockSlot&) const = default;
};

struct BlockManagerOptions {
  size_t num_blocks = 0;                  // > 0
  size_t block_size = kDefaultBlockSize;  // tokens per block, > 0
  // Off: nothing is ever committed or matched (every block is private) and no
  // events are recorded.
  bool enable_prefix_caching = true;
  // Off: event batches still get sequence numbers and snapshots stay exact,
  // but nothing is queued for DrainEvents (offline use, where nobody drains).
  bool record_kv_events = true;
  // The window of each layer group (0: full attention); empty: one group
  // of full attention.
  std::vector<int64_t> group_windows;
  // Attention sinks (common/kv_groups.h, KvGroups::sink_tokens): windowed
  // groups also keep the blocks of the first sink_tokens positions, and
  // release only those between them and the window.
  size_t sink_tokens = 0;
  // Called for every cached block an allocation evicts, before the block is
  // handed out again (its KV still intact): where a worker copies it down to
  // its lower tiers. `key` is the block's cache key (GroupBlockKey). Runs
  // under the block manager's lock: it must not call the block manager.
  std::function<void(BlockId block, BlockHash key)> on_evict;
};

struct BlockManagerStats {
  size_t num_blocks = 0;
  size_t free_blocks = 0;       // no content, on the free list
  size_t used_blocks = 0;       // refcount > 0
  size_t evictable_blocks = 0;  // refcount 0 but still cached
  size_t cached_blocks = 0;     // carrying a hash (used or evictable)
  // Blocks an allocation could obtain now: free + evictable.
  size_t allocatable_blocks = 0;
  // used / num_blocks: pdserve_kv_cache_usage_ratio (as vLLM: evictable
  // cached blocks count as free).
  double usage_ratio = 0;
  // pdserve_prefix_cache_queries_tokens_total / ..._hits_tokens_total: the
  // prompt tokens looked up for prefill computation and how many of them
  // were found cached. Only admissions with prompt_tokens_for_stats > 0 count.
  uint64_t prefix_cache_query_tokens = 0;
  uint64_t prefix_cache_hit_tokens = 0;
  uint64_t evicted_blocks_total = 0;
  // Table entries released because no later query of their sequence
  // reaches them (sliding windows, attention sinks): the blocks a dense
  // model would have kept. pdserve_kv_evicted_tokens_total counts them in
  // tokens.
  uint64_t released_out_of_reach_blocks_total = 0;
  size_t num_sequences = 0;
  size_t num_pins = 0;
};

struct AdmitRequest {
  SeqId seq = 0;
  // Hashes of the leading full blocks that may be reused from the cache, in
  // order (HashPrompt). To keep at least one prompt token to compute (its
  // logits give the first output token), hash the prompt without its last
  // token: HashPrompt(seed, prompt.first(prompt.size() - 1), block_size).
  std::span<const BlockHash> prefix_hashes;
  // Tokens the block table must cover after admission (the whole prompt, or
  // the cached prefix plus a first chunk). Reuse is capped at
  // num_tokens / block_size blocks.
  size_t num_tokens = 0;
  // Adds this many query tokens, and the reused tokens (capped at it) as hit
  // tokens, to the prefix-cache counters. 0 = not a prefill lookup.
  size_t prompt_tokens_for_stats = 0;
  // Tokens whose KV will be in the blocks before the first query runs:
  // the cached prefix (the default), or more when the caller fills blocks
  // itself (from a lower tier, or a peer writing a prompt's KV). Windowed
  // groups get blocks from that query's reach on; every block below
  // ceil(computed_tokens / B) that the cache does not give is returned in
  // AdmitResult::to_fill. At least the cached prefix, at most num_tokens.
  std::optional<size_t> computed_tokens;
  // Windowed groups get blocks from the reach of the query at this
  // position on instead (at most computed_tokens): a decode side that
  // receives a prompt keeps what a repeat of it starts from, which may be a
  // block before what its first decode query reaches.
  std::optional<size_t> reach_from;
};

struct AdmitResult {
  size_t num_cached_blocks = 0;  // leading blocks reused from the cache
  size_t num_cached_tokens = 0;  // num_cached_blocks * block_size
  // Fresh blocks the caller must fill (computed_tokens beyond the cache),
  // by index then group.
  std::vector<BlockSlot> to_fill;
};

class BlockManager {
 public:
  // InvalidArgument when num_blocks or block_size is 0.
  static StatusOr<std::unique_ptr<BlockManager>> Create(const BlockManagerOptions& options);
  ~BlockManager();
  BlockManager(const BlockManager&) = delete;
  BlockManager& operator=(const BlockManager&) = delete;

  size_t block_size() const;
  size_t num_blocks() const;
  size_t num_groups() const;
  // The windows of the layer groups (0: full attention).
  const std::vector<int64_t>& group_windows() const;
  size_t sink_tokens() const;

  // Number of leading `hashes` that are cached now (committed, referenced or
  // evictable) as a usable prefix: CachedPrefixBlocks over every group.
  // Changes nothing: no LRU touch, no counters.
  size_t FindCachedPrefix(std::span<const BlockHash> hashes) const;
  // Whether group `group`'s block of token-run hash `hash` is cached.
  bool IsCached(BlockHash hash, uint32_t group) const;

  // Creates `request.seq`'s block table: the longest cached prefix of
  // request.prefix_hashes (refcount +1 each, taken off the LRU list if
  // evictable), then fresh blocks up to ceil(num_tokens / block_size).
  // Errors: InvalidArgument if seq is already live; ResourceExhausted (no
  // state changed) if there are not enough allocatable blocks.
  StatusOr<AdmitResult> Admit(const AdmitRequest& request);

  // Grows `seq`'s block tables so that they cover `num_tokens` tokens (no-op
  // if they already do). With `num_computed` (the position of the next query
  // to run), the windowed groups' blocks no query from there on reaches are
  // released first. Errors: NotFound; ResourceExhausted (nothing allocated,
  // though the release stands).
  Status AllocateSlots(SeqId seq, size_t num_tokens,
                       std::optional<size_t> num_computed = std::nullopt);

  // Blocks AllocateSlots(seq, num_tokens) would need beyond what `seq` has.
  // NotFound for an unknown seq.
  StatusOr<size_t> BlocksNeeded(SeqId seq, size_t num_tokens) const;

  // Commits the full blocks of `seq` whose KV is now computed (or received):
  // `block_hashes` are the hashes of its leading full blocks (block i's hash
  // at index i; pass all of them each time, ExtendPromptHashes keeps them).
  // Blocks not yet committed are registered in the prefix cache and
  // announced in one KvStored batch, in order. A block whose hash is already
  // cached in another block stays private (no duplicate entry, no event).
  // Errors: NotFound; InvalidArgument if there are more hashes than blocks,
  // or an already committed block's hash differs (the caller hashed another
  // prompt). No-op when prefix caching is off.
  Status CommitBlocks(SeqId seq, std::span<const BlockHash> block_hashes);

  // The sequence's block table of `group` (see the thread-safety note
  // above), kNoBlock where it holds nothing. An unknown seq gives an empty
  // table.
  const std::vector<BlockId>& BlockTable(SeqId seq, uint32_t group = 0) const;
  bool HasSequence(SeqId seq) const;
  // Leading blocks of `seq` that are committed (cache hits count).
  size_t NumCommittedBlocks(SeqId seq) const;
  // Entries of `seq`'s tables released so far because no later query
  // reaches them (0 for an unknown seq): the blocks it saved.
  size_t ReleasedBlocks(SeqId seq) const;
  // Current reference count of a block (0 for an id outside the pool).
  uint32_t RefCount(BlockId block) const;

  // Releases everything `seq` holds (finish, cancel, preemption): refcount -1
  // on each block; blocks reaching 0 go to the LRU list if cached (the
  // sequence's last block first, so prefixes outlive their tails), else back
  // to the free list. NotFound for an unknown seq.
  Status Free(SeqId seq);

  // SnapKV's compaction: `seq` releases every block it holds, as Free does
  // (committed ones go to the LRU list, still matchable; no events), and
  // takes `from`'s tables, blocks and committed prefix instead; `from` is
  // gone. The entries `seq` had beyond `from`'s count as released
  // (ReleasedBlocks). NotFound for either unknown; InvalidArgument for
  // seq == from.
  Status AdoptBlocks(SeqId seq, SeqId from);

  // Takes one extra reference on every block of `seq`'s tables from entry
  // `first_block` on, so they are neither reused nor evicted until Unpin,
  // even after Free(seq). For a prefill worker sending a prompt's KV, and a
  // decode worker holding blocks a peer may still write into. NotFound for
  // an unknown seq.
  StatusOr<PinId> Pin(SeqId seq, size_t first_block = 0);
  // The blocks a pin holds, by index then group (empty for an unknown pin).
  std::vector<BlockId> PinnedBlocks(PinId pin) const;
  std::vector<BlockSlot> PinnedSlots(PinId pin) const;
  // Drops the pin's references. NotFound for an unknown (or already
  // released) pin.
  Status Unpin(PinId pin);

  // Evicts up to `max_blocks` evictable blocks, least recently released
  // first (one KvRemoved batch). Returns how many were evicted.
  size_t Evict(size_t max_blocks);

  // Drops every cached hash (one KvCleared batch): evictable blocks become
  // free, referenced blocks keep their KV and owners but no longer match and
  // are not committed again. Live sequences and pins are untouched.
  void ResetPrefixCache();

  // Event batches recorded since the last drain, in sequence-number order.
  std::vector<KvEventBatch> DrainEvents();
  // Every cached hash, consistent with the event stream (see kv_events.h),
  // the lower tiers' included.
  KvCacheSnapshot Snapshot() const;

  // Blocks that entered or left a lower tier (engine/kv_tier_store.h),
  // recorded as one event batch in the same numbered stream, and kept for
  // snapshots. No-op for an empty list.
  void RecordTierChanges(std::span<const KvTierChange> changes);
  // Sequence number of the last recorded batch (0 if none).
  uint64_t last_event_sequence_number() const;

  BlockManagerStats GetStats() const;

  // Verifies every structural invariant (state partition, refcounts equal
  // to table + pin references, hash map <-> block hashes, LRU and free lists
  // disjoint and exact). Internal error naming the first violation. O(pool).
  Status CheckInvariants() const;

 private:
  struct Impl;
  explicit BlockManager(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pdserve
