// The lower tiers of a worker's KV cache: host memory and a local disk
// behind the device pool (issue 18). A full, committed block that leaves the
// device pool is kept here under its (salted) block hash, so that a later
// prompt with the same prefix copies it back instead of computing it.
//
// Tiers, each LRU, each evicting into the one below:
//   host  `host_bytes` of memory, block-sized slots;
//   disk  one preallocated slab file, `disk_dir`/kv-tier.slab, of
//         `disk_bytes`: slots of a 64-byte header and the block's bytes,
//         each written with one pwritev and read with one preadv (a block
//         is one contiguous range of the pool, so a tier transfer is one
//         large sequential I/O).
//
// Disk writes with a host tier (KvDiskWrite):
//   through  a block that enters the host tier is queued for a copy on disk
//            as well (WriteQueued, driven by the tier mover's writer
//            thread), so that a crash loses at most the blocks still queued;
//            the host tier then evicts a block that has its disk copy
//            without writing it again. At most `write_queue_blocks` wait;
//            a block that finds the queue full is counted as dropped and
//            reaches the disk when the host tier evicts it.
//   back     blocks reach the disk only when the host tier evicts them; a
//            clean stop calls FlushHostToDisk.
// Host and disk may both hold a block under `through`; under `back` one
// lower tier holds a block at a time.
//
// The slab: one process at a time owns it (an advisory lock); it must be a
// regular file of this process's user, not a symbolic link or a file with
// other hard links (Open refuses those rather than resize what they point
// at); its space is reserved at Open (fallocate where the file system has
// it), after checking the folder's free space against `disk_bytes`.
// Plain buffered I/O: crash safety does not depend on write ordering or
// fsync but on the header: block hash, the writing layout's hash (which
// covers the model's fingerprint: weights, config, tokenizer, KV scales, the
// engine's KV compute version),
// a generation number and checksums of header and payload (XXH3). A block
// whose checksums fail when it is read (a torn write from a kill, a
// corrupted sector) is never served: it is dropped and counted. Opening
// rebuilds the disk index from the slot headers (a warm restart), keeping
// the newest copy of each hash; slots written under another layout hash
// (another model, weights, KV dtype or scales, block size) are discarded:
// their headers are cleared, and they are counted and logged. Slots written
// by the same model and KV configuration at another tensor-parallel size
// (one of `reslice_from`) are re-sliced in place at Open instead: each is
// read, checked, converted to this layout and written back under this
// layout's hash, keeping its block hash and generation. Only slots found
// at this slab's slot starts are seen, so a layout whose entries take
// another slot size would be found in part (the engine's tensor-parallel
// entries take a block's TP 1 bytes at every size: engine/kv_tier_reslice.h).
//
// Tenant isolation: blocks are keyed by the hash the block manager commits
// them under, which folds in the cache salt (hash spec v1), so two tenants'
// blocks never share a key in any tier.
//
// Thread safety: every method may be called from any thread. Disk I/O runs
// outside the store's lock; a slot being read or written is never reused
// until that I/O is over.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
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

enum class KvDiskWrite : uint8_t { kThrough, kBack };
std::optional<KvDiskWrite> ParseKvDiskWrite(std::string_view name);  // "through" | "back"
std::string_view KvDiskWriteName(KvDiskWrite w);

// Entries of another layout the disk tier converts at Open: the layout
// hash their slots carry, their payload's bytes, and the conversion
// (`from`: payload_bytes; `to`: block_bytes). `name` says which layout, in
// the log line.
struct KvTierReslice {
  uint64_t layout_hash = 0;
  int64_t payload_bytes = 0;
  std::string name;
  std::function<void(const uint8_t* from, uint8_t* to)> convert;
};

struct KvTierOptions {
  int64_t block_bytes = 0;   // the device pool's bytes per block (> 0)
  uint64_t layout_hash = 0;  // KvLayout::Hash() of the pool the blocks come from
  int64_t host_bytes = 0;    // 0: no host tier
  std::string disk_dir;      // "": no disk tier
  int64_t disk_bytes = 0;    // with disk_dir: the slab's size (> 0)
  KvDiskWrite disk_write = KvDiskWrite::kThrough;  // with both tiers
  int64_t write_queue_blocks = 1024;               // through: blocks waiting, at most (> 0)
  // Where the host tier's memory comes from: the device's backend
  // (AllocateHost: page-locked on CUDA, as the tier's copies to and from the
  // device want it); null: ordinary memory.
  kernels::Backend* host_memory_from = nullptr;
  // Disk: the layouts whose slots Open re-slices into this one.
  std::vector<KvTierReslice> reslice_from;
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
  // Disk writes, by cause: a write-through copy, a block written as it
  // left the host tier (or the device pool, without a host tier), a flush.
  int64_t disk_writes_through = 0, disk_writes_evict = 0, disk_writes_flush = 0;
  int64_t write_queue_blocks = 0;  // now: host blocks waiting for their disk copy
  int64_t write_dropped = 0;       // host blocks that found the write queue full
  int64_t disk_write_errors = 0;   // writes that failed (full disk, I/O error)
  int64_t discarded_at_open = 0;   // slab slots of another layout or model, cleared
  int64_t resliced_at_open = 0;    // slab slots of a reslice_from layout, converted
};

class KvTierStore {
 public:
  // InvalidArgument for sizes that hold no block or a missing block size;
  // Unavailable when the directory or slab cannot be created, the slab is a
  // symbolic link, not a regular file, has other hard links or another
  // owner, or is locked by another process; ResourceExhausted when the
  // folder's file system has less free space than the slab still needs.
  // With a disk tier, the slab is opened and its index rebuilt.
  static StatusOr<std::unique_ptr<KvTierStore>> Open(const KvTierOptions& options);
  ~KvTierStore();
  KvTierStore(const KvTierStore&) = delete;
  KvTierStore& operator=(const KvTierStore&) = delete;

  bool has_host() const { return host_slots_ > 0; }
  bool has_disk() const { return disk_slots_ > 0; }
  // Whether host blocks are queued for write-through (both tiers, kThrough).
  bool writes_through() const;
  const std::string& slab_path() const { return slab_path_; }

  // Keeps a copy of a block (block_bytes from `bytes`) under `hash`, in the
  // highest tier that has one (host, else disk); a tier that is full first
  // moves its least recently used block down (or drops it from the last
  // tier). A hash already held is refreshed, not copied again. Appends what
  // changed to *changes. A demotion whose disk write failed is returned as
  // the error, though the block itself was kept (in the slot the demoted
  // block left).
  Status Put(BlockHash hash, const uint8_t* bytes, std::vector<KvTierChange>* changes);

  // The tier that holds `hash`, if any (host first).
  std::optional<KvTier> Find(BlockHash hash) const;

  // Copies the block held under `hash` into `out` (block_bytes). A disk
  // block whose checksums fail is dropped (a change: removed) and counted:
  // NotFound then, as for a hash held nowhere. Counts a hit for its tier.
  Status Get(BlockHash hash, uint8_t* out, std::vector<KvTierChange>* changes);

  // Write-through: writes the disk copy of the oldest queued host block.
  // Returns the bytes written (0 when nothing was queued); a failed write
  // is an error (the block stays in the host tier, unqueued).
  StatusOr<int64_t> WriteQueued(std::vector<KvTierChange>* changes);

  // Writes the host blocks that have no disk copy to disk, keeping them in
  // the host tier: the most recently used ones the disk holds, least
  // recently used first, so that the disk's LRU order follows the host's.
  // Stops at `deadline`. Returns the blocks written; *left (if given): those
  // it had no time for.
  StatusOr<int64_t> FlushHostToDisk(std::chrono::steady_clock::time_point deadline,
                                    std::vector<KvTierChange>* changes, int64_t* left = nullptr);

  // Every hash `tier` holds, for snapshots and resync.
  std::vector<BlockHash> Blocks(KvTier tier) const;

  // Every change since the last call, from every caller, in the order the
  // store made them (what the *changes arguments above got, merged): the
  // threads that move blocks append theirs after their I/O, so only this
  // order replays into what Blocks() says.
  std::vector<KvTierChange> TakeChanges();

  KvTierStats stats() const;
  const KvTierOptions& options() const { return options_; }

 private:
  struct Slot;
  struct Tier;
  KvTierStore() = default;

  Status OpenDisk();
  Status ReserveSlab(const std::string& path, int64_t allocated_bytes);
  // Moves host slot `victim` down to the disk tier (or drops it), lock held
  // on entry and on return; released around the disk write.
  Status DemoteLocked(std::unique_lock<std::mutex>& lock, std::vector<KvTierChange>* changes);
  // Writes held host slot `slot` to a disk slot, the host copy staying
  // (write-through and flush); lock held on entry and return.
  Status CopyHostToDiskLocked(std::unique_lock<std::mutex>& lock, int64_t slot, int64_t* counter,
                              std::vector<KvTierChange>* changes);
  // A free disk slot, evicting the LRU one if needed; -1 when every slot is
  // busy with I/O.
  // Before a fresh disk copy of `hash` (in `fresh_slot`) is kept: releases
  // the older copy, or, while a read holds that one busy, frees the fresh
  // slot instead and returns false.
  bool ReplaceDiskCopyLocked(BlockHash hash, int64_t fresh_slot);
  int64_t TakeDiskSlotLocked(std::vector<KvTierChange>* changes);
  // Records a change for the caller and in the store's own log.
  void NoteLocked(std::vector<KvTierChange>* changes, const KvTierChange& change);
  Status WriteDiskSlot(int64_t slot, BlockHash hash, uint64_t generation, const uint8_t* bytes);
  // Reads and verifies; false when the checksums fail.
  bool ReadDiskSlot(int64_t slot, BlockHash hash, uint8_t* out);
  // Open: converts slot `slot`, whose header `from` wrote, into this
  // layout in place; false when it cannot be read or its checksum fails.
  bool ResliceDiskSlot(int64_t slot, uint64_t generation, BlockHash hash, uint64_t payload_checksum,
                       const KvTierReslice& from);
  // Host slot `slot` was released or changed: forget its queued write.
  void UnqueueLocked(int64_t slot);

  KvTierOptions options_;
  int64_t host_slots_ = 0;
  int64_t disk_slots_ = 0;
  int64_t slot_stride_ = 0;  // disk: header + payload, rounded up to 4 KiB
  std::string slab_path_;
  int fd_ = -1;
  uint8_t* host_memory_ = nullptr;  // host_slots_ blocks

  mutable std::mutex mu_;
  std::unique_ptr<Tier> host_, disk_;
  uint64_t next_generation_ = 1;
  // Write-through: host slots (and the hash each held when queued), oldest
  // first; an entry whose slot no longer carries the flag is stale.
  std::deque<std::pair<int64_t, BlockHash>> write_queue_;
  int64_t queued_ = 0;  // slots carrying the flag
  int64_t corrupt_dropped_ = 0;
  int64_t writes_through_ = 0, writes_evict_ = 0, writes_flush_ = 0;
  int64_t write_dropped_ = 0, write_errors_ = 0, discarded_ = 0, resliced_ = 0;
  std::vector<KvTierChange> log_;  // TakeChanges
};

}  // namespace pdserve
