// engine/kv_tier_mover.h and engine/host_block_buffers.h: an onload racing
// the offload of the same block gets the queued copy (a write in flight is
// not lost); onloads go ahead of queued offloads, in the order asked; a run
// ends at the first block the tiers do not hold; transfer buffers are
// recycled. With both
// tiers, the writer thread copies host blocks to disk by itself
// (write-through), no faster than its pace; a flush puts queued offloads
// away and writes the host tier to disk (write-back). Failed disk writes
// (a full file system) are logged with their real cause once per interval
// and counted.
#include "engine/kv_tier_mover.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <set>

#include "kernels/cpu/cpu_backend.h"
#include "tests/support/file_size_limit.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

constexpr int64_t kBlock = 1024;

std::vector<uint8_t> BlockBytes(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> b(kBlock);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

HostBlockBuffers::Buffer Copy(HostBlockBuffers& buffers, const std::vector<uint8_t>& bytes) {
  HostBlockBuffers::Buffer b = buffers.Take();
  EXPECT_TRUE(b);
  std::memcpy(b.data(), bytes.data(), bytes.size());
  return b;
}

// Holds the mover's thread inside its on_ready callback until released.
class Gate {
 public:
  void Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return open_; });
  }
  void AwaitEntered() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [this] { return entered_; });
  }
  void Open() {
    std::lock_guard<std::mutex> lock(mu_);
    open_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false;
  bool open_ = false;
};

class KvTierMoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KvTierOptions o;
    o.block_bytes = kBlock;
    o.layout_hash = 1;
    o.host_bytes = 8 * kBlock;
    o.host_memory_from = &backend_;
    auto s = KvTierStore::Open(o);
    ASSERT_TRUE(s.ok()) << s.status().ToString();
    store_ = std::move(*s);
  }

  // Until every queued offload has landed.
  static void WaitForOffloads(KvTierMover& mover) {
    for (int i = 0; i < 10000 && mover.counters().offloads_queued > 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Offloads blocks 1..n (block h holds BlockBytes(h)), waits for them to
  // land and returns their hashes in order: a run to onload.
  std::vector<BlockHash> OffloadRun(KvTierMover& mover, uint32_t n) {
    std::vector<BlockHash> run;
    for (uint32_t h = 1; h <= n; ++h) {
      mover.Offload(h, Copy(buffers_, BlockBytes(h)));
      run.push_back(h);
    }
    WaitForOffloads(mover);
    return run;
  }

  // Every onload result, waiting for `n` of them.
  std::vector<KvTierMover::Loaded> TakeLoaded(KvTierMover& mover, size_t n) {
    std::vector<KvTierMover::Loaded> all;
    for (int i = 0; i < 10000 && all.size() < n; ++i) {
      for (auto& l : mover.TakeLoaded()) all.push_back(std::move(l));
      if (all.size() < n) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return all;
  }

  kernels::CpuBackend backend_{1};
  std::unique_ptr<KvTierStore> store_;
  HostBlockBuffers buffers_{&backend_, kBlock, 4};
};

TEST_F(KvTierMoverTest, AnOnloadRacingTheOffloadOfItsBlockGetsTheQueuedCopy) {
  Gate gate;
  bool first = true;
  KvTierMover mover(store_.get(), &buffers_, [&] {
    if (std::exchange(first, false)) gate.Wait();
  });
  // The first onload (of nothing held) parks the mover's thread in on_ready.
  mover.Onload(1, {99});
  gate.AwaitEntered();
  // Meanwhile block 7 is evicted, and a prompt asks for it at once.
  mover.Offload(7, Copy(buffers_, BlockBytes(7)));
  EXPECT_TRUE(mover.Holds(7));
  EXPECT_FALSE(store_->Find(7).has_value());  // not in a tier yet
  mover.Onload(2, {7});
  gate.Open();
  auto loaded = TakeLoaded(mover, 2);
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_EQ(loaded[0].ticket, 1u);
  EXPECT_TRUE(loaded[0].blocks.empty());
  // The onload went ahead of the queued offload and was served from it.
  ASSERT_EQ(loaded[1].ticket, 2u);
  ASSERT_EQ(loaded[1].blocks.size(), 1u);
  EXPECT_EQ(std::vector<uint8_t>(loaded[1].blocks[0].data(), loaded[1].blocks[0].data() + kBlock),
            BlockBytes(7));
  EXPECT_EQ(store_->stats().host.hits, 0);  // not read from the tier
  // The offload then landed.
  WaitForOffloads(mover);
  EXPECT_EQ(store_->Find(7), KvTier::kHost);
}

// Onloads queued while the mover is busy are served in the order asked
// (each ahead of the queued offloads), so a request's onload is never
// passed by later ones without end.
TEST_F(KvTierMoverTest, OnloadsAreServedInTheOrderAsked) {
  Gate gate;
  bool first = true;
  KvTierMover mover(store_.get(), &buffers_, [&] {
    if (std::exchange(first, false)) gate.Wait();
  });
  mover.Onload(0, {99});
  gate.AwaitEntered();
  mover.Offload(7, Copy(buffers_, BlockBytes(7)));
  for (uint64_t ticket : {1, 2, 3}) mover.Onload(ticket, {7});
  // The first is done while the others wait: the engine can step for it.
  EXPECT_EQ(mover.counters().onloads_ready, 1);
  EXPECT_EQ(mover.counters().onloads_in_flight, 3);
  gate.Open();
  auto loaded = TakeLoaded(mover, 4);
  EXPECT_EQ(mover.counters().onloads_ready, 0);  // all taken
  std::vector<uint64_t> order;
  for (const auto& l : loaded) order.push_back(l.ticket);
  EXPECT_EQ(order, (std::vector<uint64_t>{0, 1, 2, 3}));
  // Each went ahead of the offload: served from its queued copy.
  for (size_t i = 1; i < loaded.size(); ++i) EXPECT_EQ(loaded[i].blocks.size(), 1u);
  EXPECT_EQ(store_->stats().host.hits, 0);
}

// A run longer than a part comes in parts, each read only once the one
// before was taken, so that its buffers never hold the whole run.
TEST_F(KvTierMoverTest, ALongRunComesInPartsEachAfterTheLastWasTaken) {
  KvTierMover mover(store_.get(), &buffers_, {}, 0, /*max_onload_blocks=*/3);
  const std::vector<BlockHash> run = OffloadRun(mover, 7);
  mover.Onload(9, run);
  std::vector<KvTierMover::Loaded> parts;
  for (int i = 0; i < 10000 && (parts.empty() || !parts.back().last); ++i) {
    auto taken = mover.TakeLoaded();
    if (taken.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      continue;
    }
    ASSERT_EQ(taken.size(), 1u) << "a part was read before the one before it was taken";
    parts.push_back(std::move(taken[0]));
  }
  ASSERT_EQ(parts.size(), 3u);
  size_t first = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    EXPECT_EQ(parts[p].ticket, 9u);
    EXPECT_EQ(parts[p].first, first);
    EXPECT_EQ(parts[p].last, p + 1 == parts.size());
    EXPECT_EQ(parts[p].blocks.size(), p + 1 < parts.size() ? 3u : 1u);
    for (size_t k = 0; k < parts[p].blocks.size(); ++k) {
      const auto& b = parts[p].blocks[k];
      EXPECT_EQ(std::vector<uint8_t>(b.data(), b.data() + kBlock),
                BlockBytes(static_cast<uint32_t>(first + k + 1)));
    }
    first += parts[p].blocks.size();
  }
  EXPECT_EQ(mover.counters().onloads_in_flight, 0);
}

// An onload abandoned (its request cancelled or preempted) is read no
// further: its parts not taken are dropped, queued ones never start, and
// the onloads behind it go on.
TEST_F(KvTierMoverTest, AnAbandonedOnloadIsReadNoFurther) {
  KvTierMover mover(store_.get(), &buffers_, {}, 0, /*max_onload_blocks=*/2);
  const std::vector<BlockHash> run = OffloadRun(mover, 6);
  mover.Onload(1, run);
  mover.Onload(2, {5, 6});
  mover.Onload(3, {1});
  // The first part of 1 is read; 1 then waits for it to be taken.
  for (int i = 0; i < 10000 && mover.counters().onloads_ready == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  mover.Abandon(1);
  mover.Abandon(2);  // queued: never starts
  auto loaded = TakeLoaded(mover, 1);
  ASSERT_EQ(loaded.size(), 1u);
  EXPECT_EQ(loaded[0].ticket, 3u);
  EXPECT_TRUE(loaded[0].last);
  EXPECT_EQ(loaded[0].blocks.size(), 1u);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_TRUE(mover.TakeLoaded().empty()) << "an abandoned onload went on";
  EXPECT_EQ(mover.counters().onloads_in_flight, 0);
}

TEST_F(KvTierMoverTest, ARunEndsAtTheFirstBlockTheTiersDoNotHold) {
  KvTierMover mover(store_.get(), &buffers_, {});
  mover.Offload(1, Copy(buffers_, BlockBytes(1)));
  mover.Offload(2, Copy(buffers_, BlockBytes(2)));
  mover.Offload(4, Copy(buffers_, BlockBytes(4)));
  mover.Onload(5, {1, 2, 3, 4});
  auto loaded = TakeLoaded(mover, 1);
  ASSERT_EQ(loaded.size(), 1u);
  ASSERT_EQ(loaded[0].blocks.size(), 2u);
  for (size_t k = 0; k < 2; ++k) {
    const auto& b = loaded[0].blocks[k];
    EXPECT_EQ(std::vector<uint8_t>(b.data(), b.data() + kBlock),
              BlockBytes(static_cast<uint32_t>(k + 1)));
    EXPECT_EQ(loaded[0].tiers[k], KvTier::kHost);
  }
}

// Both tiers, for the disk writes.
std::unique_ptr<KvTierStore> TwoTiers(kernels::Backend* backend, KvDiskWrite write) {
  KvTierOptions o;
  o.block_bytes = kBlock;
  o.layout_hash = 2;
  o.host_bytes = 8 * kBlock;
  o.host_memory_from = backend;
  o.disk_dir = testing::NewTempDir("mover-disk");
  o.disk_bytes = 16 * 4096;
  o.disk_write = write;
  auto s = KvTierStore::Open(o);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(*s) : nullptr;
}

TEST_F(KvTierMoverTest, TheWriterCopiesHostBlocksToDiskByItself) {
  auto store = TwoTiers(&backend_, KvDiskWrite::kThrough);
  ASSERT_NE(store, nullptr);
  KvTierMover mover(store.get(), &buffers_, {});
  for (BlockHash h = 1; h <= 3; ++h) mover.Offload(h, Copy(buffers_, BlockBytes(h)));
  for (int i = 0; i < 10000 && store->stats().disk_writes_through < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(store->stats().disk_writes_through, 3);
  EXPECT_EQ(store->stats().write_queue_blocks, 0);
  EXPECT_EQ(store->Blocks(KvTier::kDisk).size(), 3u);
  int disk_stored = 0, host_stored = 0;
  for (const KvTierChange& c : mover.TakeChanges()) {
    disk_stored += c.stored && c.tier == KvTier::kDisk;
    host_stored += c.stored && c.tier == KvTier::kHost;
  }
  EXPECT_EQ(disk_stored, 3);
  EXPECT_EQ(host_stored, 3);
}

// The mover's thread and the writer's change the tiers at once, each
// releasing the store's lock for its I/O: their changes, replayed in the
// order given, say what the store holds (one block evicted from disk by the
// writer while the mover demoted it there again must not end "removed").
TEST_F(KvTierMoverTest, ChangesReplayIntoWhatTheStoreHolds) {
  auto store = TwoTiers(&backend_, KvDiskWrite::kThrough);
  ASSERT_NE(store, nullptr);
  std::set<BlockHash> held[2];
  auto replay = [&](const std::vector<KvTierChange>& changes) {
    for (const KvTierChange& c : changes) {
      auto& set = held[c.tier == KvTier::kHost ? 0 : 1];
      if (c.stored) {
        set.insert(c.hash);  // a fresh disk copy of a block held there is stored again
      } else {
        EXPECT_EQ(set.erase(c.hash), 1u) << c.hash << " removed but not held";
      }
    }
  };
  {
    KvTierMover mover(store.get(), &buffers_, {});
    std::mt19937 rng(5);
    for (int i = 0; i < 3000; ++i) {
      // Some hashes come back: refreshed, or put again after they left.
      const BlockHash h = 1 + rng() % 60;
      mover.Offload(h, Copy(buffers_, BlockBytes(static_cast<uint32_t>(h))));
      if (i % 100 == 0) replay(mover.TakeChanges());
    }
  }  // joins both threads
  replay(store->TakeChanges());
  for (KvTier tier : {KvTier::kHost, KvTier::kDisk}) {
    const auto blocks = store->Blocks(tier);
    EXPECT_EQ(std::set<BlockHash>(blocks.begin(), blocks.end()),
              held[tier == KvTier::kHost ? 0 : 1]);
  }
}

TEST_F(KvTierMoverTest, TheWriterKeepsItsPaceAndStopsWithoutWaitingForIt) {
  auto store = TwoTiers(&backend_, KvDiskWrite::kThrough);
  ASSERT_NE(store, nullptr);
  {
    // One block's bytes a minute: the first write goes at once, the next
    // not before a minute has passed.
    KvTierMover mover(store.get(), &buffers_, {}, /*write_bytes_per_second=*/kBlock / 60);
    for (BlockHash h = 1; h <= 3; ++h) mover.Offload(h, Copy(buffers_, BlockBytes(h)));
    for (int i = 0; i < 10000 && store->stats().disk_writes_through < 1; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    EXPECT_EQ(store->stats().disk_writes_through, 1);
    EXPECT_EQ(store->stats().write_queue_blocks, 2);
  }  // the destructor does not wait out the pace
  EXPECT_EQ(store->stats().disk_writes_through, 1);
}

TEST_F(KvTierMoverTest, AFlushPutsQueuedOffloadsAwayAndWritesTheHostTier) {
  auto store = TwoTiers(&backend_, KvDiskWrite::kBack);
  ASSERT_NE(store, nullptr);
  KvTierMover mover(store.get(), &buffers_, {});
  for (BlockHash h = 1; h <= 3; ++h) mover.Offload(h, Copy(buffers_, BlockBytes(h)));
  auto r = mover.Flush(std::chrono::steady_clock::now() + std::chrono::seconds(60));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->written, 3);
  EXPECT_EQ(r->left, 0);
  EXPECT_EQ(store->Blocks(KvTier::kDisk).size(), 3u);
  EXPECT_EQ(store->Blocks(KvTier::kHost).size(), 3u);
  EXPECT_EQ(store->stats().disk_writes_flush, 3);
}

TEST_F(KvTierMoverTest, FailedDiskWritesAreLoggedOnceWithTheirCauseAndCounted) {
  KvTierOptions o;
  o.block_bytes = kBlock;
  o.layout_hash = 3;
  o.disk_dir = testing::NewTempDir("mover-full");
  o.disk_bytes = 16 * 4096;
  auto store = KvTierStore::Open(o);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  {
    KvTierMover mover(store->get(), &buffers_, {});
    mover.Offload(1, Copy(buffers_, BlockBytes(1)));  // slot 0, whole
    auto flushed = mover.Flush(std::chrono::steady_clock::now() + std::chrono::seconds(60));
    ASSERT_TRUE(flushed.ok());
    ASSERT_EQ((*store)->stats().disk.blocks, 1);
    // Every later write stops 100 bytes into slot 1, as on a full disk.
    testing::FileSizeLimit limit(4096 + 100);
    ASSERT_TRUE(limit.ok());
    ::testing::internal::CaptureStderr();
    for (BlockHash h = 2; h < 22; ++h) mover.Offload(h, Copy(buffers_, BlockBytes(h)));
    for (int i = 0; i < 10000 && mover.counters().offload_failures < 20; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const std::string log = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(mover.counters().offload_failures, 20);
    EXPECT_EQ((*store)->stats().disk_write_errors, 20);
    size_t lines = 0;
    for (size_t at = log.find("could not be kept"); at != std::string::npos;
         at = log.find("could not be kept", at + 1)) {
      ++lines;
    }
    EXPECT_EQ(lines, 1u) << log;
    EXPECT_NE(log.find(std::strerror(EFBIG)), std::string::npos) << log;
    EXPECT_EQ(log.find("Success"), std::string::npos) << log;
  }
  EXPECT_EQ((*store)->stats().disk.blocks, 1);
}

TEST(HostBlockBuffersTest, BuffersAreRecycledUpToTheIdleLimit) {
  kernels::CpuBackend backend(1);
  HostBlockBuffers buffers(&backend, 256, 2);
  {
    std::vector<HostBlockBuffers::Buffer> held;
    for (int i = 0; i < 5; ++i) held.push_back(buffers.Take());
    EXPECT_EQ(buffers.allocated(), 5u);
    for (const auto& b : held) EXPECT_EQ(b.size(), 256u);
  }
  // Two kept for reuse, three freed.
  EXPECT_EQ(buffers.allocated(), 2u);
  EXPECT_EQ(buffers.idle(), 2u);
  HostBlockBuffers::Buffer again = buffers.Take();
  EXPECT_EQ(buffers.allocated(), 2u);  // reused, not allocated
  EXPECT_EQ(buffers.idle(), 1u);
  HostBlockBuffers::Buffer moved = std::move(again);
  EXPECT_FALSE(again);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_TRUE(moved);
}

}  // namespace
}  // namespace pdserve
