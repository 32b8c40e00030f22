// engine/kv_tier_store.h: blocks cascade host -> disk -> gone, LRU in each
// tier; a disk block comes back byte for byte; a torn or corrupted disk slot
// is never served (dropped, counted); reopening the folder rebuilds the disk
// index (a warm restart) and discards a slab written by another layout or
// model. Write-through copies host blocks to disk as they arrive (a store
// dropped without a flush, as in a crash, keeps them), within its queue's
// bound; write-back's flush writes the host tier's most recent blocks. The
// slab is refused when it is a symbolic link, has other hard links or
// another owner; a slab the file system has no room for is refused at
// open; a write cut short by a full file system reports its real error.
#include "engine/kv_tier_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "tests/support/file_size_limit.h"
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
                      uint64_t layout = 0xabc, KvDiskWrite write = KvDiskWrite::kThrough) {
  KvTierOptions o;
  o.block_bytes = kBlock;
  o.layout_hash = layout;
  o.host_bytes = host_blocks * kBlock;
  o.disk_dir = dir;
  o.disk_bytes = disk_blocks * 4096;  // one slot of header + 3000 bytes each
  o.disk_write = write;
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
  const std::string slab = dir + "/kv-tier.slab";
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
  // Reopened, the dropped slot is not indexed (and announced) again.
  s->reset();
  auto reopened = KvTierStore::Open(Options(0, dir, 4));
  ASSERT_TRUE(reopened.ok()) << reopened.status().ToString();
  EXPECT_EQ((*reopened)->Blocks(KvTier::kDisk).size(), 2u);
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
  EXPECT_EQ((*again)->stats().discarded_at_open, 0);
  again->reset();  // releases the slab
  // Another layout (another model, its weights, KV dtype or scales, block
  // size) reads nothing: it discards the slab's blocks and counts them.
  {
    auto other = KvTierStore::Open(Options(1, dir, 8, /*layout=*/0xdef));
    ASSERT_TRUE(other.ok()) << other.status().ToString();
    EXPECT_TRUE((*other)->Blocks(KvTier::kDisk).empty());
    EXPECT_EQ((*other)->stats().discarded_at_open, 3);
  }
  // Discarded for good: the first layout finds nothing either, and nothing
  // is left to discard.
  auto back = KvTierStore::Open(Options(1, dir, 8));
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE((*back)->Blocks(KvTier::kDisk).empty());
  EXPECT_EQ((*back)->stats().discarded_at_open, 0);
}

// A slab written under a layout in `reslice_from` (another tensor-parallel
// size) is converted in place at Open: its blocks are found under their
// hashes, read back converted (here: every byte reversed), and a later
// Open finds them in this layout without converting again. A slot whose payload checksum fails is
// not converted but discarded; one of a layout in no list is discarded as before.
TEST(KvTierStoreTest, ASlabOfAnotherSplitIsReslicedInPlaceAtOpen) {
  const std::string dir = testing::NewTempDir("tiers-reslice");
  {
    auto s = KvTierStore::Open(Options(0, dir, 8, /*layout=*/0x222));
    ASSERT_TRUE(s.ok());
    std::vector<KvTierChange> changes;
    for (BlockHash h = 30; h <= 33; ++h)
      ASSERT_TRUE((*s)->Put(h, BlockBytes(h).data(), &changes).ok());
  }
  {
    // Block 33's slot torn: its payload's checksum fails (the header's
    // block hash is at byte 24 of its header).
    const int fd = ::open((dir + "/kv-tier.slab").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    bool torn = false;
    for (off_t slot = 0; slot < 8 && !torn; ++slot) {
      uint64_t hash = 0;
      ASSERT_EQ(::pread(fd, &hash, 8, slot * 4096 + 24), 8);
      if (hash != 33) continue;
      const uint8_t junk[16] = {1, 2, 3};
      ASSERT_EQ(::pwrite(fd, junk, sizeof(junk), slot * 4096 + 64 + 100), 16);
      torn = true;
    }
    ::close(fd);
    ASSERT_TRUE(torn);
  }
  auto reversed = [](const uint8_t* from, uint8_t* to) {
    std::reverse_copy(from, from + kBlock, to);
  };
  KvTierOptions o = Options(0, dir, 8, /*layout=*/0x111);
  o.reslice_from.push_back({0x333, kBlock, "tensor-parallel size 3", reversed});
  o.reslice_from.push_back({0x222, kBlock, "tensor-parallel size 2", reversed});
  {
    auto s = KvTierStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    EXPECT_EQ((*s)->stats().resliced_at_open, 3);
    EXPECT_EQ((*s)->stats().discarded_at_open, 1);
    EXPECT_EQ(Sorted((*s)->Blocks(KvTier::kDisk)), (std::vector<BlockHash>{30, 31, 32}));
    std::vector<uint8_t> out(kBlock);
    std::vector<KvTierChange> changes;
    for (BlockHash h = 30; h <= 32; ++h) {
      ASSERT_TRUE((*s)->Get(h, out.data(), &changes).ok()) << h;
      std::vector<uint8_t> want = BlockBytes(h);
      std::reverse(want.begin(), want.end());
      EXPECT_EQ(out, want) << h;
    }
  }
  auto again = KvTierStore::Open(o);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->stats().resliced_at_open, 0);
  EXPECT_EQ(Sorted((*again)->Blocks(KvTier::kDisk)), (std::vector<BlockHash>{30, 31, 32}));
  again->reset();
  // A payload of another size than the listed layout's is not converted.
  KvTierOptions wrong = Options(0, dir, 8, /*layout=*/0x444);
  wrong.reslice_from.push_back({0x111, kBlock - 4, "tensor-parallel size 1", reversed});
  auto other = KvTierStore::Open(wrong);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ((*other)->stats().resliced_at_open, 0);
  EXPECT_EQ((*other)->stats().discarded_at_open, 3);
  EXPECT_TRUE((*other)->Blocks(KvTier::kDisk).empty());
}

TEST(KvTierStoreTest, WriteThroughCopiesHostBlocksToDiskAndACrashKeepsThem) {
  const std::string dir = testing::NewTempDir("tiers-through");
  {
    auto s = KvTierStore::Open(Options(4, dir, 8));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    KvTierStore& t = **s;
    ASSERT_TRUE(t.writes_through());
    std::vector<KvTierChange> changes;
    for (BlockHash h = 1; h <= 3; ++h) ASSERT_TRUE(t.Put(h, BlockBytes(h).data(), &changes).ok());
    EXPECT_EQ(t.stats().write_queue_blocks, 3);
    EXPECT_TRUE(t.Blocks(KvTier::kDisk).empty()) << "nothing is written before its turn";
    changes.clear();
    for (int i = 0; i < 3; ++i) {
      auto n = t.WriteQueued(&changes);
      ASSERT_TRUE(n.ok()) << n.status().ToString();
      EXPECT_EQ(*n, kBlock);
    }
    EXPECT_EQ(*t.WriteQueued(&changes), 0) << "the queue is empty";
    ASSERT_EQ(changes.size(), 3u);
    for (const KvTierChange& c : changes) {
      EXPECT_EQ(c.tier, KvTier::kDisk);
      EXPECT_TRUE(c.stored);
    }
    // Both tiers hold them now; reads come from memory.
    EXPECT_EQ(Sorted(t.Blocks(KvTier::kHost)), (std::vector<BlockHash>{1, 2, 3}));
    EXPECT_EQ(Sorted(t.Blocks(KvTier::kDisk)), (std::vector<BlockHash>{1, 2, 3}));
    EXPECT_EQ(t.Find(2), KvTier::kHost);
    const KvTierStats st = t.stats();
    EXPECT_EQ(st.disk_writes_through, 3);
    EXPECT_EQ(st.write_queue_blocks, 0);
    // The host tier evicts a block it already wrote without writing it again.
    for (BlockHash h = 4; h <= 5; ++h) ASSERT_TRUE(t.Put(h, BlockBytes(h).data(), &changes).ok());
    EXPECT_EQ(t.stats().disk_writes_evict, 0);
    EXPECT_EQ(t.Find(1), KvTier::kDisk);
    // 4 and 5 are still queued when the store goes away unflushed, as in a
    // crash: only they are lost.
  }
  auto again = KvTierStore::Open(Options(4, dir, 8));
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(Sorted((*again)->Blocks(KvTier::kDisk)), (std::vector<BlockHash>{1, 2, 3}));
  std::vector<uint8_t> out(kBlock);
  std::vector<KvTierChange> changes;
  for (BlockHash h = 1; h <= 3; ++h) {
    ASSERT_TRUE((*again)->Get(h, out.data(), &changes).ok()) << h;
    EXPECT_EQ(out, BlockBytes(h)) << h;
  }
}

TEST(KvTierStoreTest, AFullWriteQueueDropsTheCopyNotTheBlock) {
  const std::string dir = testing::NewTempDir("tiers-queue");
  KvTierOptions o = Options(3, dir, 8);
  o.write_queue_blocks = 2;
  auto s = KvTierStore::Open(o);
  ASSERT_TRUE(s.ok());
  std::vector<KvTierChange> changes;
  for (BlockHash h = 1; h <= 3; ++h) ASSERT_TRUE((*s)->Put(h, BlockBytes(h).data(), &changes).ok());
  KvTierStats st = (*s)->stats();
  EXPECT_EQ(st.write_queue_blocks, 2);
  EXPECT_EQ(st.write_dropped, 1);
  // The unqueued block still reaches the disk when the host tier evicts it.
  ASSERT_TRUE((*s)->Put(4, BlockBytes(4).data(), &changes).ok());  // evicts 1 (queued, unwritten)
  EXPECT_EQ((*s)->Find(1), KvTier::kDisk);
  EXPECT_EQ((*s)->stats().disk_writes_evict, 1);
  EXPECT_EQ((*s)->stats().write_queue_blocks, 2) << "2 is still queued, and now 4";
  ASSERT_TRUE((*s)->WriteQueued(&changes).ok());
  ASSERT_TRUE((*s)->WriteQueued(&changes).ok());
  EXPECT_EQ((*s)->stats().disk_writes_through, 2);
  EXPECT_EQ(Sorted((*s)->Blocks(KvTier::kDisk)), (std::vector<BlockHash>{1, 2, 4}));
}

// Write-through with a full queue: a flush leaves the disk holding the most
// recently used host blocks, a hot block whose copy was written early
// included (its copy is not the first thing the flush's writes evict).
TEST(KvTierStoreTest, AFlushKeepsTheHottestHostBlocksOnDisk) {
  const std::string dir = testing::NewTempDir("tiers-flush-hot");
  {
    KvTierOptions o = Options(4, dir, 2);
    o.write_queue_blocks = 1;
    auto s = KvTierStore::Open(o);
    ASSERT_TRUE(s.ok());
    std::vector<KvTierChange> changes;
    // A is queued (and written); B, C, D find the queue full.
    for (BlockHash h : {0xA, 0xB, 0xC, 0xD})
      ASSERT_TRUE((*s)->Put(h, BlockBytes(static_cast<uint32_t>(h)).data(), &changes).ok());
    ASSERT_TRUE((*s)->WriteQueued(&changes).ok());
    EXPECT_EQ((*s)->Blocks(KvTier::kDisk), (std::vector<BlockHash>{0xA}));
    // Hits make A the hottest, then D.
    std::vector<uint8_t> out(kBlock);
    for (BlockHash h : {0xB, 0xC, 0xD, 0xA}) ASSERT_TRUE((*s)->Get(h, out.data(), &changes).ok());
    auto n = (*s)->FlushHostToDisk(std::chrono::steady_clock::now() + std::chrono::seconds(60),
                                   &changes, nullptr);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(*n, 1) << "D only: A has its copy";
  }
  auto again = KvTierStore::Open(Options(4, dir, 2));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Sorted((*again)->Blocks(KvTier::kDisk)), (std::vector<BlockHash>{0xA, 0xD}));
}

TEST(KvTierStoreTest, WriteBackFlushWritesTheMostRecentHostBlocks) {
  const std::string dir = testing::NewTempDir("tiers-flush");
  {
    auto s = KvTierStore::Open(Options(4, dir, 3, 0xabc, KvDiskWrite::kBack));
    ASSERT_TRUE(s.ok());
    ASSERT_FALSE((*s)->writes_through());
    std::vector<KvTierChange> changes;
    for (BlockHash h = 1; h <= 4; ++h)
      ASSERT_TRUE((*s)->Put(h, BlockBytes(h).data(), &changes).ok());
    EXPECT_EQ((*s)->stats().write_queue_blocks, 0);
    EXPECT_TRUE((*s)->Blocks(KvTier::kDisk).empty());
    // No time at all: nothing written, everything left.
    int64_t left = 0;
    auto none = (*s)->FlushHostToDisk(std::chrono::steady_clock::now(), &changes, &left);
    ASSERT_TRUE(none.ok());
    EXPECT_EQ(*none, 0);
    EXPECT_EQ(left, 3) << "the disk holds 3 of the 4";
    auto n = (*s)->FlushHostToDisk(std::chrono::steady_clock::now() + std::chrono::seconds(60),
                                   &changes, &left);
    ASSERT_TRUE(n.ok()) << n.status().ToString();
    EXPECT_EQ(*n, 3);
    EXPECT_EQ(left, 0);
    EXPECT_EQ((*s)->stats().disk_writes_flush, 3);
    EXPECT_EQ(Sorted((*s)->Blocks(KvTier::kHost)), (std::vector<BlockHash>{1, 2, 3, 4}));
  }
  auto again = KvTierStore::Open(Options(4, dir, 3, 0xabc, KvDiskWrite::kBack));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(Sorted((*again)->Blocks(KvTier::kDisk)), (std::vector<BlockHash>{2, 3, 4}));
}

TEST(KvTierStoreTest, RefusesASlabThatIsALinkOrAnotherFile) {
  const std::string dir = testing::NewTempDir("tiers-link");
  // A symbolic link at the slab's name: its target is neither resized nor written.
  const std::string target = testing::NewTempDir("tiers-link-target") + "/precious";
  { std::ofstream(target) << "keep me"; }
  ASSERT_EQ(::symlink(target.c_str(), (dir + "/kv-tier.slab").c_str()), 0);
  auto s = KvTierStore::Open(Options(0, dir, 4));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(s.status().message().find("symbolic link"), std::string::npos) << s.status().message();
  EXPECT_EQ(std::filesystem::file_size(target), 7u);
  // A hard link: the same file is also elsewhere.
  const std::string dir2 = testing::NewTempDir("tiers-hardlink");
  { std::ofstream(target + "2") << "keep me too"; }
  ASSERT_EQ(::link((target + "2").c_str(), (dir2 + "/kv-tier.slab").c_str()), 0);
  s = KvTierStore::Open(Options(0, dir2, 4));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("hard links"), std::string::npos) << s.status().message();
  EXPECT_EQ(std::filesystem::file_size(target + "2"), 11u);
  // A folder at the slab's name.
  const std::string dir3 = testing::NewTempDir("tiers-notfile");
  std::filesystem::create_directory(dir3 + "/kv-tier.slab");
  s = KvTierStore::Open(Options(0, dir3, 4));
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kUnavailable);
}

TEST(KvTierStoreTest, RefusesASlabOfAnotherUser) {
  if (::geteuid() != 0) {
    GTEST_SKIP() << "making a file of another user takes root (chown); the check itself is "
                    "one comparison of st_uid with geteuid()";
  }
  const std::string dir = testing::NewTempDir("tiers-owner");
  const std::string slab = dir + "/kv-tier.slab";
  { std::ofstream(slab) << "not ours"; }
  ASSERT_EQ(::chown(slab.c_str(), 65534, 65534), 0);
  auto s = KvTierStore::Open(Options(0, dir, 4));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("belongs to user id 65534"), std::string::npos)
      << s.status().message();
  EXPECT_EQ(std::filesystem::file_size(slab), 8u) << "resized anyway";
}

TEST(KvTierStoreTest, RefusesASlabLargerThanTheFreeSpace) {
  const std::string dir = testing::NewTempDir("tiers-space");
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir.c_str(), &vfs), 0);
  const int64_t free_bytes = static_cast<int64_t>(vfs.f_bavail) * vfs.f_frsize;
  KvTierOptions o = Options(0, dir, 1);
  o.disk_bytes = free_bytes + (int64_t{1} << 30);  // 1 GiB more than is free
  auto s = KvTierStore::Open(o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.status().message().find("are free"), std::string::npos) << s.status().message();
  EXPECT_EQ(std::filesystem::file_size(dir + "/kv-tier.slab"), 0u) << "nothing was reserved";
}

TEST(KvTierStoreTest, AWriteCutShortReportsItsRealErrorAndIsNeverServed) {
  const std::string dir = testing::NewTempDir("tiers-short");
  std::vector<KvTierChange> changes;
  {
    auto s = KvTierStore::Open(Options(0, dir, 4));
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    ASSERT_TRUE((*s)->Put(1, BlockBytes(1).data(), &changes).ok());  // slot 0
    Status st;
    {
      // Slot 1 may take its header and 1,000 bytes of its payload, no more.
      testing::FileSizeLimit limit(4096 + 64 + 1000);
      ASSERT_TRUE(limit.ok());
      st = (*s)->Put(2, BlockBytes(2).data(), &changes);
    }
    ASSERT_FALSE(st.ok());
    EXPECT_EQ(st.message().find("Success"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(std::strerror(EFBIG)), std::string::npos) << st.message();
    EXPECT_EQ((*s)->stats().disk_write_errors, 1);
    EXPECT_FALSE((*s)->Find(2).has_value()) << "a failed write is not indexed";
  }
  // The torn slot has a valid header over a partial payload: found at open,
  // refused when read.
  auto again = KvTierStore::Open(Options(0, dir, 4));
  ASSERT_TRUE(again.ok());
  std::vector<uint8_t> out(kBlock);
  EXPECT_TRUE((*again)->Get(1, out.data(), &changes).ok());
  EXPECT_EQ(out, BlockBytes(1));
  const Status torn = (*again)->Get(2, out.data(), &changes);
  EXPECT_EQ(torn.code(), StatusCode::kNotFound);
  EXPECT_NE(out, BlockBytes(2));
}

// A demotion whose disk write fails loses the demoted block only: the block
// being put takes the host slot it freed, and the error is reported.
TEST(KvTierStoreTest, AFailedDemotionStillKeepsTheNewBlock) {
  const std::string dir = testing::NewTempDir("tiers-demote-fail");
  auto s = KvTierStore::Open(Options(1, dir, 4));
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  std::vector<KvTierChange> changes;
  ASSERT_TRUE((*s)->Put(1, BlockBytes(1).data(), &changes).ok());  // the host's one slot
  Status st;
  {
    testing::FileSizeLimit limit(64);  // no disk slot can be written
    ASSERT_TRUE(limit.ok());
    st = (*s)->Put(2, BlockBytes(2).data(), &changes);
  }
  EXPECT_FALSE(st.ok());
  EXPECT_EQ((*s)->stats().disk_write_errors, 1);
  EXPECT_FALSE((*s)->Find(1).has_value());
  EXPECT_EQ((*s)->Find(2), KvTier::kHost);
  std::vector<uint8_t> out(kBlock);
  ASSERT_TRUE((*s)->Get(2, out.data(), &changes).ok());
  EXPECT_EQ(out, BlockBytes(2));
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
