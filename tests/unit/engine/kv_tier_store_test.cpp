// engine/kv_tier_store.h: blocks cascade host -> disk -> gone, LRU in each
// tier; a disk block comes back byte for byte; a torn or corrupted disk slot
// is never served (dropped, counted); reopening the folder rebuilds the disk
// index (a warm restart) and ignores a slab written by another layout.
#include "engine/kv_tier_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <random>

#include "tests/support/test_models.h"

namespace pdserve {
namespace {

constexpr int64_t kBlock = 3000;  // not a multiple of 4 KiB: slots get padded

std::vector<uint8_t> BlockBytes(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(kBlock);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

KvTierOptions Options(int64_t host_blocks, const std::string& dir, int64_t disk_blocks,
                      uint64_t layout = 0xabc) {
  KvTierOptions o;
  o.block_bytes = kBlock;
  o.layout_hash = layout;
  o.host_bytes = host_blocks * kBlock;
  o.disk_dir = dir;
  o.disk_bytes = disk_blocks * 4096;  // one slot of header + 3000 bytes each
  return o;
}

std::vector<BlockHash> Sorted(std::vector<BlockHash> v) {
  std::sort(v.begin(), v.end());
  return v;
}

TEST(KvTierStoreTest, BlocksCascadeHostThenDiskThenGoneInLruOrder) {
  const std::string dir = testing::NewTempDir("tiers-cascade");
  auto s = KvTierStore::Open(Options(2, dir, 3));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  KvTierStore& t = **s;
  std::vector<KvTierChange> changes;
  for (BlockHash h = 1; h <= 2; ++h) ASSERT_TRUE(t.Put(h, BlockBytes(h).data(), &changes).ok());
  EXPECT_EQ(Sorted(t.Blocks(KvTier::kHost)), (std::vector<BlockHash>{1, 2}));
  // Touch 1: block 2 is now the host tier's least recently used.
  std::vector<uint8_t> out(kBlock);
  ASSERT_TRUE(t.Get(1, out.data(), &changes).ok());
  changes.clear();
  ASSERT_TRUE(t.Put(3, BlockBytes(3).data(), &changes).ok());
  EXPECT_EQ(t.Find(2), KvTier::kDisk);
  EXPECT_EQ(t.Find(1), KvTier::kHost);
  EXPECT_EQ(t.Find(3), KvTier::kHost);
  ASSERT_EQ(changes.size(), 3u);  // 2 leaves the host, lands on disk, 3 stored
  EXPECT_EQ(changes[0].hash, 2u);
  EXPECT_FALSE(changes[0].stored);
  EXPECT_EQ(changes[1].tier, KvTier::kDisk);
  EXPECT_TRUE(changes[1].stored);
  EXPECT_EQ(changes[2].hash, 3u);
  // Blocks 4..6 push 1, 3 and then more down; the disk holds 3, oldest out first.
  for (BlockHash h = 4; h <= 7; ++h) ASSERT_TRUE(t.Put(h, BlockBytes(h).data(), &changes).ok());
  EXPECT_EQ(Sorted(t.Blocks(KvTier::kHost)), (std::vector<BlockHash>{6, 7}));
  EXPECT_EQ(Sorted(t.Blocks(KvTier::kDisk)), (std::vector<BlockHash>{3, 4, 5}));
  EXPECT_FALSE(t.Find(1).has_value());
  EXPECT_FALSE(t.Find(2).has_value());
  // Every block still held reads back as written.
  for (BlockHash h = 3; h <= 7; ++h) {
    ASSERT_TRUE(t.Get(h, out.data(), &changes).ok()) << h;
    EXPECT_EQ(out, BlockBytes(h)) << h;
  }
  EXPECT_EQ(t.Get(1, out.data(), &changes).code(), StatusCode::kNotFound);
  const KvTierStats st = t.stats();
  EXPECT_EQ(st.host.blocks, 2);
  EXPECT_EQ(st.disk.blocks, 3);
  EXPECT_EQ(st.disk.hits, 3);
  EXPECT_EQ(st.host.hits, 3);  // 1 once, then 6 and 7
}

TEST(KvTierStoreTest, ACorruptDiskBlockIsDroppedAndCounted) {
  const std::string dir = testing::NewTempDir("tiers-corrupt");
  auto s = KvTierStore::Open(Options(0, dir, 4));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::vector<KvTierChange> changes;
  for (BlockHash h = 10; h < 13; ++h)
    ASSERT_TRUE((*s)->Put(h, BlockBytes(h).data(), &changes).ok());
  // Flip a byte in the middle of every slot's payload (a torn write looks the same).
  const std::string slab = dir + "/kv-tier-0000000000000abc.slab";
  const int fd = ::open(slab.c_str(), O_RDWR);
  ASSERT_GE(fd, 0);
  uint8_t b;
  ASSERT_EQ(::pread(fd, &b, 1, 4096 + 64 + 1000), 1);
  b ^= 0x40;
  ASSERT_EQ(::pwrite(fd, &b, 1, 4096 + 64 + 1000), 1);
  ::close(fd);
  int served = 0, refused = 0;
  std::vector<uint8_t> out(kBlock);
  for (BlockHash h = 10; h < 13; ++h) {
    changes.clear();
    const Status st = (*s)->Get(h, out.data(), &changes);
    if (st.ok()) {
      EXPECT_EQ(out, BlockBytes(h));
      ++served;
    } else {
      EXPECT_EQ(st.code(), StatusCode::kNotFound);
      EXPECT_NE(st.message().find("checksum"), std::string::npos) << st.message();
      ASSERT_EQ(changes.size(), 1u);
      EXPECT_FALSE(changes[0].stored);
      EXPECT_EQ(changes[0].tier, KvTier::kDisk);
      EXPECT_FALSE((*s)->Find(h).has_value()) << "a corrupt block stays indexed";
      ++refused;
    }
  }
  EXPECT_EQ(served, 2);
  EXPECT_EQ(refused, 1);
  EXPECT_EQ((*s)->stats().corrupt_dropped, 1);
}

TEST(KvTierStoreTest, ReopeningRebuildsTheDiskIndexOfTheSameLayoutOnly) {
  const std::string dir = testing::NewTempDir("tiers-restart");
  {
    auto s = KvTierStore::Open(Options(1, dir, 8));
    ASSERT_TRUE(s.ok());
    std::vector<KvTierChange> changes;
    // 20 and 21 reach the disk (the host tier holds one), 22 stays in memory:
    // a restart keeps what was on disk only.
    for (BlockHash h = 20; h <= 22; ++h)
      ASSERT_TRUE((*s)->Put(h, BlockBytes(h).data(), &changes).ok());
    // 20 comes back into the host tier and goes down again: two disk copies
    // of it exist, the newer one is the one kept.
    std::vector<uint8_t> out(kBlock);
    ASSERT_TRUE((*s)->Put(20, BlockBytes(20).data(), &changes).ok());
    ASSERT_TRUE((*s)->Put(23, BlockBytes(23).data(), &changes).ok());
  }
  auto again = KvTierStore::Open(Options(1, dir, 8));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(Sorted((*again)->Blocks(KvTier::kDisk)), (std::vector<BlockHash>{20, 21, 22}));
  EXPECT_TRUE((*again)->Blocks(KvTier::kHost).empty());
  std::vector<uint8_t> out(kBlock);
  std::vector<KvTierChange> changes;
  for (BlockHash h = 20; h <= 22; ++h) {
    ASSERT_TRUE((*again)->Get(h, out.data(), &changes).ok()) << h;
    EXPECT_EQ(out, BlockBytes(h));
  }
  // Another layout (another model, KV dtype or block size) reads nothing.
  auto other = KvTierStore::Open(Options(1, dir, 8, /*layout=*/0xdef));
  ASSERT_TRUE(other.ok());
  EXPECT_TRUE((*other)->Blocks(KvTier::kDisk).empty());
}

TEST(KvTierStoreTest, OneProcessAtATimeOwnsADiskFolder) {
  const std::string dir = testing::NewTempDir("tiers-shared");
  {
    auto first = KvTierStore::Open(Options(0, dir, 4));
    ASSERT_TRUE(first.ok());
    auto second = KvTierStore::Open(Options(0, dir, 4));
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), StatusCode::kUnavailable);
    EXPECT_NE(second.status().message().find("in use by another process"), std::string::npos)
        << second.status().message();
  }
  // Released with its owner (a killed process releases it too).
  EXPECT_TRUE(KvTierStore::Open(Options(0, dir, 4)).ok());
}

TEST(KvTierStoreTest, RefusesSizesThatHoldNoBlock) {
  KvTierOptions o = Options(0, "", 0);
  o.host_bytes = kBlock - 1;
  EXPECT_EQ(KvTierStore::Open(o).status().code(), StatusCode::kInvalidArgument);
  o = Options(0, testing::NewTempDir("tiers-small"), 0);
  o.disk_bytes = 4095;
  EXPECT_EQ(KvTierStore::Open(o).status().code(), StatusCode::kInvalidArgument);
  o.block_bytes = 0;
  EXPECT_EQ(KvTierStore::Open(o).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve
