#include "engine/block_manager.h"

#include <algorithm>
#include <limits>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "common/kv_groups.h"

namespace pdserve {
namespace {

constexpr BlockId kNil = std::numeric_limits<BlockId>::max();

size_t CeilDiv(size_t a, size_t b) { return (a + b - 1) / b; }

struct Block {
  uint32_t ref = 0;
  bool has_hash = false;
  bool on_free_list = false;
  BlockHash hash = 0;  // the cache key (GroupBlockKey of the token-run hash)
  uint32_t group = 0;  // the layer group of a cached block
  // Links of the LRU list of evictable blocks (kNil when not on it).
  BlockId lru_prev = kNil;
  BlockId lru_next = kNil;
  bool on_lru = false;
};

struct Sequence {
  // One table per layer group, all of the same length; kNoBlock where a
  // windowed group holds nothing.
  std::vector<std::vector<BlockId>> tables;
  // Token-run hashes of the leading committed entries (cache hits
  // included); kept even when a block stays private as a duplicate or loses
  // its hash to a reset, so that later commits can be checked against them.
  std::vector<BlockHash> committed_hashes;
  // Entries released because no later query reaches them (windows, sinks).
  size_t released = 0;
  size_t size() const { return tables[0].size(); }
};

// Collects the events of one public call; becomes one numbered batch.
class BatchBuilder {
 public:
  void Stored(BlockHash key, std::optional<BlockHash> parent, uint32_t group) {
    // Extends the current run when `key` directly follows the last stored one.
    if (!events_.empty()) {
      if (auto* run = std::get_if<KvStored>(&events_.back());
          run != nullptr && run->group == group && parent.has_value() &&
          run->block_hashes.back() == *parent) {
        run->block_hashes.push_back(key);
        return;
      }
    }
    events_.emplace_back(KvStored{{key}, parent, KvTier::kDevice, group});
  }
  void Removed(BlockHash key, uint32_t group) {
    auto* last = events_.empty() ? nullptr : std::get_if<KvRemoved>(&events_.back());
    if (last == nullptr || last->group != group) {
      events_.emplace_back(KvRemoved{{}, KvTier::kDevice, group});
    }
    std::get<KvRemoved>(events_.back()).block_hashes.push_back(key);
  }
  void Cleared() { events_.emplace_back(std::in_place_type<KvCleared>); }
  bool empty() const { return events_.empty(); }
  std::vector<KvEvent> Take() { return std::move(events_); }

 private:
  std::vector<KvEvent> events_;
};

}  // namespace

struct BlockManager::Impl {
  explicit Impl(const BlockManagerOptions& o)
      : options(o),
        windows(o.group_windows.empty() ? std::vector<int64_t>{0} : o.group_windows),
        sink_blocks(static_cast<size_t>(
            SinkBlocks(static_cast<int64_t>(o.sink_tokens), static_cast<int64_t>(o.block_size)))),
        blocks(o.num_blocks) {
    free_list.reserve(o.num_blocks);
    // Popped from the back, so block 0 is handed out first.
    for (size_t i = o.num_blocks; i-- > 0;) {
      free_list.push_back(static_cast<BlockId>(i));
      blocks[i].on_free_list = true;
    }
  }

  // ---- LRU list of evictable blocks: head = least recently released. ----
  void LruPushBack(BlockId id) {
    Block& b = blocks[id];
    b.lru_prev = lru_tail;
    b.lru_next = kNil;
    if (lru_tail != kNil) {
      blocks[lru_tail].lru_next = id;
    } else {
      lru_head = id;
    }
    lru_tail = id;
    b.on_lru = true;
    ++lru_size;
  }
  void LruRemove(BlockId id) {
    Block& b = blocks[id];
    if (b.lru_prev != kNil) {
      blocks[b.lru_prev].lru_next = b.lru_next;
    } else {
      lru_head = b.lru_next;
    }
    if (b.lru_next != kNil) {
      blocks[b.lru_next].lru_prev = b.lru_prev;
    } else {
      lru_tail = b.lru_prev;
    }
    b.lru_prev = b.lru_next = kNil;
    b.on_lru = false;
    --lru_size;
  }

  size_t Allocatable() const { return free_list.size() + lru_size; }

  // Drops the hash of the least recently released evictable block and returns
  // the block, now without content. Precondition: lru_size > 0.
  BlockId EvictOne(BatchBuilder* batch) {
    BlockId id = lru_head;
    LruRemove(id);
    Block& b = blocks[id];
    if (options.on_evict) options.on_evict(id, b.hash);
    cached.erase(b.hash);
    batch->Removed(b.hash, b.group);
    b.has_hash = false;
    ++evicted_total;
    return id;
  }

  // One fresh block with refcount 1: the free list first (it keeps cached
  // content alive longer), else an eviction. Precondition: Allocatable() > 0.
  BlockId AllocateOne(BatchBuilder* batch) {
    BlockId id;
    if (!free_list.empty()) {
      id = free_list.back();
      free_list.pop_back();
      blocks[id].on_free_list = false;
    } else {
      id = EvictOne(batch);
    }
    blocks[id].ref = 1;
    return id;
  }

  void Acquire(BlockId id) {
    Block& b = blocks[id];
    if (b.ref == 0 && b.on_lru) LruRemove(id);
    ++b.ref;
  }

  void Release(BlockId id) {
    Block& b = blocks[id];
    if (--b.ref > 0) return;
    if (b.has_hash) {
      LruPushBack(id);
    } else {
      b.on_free_list = true;
      free_list.push_back(id);
    }
  }

  // Releases in reverse table order: the tail of a sequence reaches the LRU
  // list first and is therefore evicted before its prefix.
  void ReleaseAll(const std::vector<BlockId>& table) {
    for (auto it = table.rbegin(); it != table.rend(); ++it) Release(*it);
  }
  // Every group's entries, the last index first.
  void ReleaseAll(const Sequence& seq) {
    for (size_t i = seq.size(); i-- > 0;) {
      for (const auto& table : seq.tables) {
        if (table[i] != kNil) Release(table[i]);
      }
    }
  }

  size_t groups() const { return windows.size(); }
  BlockHash Key(BlockHash hash, size_t group) const {
    return GroupBlockKey(hash, static_cast<uint32_t>(group));
  }
  // Entries a windowed group holds for a query at `pos` start here.
  size_t FirstInReach(size_t group, size_t pos) const {
    return static_cast<size_t>(FirstBlockInReach(windows[group], static_cast<int64_t>(pos),
                                                 static_cast<int64_t>(options.block_size)));
  }
  // Whether a group keeps entry i for a query at `pos` (sinks included).
  bool InReach(size_t group, size_t pos, size_t i) const {
    return windows[group] <= 0 || i < sink_blocks || i >= FirstInReach(group, pos);
  }
  // Releases the entries of windowed groups below the reach of a query at
  // `pos`, the sink blocks excepted.
  void ReleaseOutOfReach(Sequence* seq, size_t pos) {
    for (size_t g = 0; g < groups(); ++g) {
      if (windows[g] <= 0) continue;
      const size_t first = std::min(FirstInReach(g, pos), seq->size());
      for (size_t i = first; i-- > sink_blocks;) {
        if (seq->tables[g][i] == kNil) break;  // released earlier, with those before it
        Release(seq->tables[g][i]);
        seq->tables[g][i] = kNil;
        ++seq->released;
        ++released_total;
      }
    }
  }

  void Finish(BatchBuilder* batch) {
    if (batch->empty()) return;
    KvEventBatch out{++last_sequence_number, batch->Take()};
    if (options.record_kv_events) pending_events.push_back(std::move(out));
  }

  size_t MatchPrefix(std::span<const BlockHash> hashes, size_t limit) const {
    if (!options.enable_prefix_caching) return 0;
    const size_t n = std::min(hashes.size(), limit);
    if (groups() == 1 && windows[0] <= 0) {
      size_t k = 0;
      while (k < n && cached.count(hashes[k]) > 0) ++k;
      return k;
    }
    return CachedPrefixBlocks(
        windows, options.block_size, n,
        [&](size_t g, size_t i) { return cached.count(Key(hashes[i], g)) > 0; },
        static_cast<int64_t>(options.sink_tokens));
  }

  const BlockManagerOptions options;
  std::vector<int64_t> windows;  // per group; options.group_windows or {0}
  size_t sink_blocks = 0;        // leading entries windowed groups keep (attention sinks)
  mutable std::mutex mu;
  std::vector<Block> blocks;
  std::vector<BlockId> free_list;
  BlockId lru_head = kNil;
  BlockId lru_tail = kNil;
  size_t lru_size = 0;
  std::unordered_map<BlockHash, BlockId> cached;
  std::unordered_map<SeqId, Sequence> sequences;
  std::unordered_map<PinId, std::vector<BlockSlot>> pins;
  PinId next_pin = 1;
  std::vector<KvEventBatch> pending_events;
  uint64_t last_sequence_number = 0;
  // Lower-tier holdings (RecordTierChanges), for snapshots.
  std::unordered_set<BlockHash> host_tier, disk_tier;
  uint64_t query_tokens = 0;
  uint64_t hit_tokens = 0;
  uint64_t evicted_total = 0;
  uint64_t released_total = 0;
};

StatusOr<std::unique_ptr<BlockManager>> BlockManager::Create(const BlockManagerOptions& options) {
  if (options.num_blocks == 0) {
    return Status::InvalidArgument("block manager: num_blocks must be at least 1");
  }
  if (options.block_size == 0) {
    return Status::InvalidArgument("block manager: block_size must be at least 1");
  }
  for (int64_t w : options.group_windows) {
    if (w < 0) return Status::InvalidArgument("block manager: a group window is negative");
  }
  if (options.num_blocks >= kNil) {
    return Status::InvalidArgument("block manager: num_blocks " +
                                   std::to_string(options.num_blocks) + " exceeds the id range");
  }
  return std::unique_ptr<BlockManager>(new BlockManager(std::make_unique<Impl>(options)));
}

BlockManager::BlockManager(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
BlockManager::~BlockManager() = default;

size_t BlockManager::block_size() const { return impl_->options.block_size; }
size_t BlockManager::num_blocks() const { return impl_->options.num_blocks; }

size_t BlockManager::num_groups() const { return impl_->windows.size(); }
const std::vector<int64_t>& BlockManager::group_windows() const { return impl_->windows; }
size_t BlockManager::sink_tokens() const { return impl_->options.sink_tokens; }

size_t BlockManager::ReleasedBlocks(SeqId seq) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->sequences.find(seq);
  return it == impl_->sequences.end() ? 0 : it->second.released;
}

size_t BlockManager::FindCachedPrefix(std::span<const BlockHash> hashes) const {
  std::lock_guard lock(impl_->mu);
  return impl_->MatchPrefix(hashes, hashes.size());
}

bool BlockManager::IsCached(BlockHash hash, uint32_t group) const {
  std::lock_guard lock(impl_->mu);
  return impl_->cached.count(impl_->Key(hash, group)) > 0;
}

StatusOr<AdmitResult> BlockManager::Admit(const AdmitRequest& request) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  if (m.sequences.count(request.seq) > 0) {
    return Status::InvalidArgument("block manager: sequence " + std::to_string(request.seq) +
                                   " is already admitted");
  }
  const size_t bs = m.options.block_size;
  const size_t k = m.MatchPrefix(request.prefix_hashes, request.num_tokens / bs);
  const size_t total = CeilDiv(request.num_tokens, bs);
  const size_t computed = request.computed_tokens.value_or(k * bs);
  if (computed < k * bs || computed > request.num_tokens) {
    return Status::InvalidArgument("block manager: computed_tokens " + std::to_string(computed) +
                                   " is outside [" + std::to_string(k * bs) + ", " +
                                   std::to_string(request.num_tokens) + "]");
  }
  const size_t filled = CeilDiv(computed, bs);  // entries the cache or the caller fill
  const size_t reach_from = std::min(request.reach_from.value_or(computed), computed);
  // Per group, the entries to hold: those the first query (or the one at
  // reach_from) reaches.
  auto hold = [&](size_t g, size_t i) { return m.InReach(g, reach_from, i); };

  // Cached entries to take (below k and in reach), and how many fresh ones.
  // Matched blocks that are evictable now stop being allocatable once taken.
  std::vector<BlockId> matched_evictable;
  size_t fresh = 0;
  for (size_t g = 0; g < m.groups(); ++g) {
    for (size_t i = 0; i < total; ++i) {
      if (!hold(g, i)) continue;
      if (i >= k) {
        ++fresh;
        continue;
      }
      const BlockId id = m.cached.at(m.Key(request.prefix_hashes[i], g));
      if (m.blocks[id].ref == 0) matched_evictable.push_back(id);
    }
  }
  std::sort(matched_evictable.begin(), matched_evictable.end());
  const size_t taken = static_cast<size_t>(
      std::unique(matched_evictable.begin(), matched_evictable.end()) - matched_evictable.begin());
  if (fresh > m.Allocatable() - taken) {
    return Status::ResourceExhausted("block manager: sequence " + std::to_string(request.seq) +
                                     " needs " + std::to_string(fresh) + " new blocks, " +
                                     std::to_string(m.Allocatable() - taken) + " available");
  }

  Sequence seq;
  seq.tables.assign(m.groups(), std::vector<BlockId>(total, kNil));
  seq.committed_hashes.assign(request.prefix_hashes.begin(), request.prefix_hashes.begin() + k);
  // Matched blocks are acquired before allocating, so that the allocation
  // below cannot evict them.
  for (size_t g = 0; g < m.groups(); ++g) {
    for (size_t i = 0; i < std::min(k, total); ++i) {
      if (!hold(g, i)) continue;
      seq.tables[g][i] = m.cached.at(m.Key(request.prefix_hashes[i], g));
      m.Acquire(seq.tables[g][i]);
    }
  }
  AdmitResult result{k, k * bs, {}};
  BatchBuilder batch;
  for (size_t i = k; i < total; ++i) {
    for (size_t g = 0; g < m.groups(); ++g) {
      if (!hold(g, i)) continue;
      seq.tables[g][i] = m.AllocateOne(&batch);
      if (i < filled) result.to_fill.push_back({static_cast<uint32_t>(g), i, seq.tables[g][i]});
    }
  }
  m.sequences.emplace(request.seq, std::move(seq));
  m.Finish(&batch);

  if (request.prompt_tokens_for_stats > 0) {
    m.query_tokens += request.prompt_tokens_for_stats;
    m.hit_tokens += std::min(k * bs, request.prompt_tokens_for_stats);
  }
  return result;
}

Status BlockManager::AllocateSlots(SeqId seq_id, size_t num_tokens,
                                   std::optional<size_t> num_computed) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  auto it = m.sequences.find(seq_id);
  if (it == m.sequences.end()) {
    return Status::NotFound("block manager: unknown sequence " + std::to_string(seq_id));
  }
  Sequence& seq = it->second;
  if (num_computed) m.ReleaseOutOfReach(&seq, *num_computed);
  const size_t total = CeilDiv(num_tokens, m.options.block_size);
  if (total <= seq.size()) return Status::Ok();
  const size_t fresh = (total - seq.size()) * m.groups();
  if (fresh > m.Allocatable()) {
    return Status::ResourceExhausted("block manager: sequence " + std::to_string(seq_id) +
                                     " needs " + std::to_string(fresh) + " new blocks, " +
                                     std::to_string(m.Allocatable()) + " available");
  }
  BatchBuilder batch;
  for (size_t i = seq.size(); i < total; ++i) {
    for (auto& table : seq.tables) table.push_back(m.AllocateOne(&batch));
  }
  m.Finish(&batch);
  return Status::Ok();
}

StatusOr<size_t> BlockManager::BlocksNeeded(SeqId seq_id, size_t num_tokens) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->sequences.find(seq_id);
  if (it == impl_->sequences.end()) {
    return Status::NotFound("block manager: unknown sequence " + std::to_string(seq_id));
  }
  const size_t total = CeilDiv(num_tokens, impl_->options.block_size);
  const size_t have = it->second.size();
  return total > have ? (total - have) * impl_->groups() : 0;
}

Status BlockManager::CommitBlocks(SeqId seq_id, std::span<const BlockHash> block_hashes) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  auto it = m.sequences.find(seq_id);
  if (it == m.sequences.end()) {
    return Status::NotFound("block manager: unknown sequence " + std::to_string(seq_id));
  }
  if (!m.options.enable_prefix_caching) return Status::Ok();
  Sequence& seq = it->second;
  if (block_hashes.size() > seq.size()) {
    return Status::InvalidArgument("block manager: commit of " +
                                   std::to_string(block_hashes.size()) + " blocks for sequence " +
                                   std::to_string(seq_id) + " which has only " +
                                   std::to_string(seq.size()));
  }
  const size_t done = seq.committed_hashes.size();
  for (size_t i = 0; i < std::min(done, block_hashes.size()); ++i) {
    if (seq.committed_hashes[i] != block_hashes[i]) {
      return Status::InvalidArgument("block manager: sequence " + std::to_string(seq_id) +
                                     " block " + std::to_string(i) +
                                     " was committed under another hash");
    }
  }
  for (const auto& table : seq.tables) {
    for (size_t i = done; i < block_hashes.size(); ++i) {
      if (table[i] != kNil && m.blocks[table[i]].has_hash) {
        return Status::Internal("block manager: uncommitted block " + std::to_string(table[i]) +
                                " already carries a hash");
      }
    }
  }
  BatchBuilder batch;
  // Group by group, so that each group's run is one event.
  for (size_t g = 0; g < m.groups(); ++g) {
    for (size_t i = done; i < block_hashes.size(); ++i) {
      const BlockId id = seq.tables[g][i];
      if (id == kNil) continue;  // a windowed group holds nothing there
      const BlockHash key = m.Key(block_hashes[i], g);
      // Another block already holds this content: keep ours private rather
      // than announce a duplicate.
      if (!m.cached.emplace(key, id).second) continue;
      Block& b = m.blocks[id];
      b.has_hash = true;
      b.hash = key;
      b.group = static_cast<uint32_t>(g);
      batch.Stored(key,
                   i > 0 ? std::optional<BlockHash>(m.Key(block_hashes[i - 1], g)) : std::nullopt,
                   static_cast<uint32_t>(g));
    }
  }
  if (block_hashes.size() > done) {
    seq.committed_hashes.insert(seq.committed_hashes.end(), block_hashes.begin() + done,
                                block_hashes.end());
  }
  m.Finish(&batch);
  return Status::Ok();
}

const std::vector<BlockId>& BlockManager::BlockTable(SeqId seq_id, uint32_t group) const {
  static const std::vector<BlockId> kEmpty;
  std::lock_guard lock(impl_->mu);
  auto it = impl_->sequences.find(seq_id);
  if (it == impl_->sequences.end() || group >= it->second.tables.size()) return kEmpty;
  return it->second.tables[group];
}

bool BlockManager::HasSequence(SeqId seq_id) const {
  std::lock_guard lock(impl_->mu);
  return impl_->sequences.count(seq_id) > 0;
}

size_t BlockManager::NumCommittedBlocks(SeqId seq_id) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->sequences.find(seq_id);
  return it == impl_->sequences.end() ? 0 : it->second.committed_hashes.size();
}

uint32_t BlockManager::RefCount(BlockId block) const {
  std::lock_guard lock(impl_->mu);
  return block < impl_->blocks.size() ? impl_->blocks[block].ref : 0;
}

Status BlockManager::Free(SeqId seq_id) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  auto it = m.sequences.find(seq_id);
  if (it == m.sequences.end()) {
    return Status::NotFound("block manager: unknown sequence " + std::to_string(seq_id));
  }
  m.ReleaseAll(it->second);
  m.sequences.erase(it);
  return Status::Ok();
}

Status BlockManager::AdoptBlocks(SeqId seq_id, SeqId from_id) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  auto it = m.sequences.find(seq_id), from = m.sequences.find(from_id);
  if (it == m.sequences.end() || from == m.sequences.end()) {
    return Status::NotFound("block manager: unknown sequence " +
                            std::to_string(it == m.sequences.end() ? seq_id : from_id));
  }
  if (seq_id == from_id) return Status::InvalidArgument("block manager: a sequence adopts itself");
  auto held = [](const Sequence& s) {
    size_t n = 0;
    for (const auto& table : s.tables)
      n += std::count_if(table.begin(), table.end(), [](BlockId b) { return b != kNil; });
    return n;
  };
  const size_t before = held(it->second), after = held(from->second);
  const size_t released = it->second.released + (before > after ? before - after : 0);
  m.released_total += before > after ? before - after : 0;
  m.ReleaseAll(it->second);
  it->second = std::move(from->second);
  it->second.released = released;
  m.sequences.erase(from);
  return Status::Ok();
}

StatusOr<PinId> BlockManager::Pin(SeqId seq_id, size_t first_block) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  auto it = m.sequences.find(seq_id);
  if (it == m.sequences.end()) {
    return Status::NotFound("block manager: unknown sequence " + std::to_string(seq_id));
  }
  const Sequence& seq = it->second;
  std::vector<BlockSlot> pinned;
  for (size_t i = first_block; i < seq.size(); ++i) {
    for (size_t g = 0; g < m.groups(); ++g) {
      if (seq.tables[g][i] == kNil) continue;
      pinned.push_back({static_cast<uint32_t>(g), i, seq.tables[g][i]});
      m.Acquire(seq.tables[g][i]);
    }
  }
  const PinId pin = m.next_pin++;
  m.pins.emplace(pin, std::move(pinned));
  return pin;
}

std::vector<BlockId> BlockManager::PinnedBlocks(PinId pin) const {
  std::vector<BlockId> blocks;
  for (const BlockSlot& slot : PinnedSlots(pin)) blocks.push_back(slot.block);
  return blocks;
}

std::vector<BlockSlot> BlockManager::PinnedSlots(PinId pin) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->pins.find(pin);
  return it == impl_->pins.end() ? std::vector<BlockSlot>{} : it->second;
}

Status BlockManager::Unpin(PinId pin) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  auto it = m.pins.find(pin);
  if (it == m.pins.end()) {
    return Status::NotFound("block manager: unknown pin " + std::to_string(pin));
  }
  for (auto slot = it->second.rbegin(); slot != it->second.rend(); ++slot) m.Release(slot->block);
  m.pins.erase(it);
  return Status::Ok();
}

size_t BlockManager::Evict(size_t max_blocks) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  BatchBuilder batch;
  size_t n = 0;
  for (; n < max_blocks && m.lru_size > 0; ++n) {
    BlockId id = m.EvictOne(&batch);
    m.blocks[id].on_free_list = true;
    m.free_list.push_back(id);
  }
  m.Finish(&batch);
  return n;
}

void BlockManager::ResetPrefixCache() {
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  if (!m.options.enable_prefix_caching) return;
  for (const auto& [hash, id] : m.cached) {
    Block& b = m.blocks[id];
    b.has_hash = false;
    if (b.on_lru) {
      m.LruRemove(id);
      b.on_free_list = true;
      m.free_list.push_back(id);
    }
  }
  m.cached.clear();
  BatchBuilder batch;
  batch.Cleared();
  m.Finish(&batch);
}

std::vector<KvEventBatch> BlockManager::DrainEvents() {
  std::lock_guard lock(impl_->mu);
  return std::exchange(impl_->pending_events, {});
}

KvCacheSnapshot BlockManager::Snapshot() const {
  std::lock_guard lock(impl_->mu);
  KvCacheSnapshot snapshot;
  snapshot.last_sequence_number = impl_->last_sequence_number;
  snapshot.block_hashes.reserve(impl_->cached.size());
  for (const auto& entry : impl_->cached) snapshot.block_hashes.push_back(entry.first);
  snapshot.host_block_hashes.assign(impl_->host_tier.begin(), impl_->host_tier.end());
  snapshot.disk_block_hashes.assign(impl_->disk_tier.begin(), impl_->disk_tier.end());
  return snapshot;
}

void BlockManager::RecordTierChanges(std::span<const KvTierChange> changes) {
  if (changes.empty()) return;
  Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  std::vector<KvEvent> events;
  for (const KvTierChange& c : changes) {
    if (c.tier == KvTier::kDevice) continue;
    std::unordered_set<BlockHash>& held = c.tier == KvTier::kHost ? m.host_tier : m.disk_tier;
    if (c.stored) {
      held.insert(c.hash);
    } else {
      held.erase(c.hash);
    }
    // Consecutive changes of one kind and tier share an event.
    if (!events.empty()) {
      if (auto* s = std::get_if<KvStored>(&events.back());
          s != nullptr && c.stored && s->tier == c.tier) {
        s->block_hashes.push_back(c.hash);
        continue;
      }
      if (auto* r = std::get_if<KvRemoved>(&events.back());
          r != nullptr && !c.stored && r->tier == c.tier) {
        r->block_hashes.push_back(c.hash);
        continue;
      }
    }
    if (c.stored) {
      events.emplace_back(KvStored{{c.hash}, std::nullopt, c.tier});
    } else {
      events.emplace_back(KvRemoved{{c.hash}, c.tier});
    }
  }
  if (events.empty()) return;
  KvEventBatch out{++m.last_sequence_number, std::move(events)};
  if (m.options.record_kv_events) m.pending_events.push_back(std::move(out));
}

uint64_t BlockManager::last_event_sequence_number() const {
  std::lock_guard lock(impl_->mu);
  return impl_->last_sequence_number;
}

BlockManagerStats BlockManager::GetStats() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  BlockManagerStats s;
  s.num_blocks = m.options.num_blocks;
  s.free_blocks = m.free_list.size();
  s.evictable_blocks = m.lru_size;
  s.used_blocks = s.num_blocks - s.free_blocks - s.evictable_blocks;
  s.cached_blocks = m.cached.size();
  s.allocatable_blocks = m.Allocatable();
  s.usage_ratio = static_cast<double>(s.used_blocks) / static_cast<double>(s.num_blocks);
  s.prefix_cache_query_tokens = m.query_tokens;
  s.prefix_cache_hit_tokens = m.hit_tokens;
  s.evicted_blocks_total = m.evicted_total;
  s.released_out_of_reach_blocks_total = m.released_total;
  s.num_sequences = m.sequences.size();
  s.num_pins = m.pins.size();
  return s;
}

Status BlockManager::CheckInvariants() const {
  const Impl& m = *impl_;
  std::lock_guard lock(m.mu);
  const size_t n = m.options.num_blocks;
  auto fail = [](std::string what) { return Status::Internal("block manager: " + what); };

  // Reference counts must equal the number of table and pin entries.
  std::vector<uint32_t> refs(n, 0);
  for (const auto& [id, seq] : m.sequences) {
    if (seq.tables.size() != m.groups()) {
      return fail("sequence " + std::to_string(id) + " has the wrong number of tables");
    }
    if (seq.committed_hashes.size() > seq.size()) {
      return fail("sequence " + std::to_string(id) + " has more commits than blocks");
    }
    for (size_t g = 0; g < seq.tables.size(); ++g) {
      const auto& table = seq.tables[g];
      if (table.size() != seq.size()) {
        return fail("sequence " + std::to_string(id) + " has tables of different lengths");
      }
      bool seen_held = false;
      for (size_t i = 0; i < table.size(); ++i) {
        const BlockId b = table[i];
        if (b == kNil) {
          // Only a windowed group leaves entries empty, and only between
          // its sink blocks and the ones its window holds.
          if (m.windows[g] <= 0 || seen_held || i < m.sink_blocks) {
            return fail("sequence " + std::to_string(id) + " group " + std::to_string(g) +
                        " has an empty entry " + std::to_string(i));
          }
          continue;
        }
        if (i >= m.sink_blocks) seen_held = true;
        if (b >= n) return fail("sequence " + std::to_string(id) + " holds bad block id");
        ++refs[b];
        // Reserved (uncommitted) blocks must never be matchable.
        if (i >= seq.committed_hashes.size() && m.blocks[b].has_hash) {
          return fail("uncommitted block " + std::to_string(b) + " carries a hash");
        }
      }
    }
  }
  for (const auto& [pin, slots] : m.pins) {
    for (const BlockSlot& slot : slots) {
      if (slot.block >= n) return fail("pin " + std::to_string(pin) + " holds bad block id");
      ++refs[slot.block];
    }
  }

  std::vector<uint8_t> seen_free(n, 0);
  for (BlockId b : m.free_list) {
    if (b >= n || seen_free[b]++) return fail("free list holds a bad or repeated block");
  }
  std::vector<uint8_t> seen_lru(n, 0);
  size_t lru_count = 0;
  BlockId prev = kNil;
  for (BlockId b = m.lru_head; b != kNil; prev = b, b = m.blocks[b].lru_next) {
    if (b >= n || seen_lru[b]++ || ++lru_count > n) return fail("LRU list is corrupt");
    if (m.blocks[b].lru_prev != prev) return fail("LRU back link is corrupt");
  }
  if (prev != m.lru_tail || lru_count != m.lru_size) return fail("LRU tail or size is wrong");

  size_t free_count = 0, used_count = 0, evictable_count = 0, hashed = 0;
  for (size_t i = 0; i < n; ++i) {
    const Block& b = m.blocks[i];
    const std::string name = "block " + std::to_string(i);
    if (b.ref != refs[i]) {
      return fail(name + " refcount " + std::to_string(b.ref) + " but " + std::to_string(refs[i]) +
                  " references");
    }
    if (b.on_free_list != (seen_free[i] != 0) || b.on_lru != (seen_lru[i] != 0)) {
      return fail(name + " list flags disagree with the lists");
    }
    if (b.has_hash) {
      ++hashed;
      auto it = m.cached.find(b.hash);
      if (it == m.cached.end() || it->second != i) return fail(name + " hash not in the map");
    }
    if (b.ref > 0) {
      ++used_count;
      if (b.on_free_list || b.on_lru) return fail(name + " is used but on a free/LRU list");
    } else if (b.has_hash) {
      ++evictable_count;
      if (!b.on_lru || b.on_free_list) return fail(name + " is evictable but not (only) on LRU");
    } else {
      ++free_count;
      if (!b.on_free_list || b.on_lru) return fail(name + " is free but not (only) on free list");
    }
  }
  if (hashed != m.cached.size()) return fail("hash map has entries for no block");
  if (free_count + used_count + evictable_count != n) return fail("blocks are unaccounted for");
  if (free_count != m.free_list.size() || evictable_count != m.lru_size) {
    return fail("counters disagree with block states");
  }
  return Status::Ok();
}

}  // namespace pdserve
