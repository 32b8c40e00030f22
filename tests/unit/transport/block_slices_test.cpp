// The slices of KV blocks that a pair of tensor-parallel workers of different
// sizes moves (transport/detail/block_slices.h): the staging plan that the
// NCCL backend gathers and scatters by, run on host memory against a naive
// copy of each slice of each block, for every split of 1, 2, 4 and 8 KV
// heads over 1, 2, 4 and 8 ranks, fp16, fp8 and nvfp4 blocks, random pools,
// block lists and chunk sizes; and the checks that refuse a hostile peer's
// slices and their wire form.
#include "transport/detail/block_slices.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "kernels/kv_cache_layout.h"
#include "tests/support/transfer_pair.h"
#include "transport/ranked_transfer.h"

namespace pdserve::transport_detail {
namespace {

using testing::Pool;

// A rank's pool shard of `heads` KV heads, as the engine lays it out.
kernels::KvCacheLayout Shard(int64_t layers, int64_t heads, int64_t head_dim, int64_t tokens,
                             DType dtype) {
  kernels::KvCacheLayout k;
  k.num_layers = layers;
  k.num_kv_heads = heads;
  k.head_dim = head_dim;
  k.block_size = tokens;
  k.dtype = dtype;
  return k;
}

// Heads [lo, hi) from a shard holding `from` to one holding `to`: per layer
// and head its K, V and (scaled types) K and V scales, one slice each, built
// from the engine's offsets; `merge` joins slices contiguous on both sides.
std::vector<BlockSlice> PairSlices(const kernels::KvCacheLayout& ws, HeadRange from,
                                   const kernels::KvCacheLayout& rs, HeadRange to, int64_t lo,
                                   int64_t hi, bool merge) {
  std::vector<BlockSlice> out;
  auto add = [&](int64_t w, int64_t r, int64_t bytes) {
    BlockSlice s{static_cast<uint64_t>(w), static_cast<uint64_t>(r), static_cast<uint64_t>(bytes)};
    if (merge && !out.empty() && out.back().local_offset + out.back().bytes == s.local_offset &&
        out.back().remote_offset + out.back().bytes == s.remote_offset) {
      out.back().bytes += s.bytes;
    } else {
      out.push_back(s);
    }
  };
  for (int64_t l = 0; l < ws.num_layers; ++l) {
    for (int64_t h = lo; h < hi; ++h) {
      add(ws.k_offset(0, l, h - from.first), rs.k_offset(0, l, h - to.first), ws.head_bytes());
    }
    for (int64_t h = lo; h < hi; ++h) {
      add(ws.v_offset(0, l, h - from.first), rs.v_offset(0, l, h - to.first), ws.head_bytes());
    }
    if (!ws.has_scales()) continue;
    for (int64_t h = lo; h < hi; ++h) {
      add(ws.k_scale_offset(0, l, h - from.first), rs.k_scale_offset(0, l, h - to.first), 4);
    }
    for (int64_t h = lo; h < hi; ++h) {
      add(ws.v_scale_offset(0, l, h - from.first), rs.v_scale_offset(0, l, h - to.first), 4);
    }
  }
  return out;
}

// Random copies into distinct receiver blocks, some of them in runs.
std::vector<BlockCopy> RandomCopies(size_t writer_blocks, size_t receiver_blocks,
                                    std::mt19937& rng) {
  std::vector<BlockId> targets(receiver_blocks);
  std::iota(targets.begin(), targets.end(), 0);
  std::shuffle(targets.begin(), targets.end(), rng);
  std::vector<BlockCopy> copies;
  std::vector<bool> used(receiver_blocks, false);
  const size_t n = 1 + rng() % receiver_blocks;
  for (size_t i = 0; i < n && copies.size() < receiver_blocks; ++i) {
    // A run of up to 6 blocks starting at a random pair, where both fit.
    const BlockId local = static_cast<BlockId>(rng() % writer_blocks);
    const BlockId remote = targets[i];
    const uint32_t len = 1 + rng() % 6;
    for (uint32_t k = 0; k < len; ++k) {
      if (local + k >= writer_blocks || remote + k >= receiver_blocks || used[remote + k]) break;
      used[remote + k] = true;
      copies.push_back({local + k, remote + k});
    }
  }
  std::shuffle(copies.begin(), copies.end(), rng);
  return copies;
}

// Runs one pair's transfer through the plan on host memory (gather on the
// writer, the chunks handed over whole, scatter on the receiver) and checks
// it against a copy of each slice of each block.
void CheckPlan(const std::vector<BlockSlice>& slices, uint64_t wbb, uint64_t rbb,
               std::mt19937& rng) {
  ASSERT_TRUE(CheckBlockSlices(slices, wbb, rbb, "test").ok());
  const size_t wblocks = 1 + rng() % 40, rblocks = 1 + rng() % 40;
  Pool writer(wblocks, wbb, rng()), receiver(rblocks, rbb, rng());
  const std::vector<BlockCopy> copies = RandomCopies(wblocks, rblocks, rng);
  const uint32_t chunk_blocks = rng() % 4 == 0 ? 1000 : 1 + rng() % 7;
  SCOPED_TRACE(std::to_string(slices.size()) + " slices, blocks of " + std::to_string(wbb) +
               " -> " + std::to_string(rbb) + ", " + std::to_string(copies.size()) +
               " copies, chunks of " + std::to_string(chunk_blocks));

  std::vector<uint8_t> expected = receiver.bytes;
  for (const BlockCopy& c : copies) {
    for (const BlockSlice& sl : slices) {
      std::memcpy(&expected[c.remote * rbb + sl.remote_offset],
                  &writer.bytes[c.local * wbb + sl.local_offset], sl.bytes);
    }
  }

  auto wruns = CoalesceBlockRuns(copies, wblocks, rblocks);
  auto rruns = CoalesceBlockRuns(copies, wblocks, rblocks);
  ASSERT_TRUE(wruns.ok() && rruns.ok());
  const auto wplan = PlanSlicedChunks(*wruns, true, slices, wbb, chunk_blocks);
  const auto rplan = PlanSlicedChunks(*rruns, false, OtherSide(slices), rbb, chunk_blocks);
  ASSERT_EQ(wplan.size(), rplan.size());
  const uint64_t unit = SlicedBytes(slices);
  EXPECT_EQ(wplan.size(), (copies.size() + chunk_blocks - 1) / chunk_blocks);
  uint64_t total = 0;
  for (size_t i = 0; i < wplan.size(); ++i) {
    ASSERT_EQ(wplan[i].bytes, rplan[i].bytes) << "chunk " << i;
    ASSERT_LE(wplan[i].bytes, uint64_t{chunk_blocks} * unit) << "chunk " << i;
    ASSERT_EQ(wplan[i].bytes % unit, 0u);
    total += wplan[i].bytes;
    // Gather: every staging byte written exactly once, every read inside the pool.
    std::vector<uint8_t> staging(wplan[i].bytes);
    std::vector<int> writes(wplan[i].bytes, 0);
    for (const StridedCopy& c : wplan[i].copies) {
      for (uint64_t row = 0; row < c.rows; ++row) {
        const uint64_t at = c.staging_offset + row * c.staging_pitch;
        const uint64_t from = c.pool_offset + row * c.pool_pitch;
        ASSERT_LE(at + c.width, staging.size());
        ASSERT_LE(from + c.width, writer.bytes.size());
        std::memcpy(&staging[at], &writer.bytes[from], c.width);
        for (uint64_t b = 0; b < c.width; ++b) ++writes[at + b];
      }
    }
    ASSERT_TRUE(std::all_of(writes.begin(), writes.end(), [](int n) { return n == 1; }))
        << "chunk " << i << " has staging bytes written other than once";
    // Scatter on the receiver.
    for (const StridedCopy& c : rplan[i].copies) {
      for (uint64_t row = 0; row < c.rows; ++row) {
        const uint64_t at = c.staging_offset + row * c.staging_pitch;
        const uint64_t to = c.pool_offset + row * c.pool_pitch;
        ASSERT_LE(at + c.width, staging.size());
        ASSERT_LE(to + c.width, receiver.bytes.size());
        std::memcpy(&receiver.bytes[to], &staging[at], c.width);
      }
    }
  }
  EXPECT_EQ(total, copies.size() * unit);
  for (size_t b = 0; b < rblocks; ++b) {
    ASSERT_EQ(std::memcmp(receiver.block(b), &expected[b * rbb], rbb), 0) << "receiver block " << b;
  }
}

TEST(BlockSlicesTest, PlanMovesWhatACopyOfEachSliceOfEachBlockMoves) {
  std::mt19937 rng(31);
  int pairs = 0;
  for (DType dtype : {DType::kF16, DType::kFP8E4M3, DType::kNvFp4}) {
    for (int64_t heads : {1, 2, 4, 8}) {
      for (int a : {1, 2, 4, 8}) {
        for (int b : {1, 2, 4, 8}) {
          if (a == b) continue;  // equal splits move whole blocks
          const int64_t layers = 1 + rng() % 3, tokens = 1 + rng() % 5;
          const int64_t head_dim = 16 * (1 + rng() % 3);
          SCOPED_TRACE(std::string(DTypeName(dtype)) + ", " + std::to_string(heads) +
                       " heads, TP " + std::to_string(a) + " -> " + std::to_string(b) + ", " +
                       std::to_string(layers) + " layers");
          // Every receiving rank takes each head from the first writing rank
          // holding it (transport/ranked_transfer.h).
          for (int d = 0; d < b; ++d) {
            const HeadRange to = KvHeadRange(heads, b, d);
            const auto rs = Shard(layers, to.count, head_dim, tokens, dtype);
            int64_t next = to.first;
            for (int s = 0; s < a && next < to.first + to.count; ++s) {
              const HeadRange from = KvHeadRange(heads, a, s);
              const int64_t lo = std::max(next, from.first);
              const int64_t hi = std::min(to.first + to.count, from.first + from.count);
              if (lo >= hi) continue;
              next = hi;
              const auto ws = Shard(layers, from.count, head_dim, tokens, dtype);
              const auto slices = PairSlices(ws, from, rs, to, lo, hi, rng() % 2 == 0);
              CheckPlan(slices, ws.bytes_per_block(), rs.bytes_per_block(), rng);
              ++pairs;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(pairs, 300);
}

TEST(BlockSlicesTest, RandomSlicesOfRandomBlocks) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const uint64_t wbb = 1 + rng() % 300, rbb = 1 + rng() % 300;
    std::vector<BlockSlice> slices(1 + rng() % 6);
    for (BlockSlice& sl : slices) {
      sl.bytes = 1 + rng() % std::min(wbb, rbb);
      sl.local_offset = rng() % (wbb - sl.bytes + 1);
      sl.remote_offset = rng() % (rbb - sl.bytes + 1);
    }
    CheckPlan(slices, wbb, rbb, rng);
  }
}

TEST(BlockSlicesTest, ChunksCutRunsAndPackThemInOrder) {
  // Runs of 5 and 2 blocks, slices of 3 and 1 bytes of a 10-byte block,
  // chunks of 4 blocks: [run 0 blocks 0-3], [run 0 block 4, run 1 blocks 0-1].
  const std::vector<BlockRun> runs = {{10, 0, 5}, {20, 7, 2}};
  const std::vector<BlockSlice> slices = {{2, 0, 3}, {8, 5, 1}};
  const auto plan = PlanSlicedChunks(runs, true, slices, 10, 4);
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(plan[0].bytes, 16u);
  EXPECT_EQ(plan[0].copies,
            (std::vector<StridedCopy>{{102, 10, 0, 3, 3, 4}, {108, 10, 12, 1, 1, 4}}));
  EXPECT_EQ(plan[1].bytes, 12u);
  EXPECT_EQ(plan[1].copies, (std::vector<StridedCopy>{{142, 10, 0, 3, 3, 1},
                                                      {148, 10, 3, 1, 1, 1},
                                                      {202, 10, 4, 3, 3, 2},
                                                      {208, 10, 10, 1, 1, 2}}));
  // The receiver's side of the same runs uses the remote blocks.
  const auto theirs = PlanSlicedChunks(runs, false, OtherSide(slices), 6, 4);
  ASSERT_EQ(theirs.size(), 2u);
  EXPECT_EQ(theirs[1].copies[2], (StridedCopy{42, 6, 4, 3, 3, 2}));
  EXPECT_TRUE(PlanSlicedChunks({}, true, slices, 10, 4).empty());
}

TEST(BlockSlicesTest, HostileSlicesAreRefusedByName) {
  const uint64_t w = 100, r = 60;
  EXPECT_TRUE(CheckBlockSlices({{0, 0, 60}, {90, 50, 10}}, w, r, "peer").ok());
  struct Case {
    std::vector<BlockSlice> slices;
    std::string says;
  };
  const uint64_t huge = std::numeric_limits<uint64_t>::max();
  const std::vector<Case> cases = {
      {{}, "peer: no block slice"},
      {{{0, 0, 0}}, "block slice 0 (0 bytes"},
      {{{0, 0, 10}, {95, 0, 10}},
       "block slice 1 (10 bytes at writer offset 95 -> receiver "
       "offset 0) does not fit the writer's blocks of 100 bytes and "
       "the receiver's of 60"},
      {{{0, 55, 10}}, "block slice 0 (10 bytes at writer offset 0 -> receiver offset 55)"},
      {{{0, 0, 61}}, "block slice 0 (61 bytes"},
      // offset + bytes wraps around to a small number: still refused.
      {{{huge, 0, 2}}, "block slice 0 (2 bytes at writer offset " + std::to_string(huge)},
      {{{0, huge - 5, 10}}, "block slice 0 (10 bytes"},
      {{{0, 0, huge}}, "block slice 0 (" + std::to_string(huge) + " bytes"},
  };
  for (const Case& c : cases) {
    Status s = CheckBlockSlices(c.slices, w, r, "peer");
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << c.says;
    EXPECT_NE(s.message().find(c.says), std::string::npos) << s.message();
  }
  std::vector<BlockSlice> many(kMaxBlockSlices + 1, BlockSlice{0, 0, 1});
  EXPECT_NE(CheckBlockSlices(many, w, r, "peer").message().find("65537 block slices"),
            std::string::npos);
}

TEST(BlockSlicesTest, WireFormRoundTripsAndRefusesHostileCounts) {
  const std::vector<BlockSlice> slices = {{1, 2, 3}, {uint64_t{1} << 40, 5, 6}};
  codec::ByteWriter w;
  EncodeBlockSlices(w, slices);
  const std::string bytes = w.Take();
  EXPECT_EQ(bytes.size(), 4u + 2 * 24);
  codec::ByteReader r(bytes, "slices");
  std::vector<BlockSlice> back;
  ASSERT_TRUE(DecodeBlockSlices(r, &back).ok());
  EXPECT_EQ(back, slices);
  EXPECT_EQ(r.remaining(), 0u);

  codec::ByteReader cut(std::string_view(bytes).substr(0, bytes.size() - 1), "slices");
  Status s = DecodeBlockSlices(cut, &back);
  EXPECT_NE(s.message().find("truncated at slice bytes"), std::string::npos) << s.message();

  codec::ByteWriter big;
  big.U32(kMaxBlockSlices + 1);  // refused before reading (or allocating) them
  codec::ByteReader rb(big.data(), "slices");
  s = DecodeBlockSlices(rb, &back);
  EXPECT_NE(s.message().find("65537 block slices"), std::string::npos) << s.message();

  EXPECT_EQ(OtherSide(slices)[1], (BlockSlice{5, uint64_t{1} << 40, 6}));
  EXPECT_TRUE(IsWholeBlock({{0, 0, 64}}, 64, 64));
  EXPECT_FALSE(IsWholeBlock({{0, 0, 64}}, 64, 128));
  EXPECT_FALSE(IsWholeBlock({{0, 0, 32}, {32, 32, 32}}, 64, 64));
}

}  // namespace
}  // namespace pdserve::transport_detail
