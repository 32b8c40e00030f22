// KvTransfer: moves KV-cache blocks from one worker's pool into another's.
//
// One KvTransfer per worker process. Its life, in order:
//   1. RegisterPool(): the whole KV pool, once, as ONE region (not per block);
//      or AllocatePool(), which lets the backend allocate it where its
//      transports reach it best (for UCX on one host: shared memory).
//   2. ExportDescriptor(): opaque bytes (address, packed remote key, layout)
//      that the caller carries to the peer over the control plane.
//   3. Handshake. The WRITER (prefill side) calls Connect(peer descriptor),
//      which validates the blob and the layout (a mismatch names the field) and
//      returns a PeerId plus a `reply` blob. The caller carries the reply back;
//      the RECEIVER (decode side) calls Accept(reply), which validates it the
//      same way and returns the receiver's PeerId for that writer.
//   4. Write(peer, pairs, deadline, done) on the writer; Receive(...) with
//      EXACTLY the same pairs on the receiver. Always post the Receive: it is
//      required by two-sided transfers (NCCL; UCX pairs that are staged
//      through bounce buffers, see below), where its `done` fires once every
//      byte is in the receiver's registered pool; for one-sided transfers
//      (UCX puts straight into the peer's pool) it completes OK at once.
//      The Receive may be posted before or after the Write starts.
//   5. The writer reports the outcome to the receiver over the control plane
//      (PrefillDone). Only after a successful Write AND a successful Receive
//      may the receiver read the blocks, after calling FinishReceive() for
//      them (a no-op for every current backend, kept for future ones).
//
// Staging (UCX): a pool that the network cannot reach directly (a device pool
// when the UCX build lacks CUDA memory support, or any pool under staging
// mode "always") moves through a bounded set of bounce buffers per KvTransfer
// (KvStagingMode, `staging_bytes`), pipelined chunk by chunk. A pair is
// staged when either side needs it; both handshake blobs say so. stats()
// shows what the staging holds.
//
// Completion contract: every Write/Receive gets EXACTLY ONE call of `done`,
// with OK or an explicit failure: kInvalidArgument (bad or duplicate block id,
// unknown peer), kDeadlineExceeded, kUnavailable (peer gone, connection
// closed), kCancelled (the KvTransfer is being destroyed). `done` always runs
// on the backend's progress thread, never inside Write/Receive; it must not
// block for long and must not destroy the KvTransfer.
//
// A failed Write leaves the target blocks in an unspecified state, and the
// connection to that peer closed (later Writes to the same PeerId fail with
// kUnavailable; Connect again to retry), unless it was refused before any
// byte moved: invalid block ids (kInvalidArgument) or a deadline already past
// when the backend took it up ("submitted after its deadline"). After a deadline, bytes already on
// the wire may still land, so the receiver must treat those blocks as garbage
// until it hands them out again.
//
// Thread safety: every method may be called from any thread concurrently,
// except that the destructor must not race with other calls.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "common/kv_layout.h"
#include "common/status.h"

namespace pdserve {

using BlockId = uint32_t;
using PeerId = uint64_t;
using TransferClock = std::chrono::steady_clock;
using TransferDeadline = TransferClock::time_point;
using TransferCallback = std::function<void(Status)>;

// The KV pool: `bytes` from `base`, block i at base + i * block_bytes.
struct MemoryRegion {
  void* base = nullptr;
  size_t bytes = 0;
  size_t block_bytes = 0;
  MemoryType type = MemoryType::kHost;
  size_t block_count() const { return block_bytes == 0 ? 0 : bytes / block_bytes; }
};

// Copy local block `local` of this pool into block `remote` of the peer's.
struct BlockCopy {
  BlockId local = 0;
  BlockId remote = 0;
  friend bool operator==(const BlockCopy&, const BlockCopy&) = default;
};

// A maximal run of consecutive blocks on both sides: one network operation.
struct BlockRun {
  BlockId local = 0;
  BlockId remote = 0;
  uint32_t count = 0;
  friend bool operator==(const BlockRun&, const BlockRun&) = default;
};

// A piece of each block, for a pair whose pools hold other shards of the same
// blocks (tensor-parallel workers of different sizes, ranked_transfer.h):
// `bytes` at `local_offset` of a local block go to `remote_offset` of its
// remote block.
struct BlockSlice {
  uint64_t local_offset = 0;
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
  friend bool operator==(const BlockSlice&, const BlockSlice&) = default;
};

// How the UCX backend treats pools the network cannot reach directly.
//   kAuto:   stage device pools when UCX lacks CUDA memory support; put directly otherwise.
//   kAlways: stage every pool, host pools included (the device copy becomes a memcpy).
//   kNever:  no bounce buffers: a device pool UCX cannot map is refused, and so
//            is a peer that needs staging.
enum class KvStagingMode : uint8_t { kAuto = 0, kAlways = 1, kNever = 2 };

// What a KvTransfer holds right now (all zero when idle and nothing is
// staged), and one running count.
struct KvTransferStats {
  // Bounce-buffer memory allocated (stays allocated once a staged pair exists).
  size_t staging_bytes_reserved = 0;
  // Of that, bytes lent to transfers (0 once every transfer has completed and
  // the network has let go of its buffers).
  size_t staging_bytes_in_use = 0;
  // Writes and Receives whose `done` has not been called yet.
  size_t transfers_in_flight = 0;
  // Network writes issued since creation (UCX: puts and staged chunk sends):
  // what coalescing saves.
  uint64_t network_writes = 0;
};

// Merges pairs into maximal runs (local AND remote ids consecutive), ordered
// by local block. Fails (InvalidArgument) when a remote block is
// targeted twice or an id is out of range for either pool.
StatusOr<std::vector<BlockRun>> CoalesceBlockRuns(std::vector<BlockCopy> copies,
                                                  size_t local_blocks, size_t remote_blocks);

class KvTransfer {
 public:
  struct Connection {
    PeerId peer = 0;
    std::string reply;  // hand to the peer's Accept()
  };

  virtual ~KvTransfer() = default;

  // "ucx" or "nccl".
  virtual std::string_view backend() const = 0;

  // Registers the pool, once. The layout must validate and its
  // bytes_per_block must equal region.block_bytes.
  virtual Status RegisterPool(const MemoryRegion& region, const KvLayout& layout) = 0;

  // Allocates `blocks` blocks of layout.bytes_per_block and registers them, in
  // place of RegisterPool. UCX: host memory from UCX's allocator, which puts
  // it in shared-memory segments when shared-memory transports are enabled,
  // so that same-host peers write into it with a plain copy. NCCL: device
  // memory. The memory belongs to the KvTransfer and lives as long as it.
  virtual StatusOr<MemoryRegion> AllocatePool(size_t blocks, const KvLayout& layout) = 0;

  // This worker's descriptor (requires a pool), for one connecting peer:
  // NCCL bootstraps a pair's channel from it (single-use); UCX mints a
  // receive worker for the writers that answer it (a tensor-parallel
  // peer's ranks may share one), which goes once Disconnect has ended each.
  virtual StatusOr<std::string> ExportDescriptor() = 0;

  // Writer side of the handshake; see the top of this file.
  virtual StatusOr<Connection> Connect(std::string_view peer_descriptor) = 0;
  // Receiver side of the handshake.
  virtual StatusOr<PeerId> Accept(std::string_view reply) = 0;

  // Connect and Accept for a peer whose layout differs from this pool's in
  // the tensor-parallel split only (CheckLayoutsMatchExceptSplit): every
  // Write to it moves `slices` of each block (within both block sizes). UCX
  // gathers a chunk of blocks' slices into one message when both sides can
  // stage (two-sided: post the Receive), else puts each slice of each block;
  // NCCL gathers them into a device staging buffer. The default refuses
  // (Unsupported).
  virtual StatusOr<Connection> ConnectSlices(std::string_view peer_descriptor,
                                             std::vector<BlockSlice> slices);
  virtual StatusOr<PeerId> AcceptSlices(std::string_view reply);

  virtual void Write(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
                     TransferCallback done) = 0;
  virtual void Receive(PeerId peer, std::vector<BlockCopy> copies, TransferDeadline deadline,
                       TransferCallback done) = 0;

  // Receiver, after the writer reported success and Receive completed OK:
  // makes the blocks readable in the registered region. A no-op for every
  // current backend (staged pairs copy into the pool before Receive's `done`);
  // still validates the block ids.
  virtual Status FinishReceive(const std::vector<BlockId>& blocks) = 0;

  // Closes the connection; pending operations on it fail with kCancelled.
  virtual void Disconnect(PeerId peer) = 0;

  // Counters for tests and /metrics; safe from any thread, cheap.
  virtual KvTransferStats stats() const = 0;
};

}  // namespace pdserve
