// Slices of KV blocks (KvTransfer::ConnectSlices, tensor-parallel workers of
// different sizes): their wire form inside a backend's handshake channel, the
// checks every backend applies to them, and the staging plan of a backend
// that gathers a run of blocks' slices into one message (NCCL). Internal to
// transport/.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "common/byte_codec.h"
#include "common/status.h"
#include "transport/kv_transfer.h"

namespace pdserve::transport_detail {

// A block's slices are 2 (4 with scales) a layer at most; bounds what a peer
// may make us decode.
constexpr uint32_t kMaxBlockSlices = 1 << 16;

// u32 count | count x (u64 writer offset | u64 receiver offset | u64 bytes),
// the writer's view (local_offset: the writer's).
void EncodeBlockSlices(codec::ByteWriter& w, const std::vector<BlockSlice>& slices);
// Reads what EncodeBlockSlices wrote; a count above kMaxBlockSlices or a
// truncation is refused by name. Checks nothing else (CheckBlockSlices does).
Status DecodeBlockSlices(codec::ByteReader& r, std::vector<BlockSlice>* slices);

// OK when there is at least one slice, at most kMaxBlockSlices, and each is
// non-empty and lies inside the writer's block (local_offset, of
// `writer_block_bytes`) and the receiver's (remote_offset, of
// `receiver_block_bytes`), overflow included. Otherwise InvalidArgument
// starting with `who` and naming the slice: a peer's slice past a block must
// never become an out-of-bounds copy.
Status CheckBlockSlices(const std::vector<BlockSlice>& slices, uint64_t writer_block_bytes,
                        uint64_t receiver_block_bytes, std::string_view who);

// The same slices seen from the other side (offsets swapped).
std::vector<BlockSlice> OtherSide(const std::vector<BlockSlice>& slices);

// True for one slice that is a whole block of the same size on both sides
// (MLA's latent between splits): such a pair moves whole blocks.
bool IsWholeBlock(const std::vector<BlockSlice>& slices, uint64_t here, uint64_t there);

// The bytes of a block the slices move (their sum).
uint64_t SlicedBytes(const std::vector<BlockSlice>& slices);

// ---- Staging plan ------------------------------------------------------------

// `rows` rows of `width` bytes: row i at pool_offset + i * pool_pitch of a
// pool and at staging_offset + i * staging_pitch of a staging buffer (the
// shape of one cudaMemcpy2D).
struct StridedCopy {
  uint64_t pool_offset = 0;
  uint64_t pool_pitch = 0;
  uint64_t staging_offset = 0;
  uint64_t staging_pitch = 0;
  uint64_t width = 0;
  uint64_t rows = 0;
  friend bool operator==(const StridedCopy&, const StridedCopy&) = default;
};

// One message: the first `bytes` of the staging buffer, gathered from the
// pool by `copies` (writer) or scattered by them into it (receiver).
struct StagedChunk {
  uint64_t bytes = 0;
  std::vector<StridedCopy> copies;
};

// The messages that move `runs` (CoalesceBlockRuns' order) for a pair that
// moves `slices` of each block, this side's offsets as local_offset (both
// sides hold the same list, swapped). `writer`: the runs' local blocks are
// this side's pool, else their remote ones. A chunk holds at most
// `chunk_blocks` (>= 1) blocks, so the staging buffer needs chunk_blocks x
// SlicedBytes(slices) bytes; runs are packed into chunks in order and cut
// where a chunk is full. Within a chunk each piece of a run lies after the
// previous one, slice by slice: slice s of the piece's k blocks back to back
// (k rows, one copy, as a run's blocks sit at the fixed stride
// `block_bytes`). Both sides therefore plan the same chunk sizes in the
// same order, and each chunk byte comes from exactly one slice of one block.
// The slices must have passed CheckBlockSlices for `block_bytes`.
std::vector<StagedChunk> PlanSlicedChunks(const std::vector<BlockRun>& runs, bool writer,
                                          const std::vector<BlockSlice>& slices,
                                          uint64_t block_bytes, uint32_t chunk_blocks);

}  // namespace pdserve::transport_detail
