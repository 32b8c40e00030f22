#include "transport/detail/block_slices.h"

#include <algorithm>
#include <string>

namespace pdserve::transport_detail {

void EncodeBlockSlices(codec::ByteWriter& w, const std::vector<BlockSlice>& slices) {
  w.U32(static_cast<uint32_t>(slices.size()));
  for (const BlockSlice& sl : slices) {
    w.U64(sl.local_offset);
    w.U64(sl.remote_offset);
    w.U64(sl.bytes);
  }
}

Status DecodeBlockSlices(codec::ByteReader& r, std::vector<BlockSlice>* slices) {
  uint32_t count = 0;
  PDSERVE_RETURN_IF_ERROR(r.U32("slices", &count));
  if (count > kMaxBlockSlices) {
    return r.Error(std::to_string(count) + " block slices (at most " +
                   std::to_string(kMaxBlockSlices) + ")");
  }
  slices->assign(count, BlockSlice{});
  for (BlockSlice& sl : *slices) {
    PDSERVE_RETURN_IF_ERROR(r.U64("slice writer offset", &sl.local_offset));
    PDSERVE_RETURN_IF_ERROR(r.U64("slice receiver offset", &sl.remote_offset));
    PDSERVE_RETURN_IF_ERROR(r.U64("slice bytes", &sl.bytes));
  }
  return Status::Ok();
}

Status CheckBlockSlices(const std::vector<BlockSlice>& slices, uint64_t writer_block_bytes,
                        uint64_t receiver_block_bytes, std::string_view who) {
  if (slices.empty()) return Status::InvalidArgument(std::string(who) + ": no block slice");
  if (slices.size() > kMaxBlockSlices) {
    return Status::InvalidArgument(std::string(who) + ": " + std::to_string(slices.size()) +
                                   " block slices (at most " + std::to_string(kMaxBlockSlices) +
                                   ")");
  }
  // offset + bytes <= size, written so that a huge offset cannot wrap around.
  auto inside = [](uint64_t offset, uint64_t bytes, uint64_t size) {
    return bytes <= size && offset <= size - bytes;
  };
  for (size_t i = 0; i < slices.size(); ++i) {
    const BlockSlice& sl = slices[i];
    if (sl.bytes == 0 || !inside(sl.local_offset, sl.bytes, writer_block_bytes) ||
        !inside(sl.remote_offset, sl.bytes, receiver_block_bytes)) {
      return Status::InvalidArgument(
          std::string(who) + ": block slice " + std::to_string(i) + " (" +
          std::to_string(sl.bytes) + " bytes at writer offset " + std::to_string(sl.local_offset) +
          " -> receiver offset " + std::to_string(sl.remote_offset) +
          ") does not fit the writer's blocks of " + std::to_string(writer_block_bytes) +
          " bytes and the receiver's of " + std::to_string(receiver_block_bytes));
    }
  }
  return Status::Ok();
}

std::vector<BlockSlice> OtherSide(const std::vector<BlockSlice>& slices) {
  std::vector<BlockSlice> out;
  out.reserve(slices.size());
  for (const BlockSlice& sl : slices) out.push_back({sl.remote_offset, sl.local_offset, sl.bytes});
  return out;
}

bool IsWholeBlock(const std::vector<BlockSlice>& slices, uint64_t here, uint64_t there) {
  return slices.size() == 1 && here == there && slices[0] == BlockSlice{0, 0, here};
}

uint64_t SlicedBytes(const std::vector<BlockSlice>& slices) {
  uint64_t sum = 0;
  for (const BlockSlice& sl : slices) sum += sl.bytes;
  return sum;
}

std::vector<StagedChunk> PlanSlicedChunks(const std::vector<BlockRun>& runs, bool writer,
                                          const std::vector<BlockSlice>& slices,
                                          uint64_t block_bytes, uint32_t chunk_blocks) {
  const uint64_t unit = SlicedBytes(slices);
  chunk_blocks = std::max<uint32_t>(chunk_blocks, 1);
  std::vector<StagedChunk> chunks;
  uint32_t in_chunk = 0;  // blocks already in chunks.back()
  for (const BlockRun& run : runs) {
    const uint64_t first = writer ? run.local : run.remote;
    for (uint32_t done = 0; done < run.count;) {
      if (chunks.empty() || in_chunk == chunk_blocks) {
        chunks.emplace_back();
        in_chunk = 0;
      }
      StagedChunk& chunk = chunks.back();
      const uint32_t k = std::min(run.count - done, chunk_blocks - in_chunk);
      const uint64_t block = first + done;
      uint64_t at = chunk.bytes;  // slice s of the piece's k blocks, back to back
      for (const BlockSlice& sl : slices) {
        chunk.copies.push_back(
            {block * block_bytes + sl.local_offset, block_bytes, at, sl.bytes, sl.bytes, k});
        at += k * sl.bytes;
      }
      chunk.bytes += k * unit;
      in_chunk += k;
      done += k;
    }
  }
  return chunks;
}

}  // namespace pdserve::transport_detail
