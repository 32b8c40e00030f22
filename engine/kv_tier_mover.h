// Moves KV blocks between an engine and its lower tiers (engine/kv_tier_store.h)
// on a thread of its own, so that the engine's step loop never waits for the
// tiers' memory copies or disk I/O.
//
//  - Offload: the engine hands over a copy of each cached block the block
//    manager evicts (taken on the engine thread, before the block is reused:
//    one memcpy, or one device-to-host copy into a page-locked buffer of
//    engine/host_block_buffers.h); the mover puts it into the
//    tiers. Until it is there the copy stays queued here, and a prompt that
//    needs the block meanwhile gets it from the queue: a write still in
//    flight is not lost.
//  - Onload: the engine asks for a run of blocks a prompt continues with;
//    the mover reads them (host memory or disk) into such buffers and
//    reports them; the engine copies them into the pool and the request goes
//    on. A run longer than `max_onload_blocks` is reported in parts of that
//    many, each read once the engine has taken the ones before (offloads go
//    on meanwhile), so that one long prefix holds at most two parts of
//    page-locked memory, not its whole length.
//
//  - Write-through (KvTierStore::writes_through): a writer thread of its
//    own copies host-tier blocks to disk as they arrive, at most
//    `write_bytes_per_second` (0: as fast as the disk takes them), so that
//    neither onloads nor the engine ever wait behind those writes.
//  - Flush: a stopping worker puts every queued offload away and writes the
//    host tier's blocks that have no disk copy yet, until a deadline.
//
// Every change of what the tiers hold is collected for the engine to record
// as KV events (BlockManager::RecordTierChanges). Failed disk writes (a full
// disk, an I/O error) are logged with their cause at most once per 10 s,
// the rest counted in the store's stats.
//
// Thread safety: every method may be called from any thread; `on_ready`
// runs on the mover's thread after each onload completes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/host_block_buffers.h"
#include "engine/kv_tier_store.h"

namespace pdserve {

class KvTierMover {
 public:
  struct Loaded {
    uint64_t ticket = 0;
    // The leading requested blocks found, in order (a block missing, or
    // dropped as corrupt, ends the run), with the tier each came from:
    // from the `first`-th block asked, to the end of the run when `last`,
    // else a part of it that more parts of the same ticket follow.
    size_t first = 0;
    bool last = true;
    std::vector<HostBlockBuffers::Buffer> blocks;
    std::vector<KvTier> tiers;
    double seconds = 0;  // from the request to the last block read
  };

  // Onloads read into buffers from `buffers` (of the store's block size),
  // at most `max_onload_blocks` a part (0: a run in one part).
  KvTierMover(KvTierStore* store, HostBlockBuffers* buffers, std::function<void()> on_ready,
              int64_t write_bytes_per_second = 0, int64_t max_onload_blocks = 0);
  // Finishes queued offloads, drops queued onloads (on_ready is not called
  // once stopping), then joins; queued write-through copies are left.
  ~KvTierMover();
  KvTierMover(const KvTierMover&) = delete;
  KvTierMover& operator=(const KvTierMover&) = delete;

  // Queues an evicted block's copy; false when a copy of `hash` is queued
  // already (the same KV: this one is dropped).
  bool Offload(BlockHash hash, HostBlockBuffers::Buffer bytes);
  // Whether the tiers (or the offload queue) hold `hash` now.
  bool Holds(BlockHash hash) const;
  void Onload(uint64_t ticket, std::vector<BlockHash> hashes);
  // The onload of `ticket` is not wanted any more (its request was cancelled
  // or preempted): what of it is not read yet is not read, and its parts
  // not yet taken are dropped.
  void Abandon(uint64_t ticket);

  std::vector<Loaded> TakeLoaded();
  // The tiers' changes since the last call, in the store's order
  // (KvTierStore::TakeChanges), whichever thread made them.
  std::vector<KvTierChange> TakeChanges();

  struct FlushResult {
    int64_t written = 0;  // host blocks written to disk
    int64_t left = 0;     // blocks the deadline left without a disk copy
  };
  // Waits for the offloads queued so far, then writes the host tier's
  // blocks that lack a disk copy (KvTierStore::FlushHostToDisk), all by
  // `deadline`. An error: a write failed.
  StatusOr<FlushResult> Flush(std::chrono::steady_clock::time_point deadline);

  struct Counters {
    int64_t offloads_queued = 0;  // now
    int64_t onloads_in_flight = 0;
    int64_t onloads_ready = 0;     // done, their blocks not yet taken (TakeLoaded)
    int64_t offload_failures = 0;  // puts the store refused (disk errors)
  };
  Counters counters() const;

 private:
  struct Job {
    bool onload = false;
    BlockHash hash = 0;                           // offload
    uint64_t ticket = 0;                          // onload
    std::vector<BlockHash> hashes;                // onload
    size_t next = 0;                              // onload: the first hash not read yet
    std::chrono::steady_clock::time_point asked;  // onload
  };
  // Takes the next job to run (mu_ held): a parked onload once its parts
  // were taken, else the queue's first, but no other onload while one is
  // parked (onloads are served in turn). Null: nothing to run now.
  std::optional<Job> NextJobLocked();
  void Run();
  void WriteLoop();
  // Logs a failed offload or disk write: the first, then one line per 10 s
  // saying how many more failed meanwhile. mu_ held.
  void NoteFailureLocked(const Status& st);

  KvTierStore* store_;
  HostBlockBuffers* buffers_;
  std::function<void()> on_ready_;
  int64_t write_bytes_per_second_;
  size_t max_onload_blocks_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable writer_cv_;   // write_pending_ or stop_
  std::condition_variable settled_cv_;  // queued_ became empty
  bool write_pending_ = false;          // the store may have queued write-through copies
  std::chrono::steady_clock::time_point last_failure_log_{};
  int64_t failures_unlogged_ = 0;
  std::deque<Job> jobs_;
  // Offloaded copies not yet in the store, by hash.
  std::unordered_map<BlockHash, std::shared_ptr<const HostBlockBuffers::Buffer>> queued_;
  std::vector<Loaded> loaded_;
  // An onload whose last part waits in loaded_: resumed once it is taken.
  std::optional<Job> parked_;
  // The onload being read now, and whether Abandon asked for it meanwhile.
  std::optional<uint64_t> reading_;
  bool reading_abandoned_ = false;
  int64_t onloads_in_flight_ = 0;
  int64_t offload_failures_ = 0;
  bool stop_ = false;
  std::thread thread_;
  std::thread writer_;  // write-through only
};

}  // namespace pdserve
