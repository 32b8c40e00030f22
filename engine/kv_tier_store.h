// The lower tiers of a worker's KV cache: host memory and a local disk
// behind the device pool (issue 18). A full, committed block that leaves the
// device pool is kept here under its (salted) block hash, so that a later
// prompt with the same prefix copies it back instead of computing it.
//
// Tiers, each LRU, each evicting into the one below:
//   host  `host_bytes` of memory, block-sized slots;
//   disk  one preallocated slab file in `disk_dir` of `disk_bytes`: slots of
//         a 64-byte header and the block's bytes, each written with one
//         pwrite and read with one pread (a block is one contiguous range of
//         the pool, so a tier transfer is one large sequential I/O).
// One process at a time owns a slab (an advisory lock on the file).
// Plain buffered I/O: the page cache absorbs the writes, and crash safety
// does not depend on write ordering or fsync but on the header: block hash,
// the writing layout's hash, a generation number and checksums of header
// and payload (XXH3). A block whose checksums fail when it is read (a torn
// or corrupted slot) is never served: it is dropped and counted. Opening a
// directory rebuilds the disk index from the slot headers (a warm restart),
// keeping the newest copy of each hash; a slab written by another layout
// (model, KV dtype, block size) lives under another file name and is not
// read.
//
// Tenant isolation: blocks are keyed by the hash the block manager commits
// them under, which folds in the cache salt (hash spec v1), so two tenants'
// blocks never share a key in any tier.
//
// Thread safety: every method may be called from any thread. Put and Get do
// their disk I/O outside the store's lock; a slot being read or written is
// never reused until that I/O is over.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "common/block_hash.h"
#include "common/kv_events.h"
#include "common/status.h"
#include "kernels/backend.h"

namespace pdserve {

struct KvTierOptions {
  int64_t block_bytes = 0;   // the device pool's bytes per block (> 0)
  uint64_t layout_hash = 0;  // KvLayout::Hash() of the pool the blocks come from
  int64_t host_bytes = 0;    // 0: no host tier
  std::string disk_dir;      // "": no disk tier
  int64_t disk_bytes = 0;    // with disk_dir: the slab's size (> 0)
  // Where the host tier's memory comes from: the device's backend
  // (AllocateHost: page-locked on CUDA, as the tier's copies to and from the
  // device want it); null: ordinary memory.
  kernels::Backend* host_memory_from = nullptr;
};

// Where the blocks of a Put or an eviction went, for KV events: a block
// stored into a tier, or removed from one.
struct KvTierChange {
  BlockHash hash = 0;
  KvTier tier = KvTier::kHost;
  bool stored = true;  // false: removed
};

struct KvTierStats {
  struct Tier {
    int64_t blocks = 0;  // held now
    int64_t capacity_blocks = 0;
    int64_t hits = 0;           // blocks Get served from this tier
    int64_t bytes_written = 0;  // into this tier
    int64_t bytes_read = 0;     // out of it
  };
  Tier host, disk;
  int64_t corrupt_dropped = 0;  // disk blocks whose checksums failed
};

class KvTierStore {
 public:
  // InvalidArgument for sizes that hold no block or a missing block size;
  // Unavailable when the directory or slab cannot be created. With a disk
  // tier, the slab of this layout is opened and its index rebuilt.
  static StatusOr<std::unique_ptr<KvTierStore>> Open(const KvTierOptions& options);
  ~KvTierStore();
  KvTierStore(const KvTierStore&) = delete;
  KvTierStore& operator=(const KvTierStore&) = delete;

  bool has_host() const { return host_slots_ > 0; }
  bool has_disk() const { return disk_slots_ > 0; }

  // Keeps a copy of a block (block_bytes from `bytes`) under `hash`, in the
  // highest tier that has one (host, else disk); a tier that is full first
  // moves its least recently used block down (or drops it from the last
  // tier). A hash already held is refreshed, not copied again. Appends what
  // changed to *changes.
  Status Put(BlockHash hash, const uint8_t* bytes, std::vector<KvTierChange>* changes);

  // The tier that holds `hash`, if any (host first).
  std::optional<KvTier> Find(BlockHash hash) const;

  // Copies the block held under `hash` into `out` (block_bytes). A disk
  // block whose checksums fail is dropped (a change: removed) and counted:
  // NotFound then, as for a hash held nowhere. Counts a hit for its tier.
  Status Get(BlockHash hash, uint8_t* out, std::vector<KvTierChange>* changes);

  // Every hash `tier` holds, for snapshots and resync.
  std::vector<BlockHash> Blocks(KvTier tier) const;

  KvTierStats stats() const;
  const KvTierOptions& options() const { return options_; }

 private:
  struct Slot;
  struct Tier;
  KvTierStore() = default;

  Status OpenDisk();
  // Moves host slot `victim` down to the disk tier (or drops it), lock held
  // on entry and on return; released around the disk write.
  Status DemoteLocked(std::unique_lock<std::mutex>& lock, std::vector<KvTierChange>* changes);
  // A free disk slot, evicting the LRU one if needed; -1 when every slot is
  // busy with I/O.
  int64_t TakeDiskSlotLocked(std::vector<KvTierChange>* changes);
  Status WriteDiskSlot(int64_t slot, BlockHash hash, uint64_t generation, const uint8_t* bytes);
  // Reads and verifies; false when the checksums fail.
  bool ReadDiskSlot(int64_t slot, BlockHash hash, uint8_t* out);

  KvTierOptions options_;
  int64_t host_slots_ = 0;
  int64_t disk_slots_ = 0;
  int64_t slot_stride_ = 0;  // disk: header + payload, rounded up to 4 KiB
  int fd_ = -1;
  uint8_t* host_memory_ = nullptr;  // host_slots_ blocks

  mutable std::mutex mu_;
  std::unique_ptr<Tier> host_, disk_;
  uint64_t next_generation_ = 1;
  int64_t corrupt_dropped_ = 0;
};

}  // namespace pdserve
