// Block-run coalescing (against a brute-force expansion) and the descriptor
// wire format: round trip, every truncation and every corrupted byte rejected.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>

#include "transport/detail/descriptor.h"
#include "transport/kv_transfer.h"

namespace pdserve {
namespace {

using transport_detail::BackendCode;
using transport_detail::DecodeDescriptor;
using transport_detail::DescriptorKind;
using transport_detail::EncodeDescriptor;
using transport_detail::WireDescriptor;

TEST(CoalesceBlockRunsTest, MergesOnlyRunsContiguousOnBothSides) {
  auto runs = CoalesceBlockRuns({{5, 10}, {3, 8}, {4, 9}, {7, 12}, {8, 2}}, 16, 16);
  ASSERT_TRUE(runs.ok()) << runs.status().ToString();
  std::vector<BlockRun> expected = {{3, 8, 3}, {7, 12, 1}, {8, 2, 1}};
  EXPECT_EQ(*runs, expected);
}

TEST(CoalesceBlockRunsTest, RandomListsExpandBackToTheSamePairsAndRunsAreMaximal) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t local_blocks = 1 + rng() % 300, remote_blocks = 1 + rng() % 300;
    std::vector<BlockId> remotes(remote_blocks);
    std::iota(remotes.begin(), remotes.end(), 0);
    std::shuffle(remotes.begin(), remotes.end(), rng);
    const size_t n = rng() % (std::min(local_blocks, remote_blocks) + 1);
    std::vector<BlockCopy> copies;
    // Half the trials use long contiguous stretches, as prefill writes do.
    BlockId start_local = rng() % local_blocks, start_remote = rng() % remote_blocks;
    for (size_t i = 0; i < n; ++i) {
      if (trial % 2 == 0 && start_local + i < local_blocks && start_remote + i < remote_blocks) {
        copies.push_back(
            {static_cast<BlockId>(start_local + i), static_cast<BlockId>(start_remote + i)});
      } else {
        copies.push_back({static_cast<BlockId>(rng() % local_blocks), remotes[i]});
      }
    }
    // Targets must be distinct: keep the first use of each remote block.
    std::set<BlockId> seen;
    std::vector<BlockCopy> unique;
    for (const auto& c : copies) {
      if (seen.insert(c.remote).second) unique.push_back(c);
    }
    auto runs = CoalesceBlockRuns(unique, local_blocks, remote_blocks);
    ASSERT_TRUE(runs.ok()) << runs.status().ToString();
    std::multiset<std::pair<BlockId, BlockId>> want, got;
    for (const auto& c : unique) want.insert({c.local, c.remote});
    for (const auto& r : *runs) {
      ASSERT_GT(r.count, 0u);
      for (uint32_t k = 0; k < r.count; ++k) got.insert({r.local + k, r.remote + k});
    }
    EXPECT_EQ(got, want);
    // Maximal: no run continues exactly where another (on both sides) ends.
    std::set<std::pair<BlockId, BlockId>> starts;
    for (const auto& r : *runs) starts.insert({r.local, r.remote});
    for (const auto& r : *runs) {
      EXPECT_EQ(starts.count({r.local + r.count, r.remote + r.count}), 0u);
    }
  }
}

TEST(CoalesceBlockRunsTest, RejectsOutOfRangeAndDuplicateTargets) {
  auto a = CoalesceBlockRuns({{0, 0}, {16, 1}}, 16, 16);
  ASSERT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("local block 16 is out of range"), std::string::npos);
  auto b = CoalesceBlockRuns({{0, 4}}, 16, 4);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("remote block 4 is out of range"), std::string::npos);
  auto c = CoalesceBlockRuns({{0, 3}, {1, 3}}, 16, 16);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("targeted more than once"), std::string::npos);
  auto empty = CoalesceBlockRuns({}, 16, 16);
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
}

WireDescriptor Sample() {
  WireDescriptor d;
  d.kind = DescriptorKind::kDescriptor;
  d.backend = BackendCode::kUcx;
  d.instance_id = 0x0123456789abcdefULL;
  d.layout.model_id = "tiny";
  d.layout.layers = 2;
  d.layout.kv_heads = 2;
  d.layout.head_dim = 8;
  d.layout.block_tokens = 4;
  d.layout.bytes_per_block = d.layout.DenseBytesPerBlock();
  d.base = 0x7f0000001000ULL;
  d.block_bytes = d.layout.bytes_per_block;
  d.bytes = 100 * d.block_bytes;
  d.address = std::string("\x01\x02worker-address\x00\xff", 18);
  d.rkey = "packed-remote-key";
  return d;
}

TEST(DescriptorTest, RoundTrips) {
  const WireDescriptor d = Sample();
  auto back = DecodeDescriptor(EncodeDescriptor(d), DescriptorKind::kDescriptor, BackendCode::kUcx);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->instance_id, d.instance_id);
  EXPECT_EQ(back->base, d.base);
  EXPECT_EQ(back->bytes, d.bytes);
  EXPECT_EQ(back->block_count(), 100u);
  EXPECT_EQ(back->layout, d.layout);
  EXPECT_EQ(back->address, d.address);
  EXPECT_EQ(back->rkey, d.rkey);
}

TEST(DescriptorTest, EveryTruncationAndEveryCorruptedByteIsRejected) {
  const std::string blob = EncodeDescriptor(Sample());
  for (size_t n = 0; n < blob.size(); ++n) {
    auto r = DecodeDescriptor(blob.substr(0, n), DescriptorKind::kDescriptor, BackendCode::kUcx);
    ASSERT_FALSE(r.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  }
  for (size_t i = 0; i < blob.size(); ++i) {
    for (uint8_t flip : {0x01, 0x80}) {
      std::string bad = blob;
      bad[i] = static_cast<char>(bad[i] ^ flip);
      auto r = DecodeDescriptor(bad, DescriptorKind::kDescriptor, BackendCode::kUcx);
      ASSERT_FALSE(r.ok()) << "flip of byte " << i << " accepted";
    }
  }
  auto garbage = DecodeDescriptor("hello world, not a descriptor", DescriptorKind::kDescriptor,
                                  BackendCode::kUcx);
  ASSERT_FALSE(garbage.ok());
  EXPECT_NE(garbage.status().message().find("bad magic"), std::string::npos);
  std::string corrupted = blob;
  corrupted[40] ^= 0x10;
  auto c = DecodeDescriptor(corrupted, DescriptorKind::kDescriptor, BackendCode::kUcx);
  EXPECT_NE(c.status().message().find("checksum mismatch"), std::string::npos)
      << c.status().message();
}

TEST(DescriptorTest, WrongKindBackendOrRegionIsRefusedByName) {
  const std::string blob = EncodeDescriptor(Sample());
  auto kind = DecodeDescriptor(blob, DescriptorKind::kReply, BackendCode::kUcx);
  ASSERT_FALSE(kind.ok());
  EXPECT_NE(kind.status().message().find("where a handshake reply was expected"), std::string::npos)
      << kind.status().message();
  auto backend = DecodeDescriptor(blob, DescriptorKind::kDescriptor, BackendCode::kNccl);
  ASSERT_FALSE(backend.ok());
  EXPECT_NE(backend.status().message().find("peer uses the ucx backend"), std::string::npos);

  WireDescriptor d = Sample();
  d.block_bytes += 1;
  auto region =
      DecodeDescriptor(EncodeDescriptor(d), DescriptorKind::kDescriptor, BackendCode::kUcx);
  ASSERT_FALSE(region.ok());
  EXPECT_NE(region.status().message().find("bytes_per_block"), std::string::npos);
}

}  // namespace
}  // namespace pdserve
