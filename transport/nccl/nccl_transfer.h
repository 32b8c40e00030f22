// NCCL backend of KvTransfer (CUDA builds only; see transport/kv_transfer.h).
//
// One communicator of two ranks per (writer, receiver) pair, created lazily
// on the pair's first transfer from an ncclUniqueId that travels in the
// handshake: every ExportDescriptor() call mints a fresh id (so a descriptor
// bootstraps exactly one pair), the writer's Connect() echoes it in its reply,
// and the writer becomes rank 0, the receiver rank 1.
//
// NCCL is two-sided: the receiver must call Receive() with the SAME pairs the
// writer passes to Write() (the Prefill message carries them). Both sides
// coalesce the pairs into the same runs (CoalesceBlockRuns) and issue one
// grouped ncclSend / ncclRecv per run on a dedicated stream. A transfer that
// misses its deadline, or a communicator that reports an asynchronous error
// (peer gone), aborts the communicator: the pair must handshake again.
//
// Sliced pairs (ConnectSlices, tensor-parallel workers of different sizes):
// the pair's slices travel in the writer's reply, checked against both block
// sizes on both sides (transport/detail/block_slices.h). Per chunk of at most
// `chunk blocks` blocks (runs packed in order, cut where a chunk is full; the
// writer picks the chunk so that it fits both sides' `staging_bytes`, at
// least one block) the writer gathers the blocks' slices into a device
// staging buffer with one cudaMemcpy2DAsync per slice and run piece, and
// ncclSend's it; the receiver ncclRecv's into its staging buffer and
// scatters it the same way; all on the transfer's stream, in order. One
// staging buffer per KvTransfer (one transfer runs at a time) of
// `staging_bytes` (more only where one block's slices are larger),
// allocated on the first sliced transfer and freed when the last sliced
// pair disconnects; stats() reports it. Equal splits move whole blocks pool
// to pool as above.
//
// Pools are device memory (MemoryType::kCuda) on `device`. Work runs on one
// thread per KvTransfer, which also runs the callbacks; a communicator's
// lazy creation blocks that thread until the peer joins (bounded by the
// transfer's deadline only once created: keep both sides' first transfers
// close in time).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/status.h"
#include "transport/kv_transfer.h"

namespace pdserve {

struct NcclTransferOptions {
  int device = 0;
  // Bound on a sliced pair's staging buffer (device memory), unless one
  // block's slices are larger.
  size_t staging_bytes = size_t{64} << 20;
};

StatusOr<std::unique_ptr<KvTransfer>> CreateNcclTransfer(const NcclTransferOptions& options);

}  // namespace pdserve
