// The engine with lower KV tiers (EngineOptions kv_host_cache_bytes,
// kv_disk_cache_dir): a pool too small for the working set evicts cached
// blocks down to host memory and disk; a prompt that comes back copies its
// prefix from there instead of computing it, and its greedy tokens are those
// of an engine without tiers. A restarted engine on the same disk folder
// comes back warm; a corrupt disk block is recomputed, never used; tenants
// (cache salts) never share a lower-tier block; every tier change is a KV
// event of its tier. A disk folder written under another model fingerprint
// is discarded, not served; a flush at stop leaves the device pool's and the
// host tier's blocks on disk for the next engine.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "engine/engine.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

constexpr int64_t kBlockBytes = 8 << 10;  // tiny model, fp32 KV, 16 tokens per block

class EngineTiersTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = testing::TinyCpuModel();
    ASSERT_NE(model_, nullptr);
  }

  // A pool of 12 blocks: two 96-token prompts' worth.
  static std::unique_ptr<Engine> MakeEngine(int64_t host_blocks, const std::string& disk_dir,
                                            int64_t disk_blocks, uint64_t fingerprint = 0,
                                            KvDiskWrite write = KvDiskWrite::kThrough,
                                            int64_t offload_queue_blocks = 0,
                                            int64_t onload_part_blocks = 0) {
    EngineOptions o;
    o.kv_offload_queue_blocks = offload_queue_blocks;
    o.kv_onload_part_blocks = onload_part_blocks;
    o.model_fingerprint = fingerprint;
    o.kv_disk_write = write;
    o.kv_cache_bytes = 12 * kBlockBytes;
    o.record_kv_events = true;
    o.kv_host_cache_bytes = host_blocks * kBlockBytes;
    o.kv_disk_cache_dir = disk_dir;
    o.kv_disk_cache_bytes = disk_blocks * (kBlockBytes + 4096);
    auto e = Engine::Create(model_, o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return e.ok() ? std::move(*e) : nullptr;
  }

  static std::vector<TokenId> Prompt(int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<TokenId> p(n);
    for (auto& t : p) t = static_cast<TokenId>(rng() % 512);
    return p;
  }

  // Greedy tokens of one request, run alone to the end. Steps wait a little
  // when nothing could run (an onload in flight on the tier thread).
  static std::vector<TokenId> Run(Engine& e, RequestId id, const std::vector<TokenId>& prompt,
                                  const std::string& salt = "") {
    EngineRequest r;
    r.id = id;
    r.prompt = prompt;
    r.params.temperature = 0;
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    r.cache_salt = salt;
    EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
    std::vector<TokenId> out;
    for (int guard = 0; e.HasUnfinished() && guard < 100000; ++guard) {
      auto step = e.Step();
      EXPECT_TRUE(step.ok()) << step.status().ToString();
      if (!step.ok()) break;
      for (const auto& o : *step)
        out.insert(out.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (step->empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return out;
  }

  // Steps until the tier thread has put every evicted block away.
  static void Settle(Engine& e) {
    for (int i = 0; i < 2000; ++i) {
      (void)e.Step();
      if (e.GetStats().tiers.offloads_queued == 0) {
        (void)e.Step();  // records the last changes as events
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  static Model* model_;
};
Model* EngineTiersTest::model_ = nullptr;

// The tokens without tiers, for comparison.
std::map<int, std::vector<TokenId>> Reference(Model* model,
                                              const std::vector<std::vector<TokenId>>& prompts) {
  EngineOptions o;
  o.kv_cache_bytes = 4 << 20;
  auto e = Engine::Create(model, o);
  EXPECT_TRUE(e.ok());
  std::map<int, std::vector<TokenId>> out;
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.id = 1000 + i;
    r.prompt = prompts[i];
    r.params.temperature = 0;
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    EXPECT_TRUE((*e)->AddRequest(std::move(r)).ok());
    while ((*e)->HasUnfinished()) {
      auto step = (*e)->Step();
      for (const auto& o : *step) {
        out[static_cast<int>(o.id - 1000)].insert(out[static_cast<int>(o.id - 1000)].end(),
                                                  o.new_token_ids.begin(), o.new_token_ids.end());
      }
    }
  }
  return out;
}

TEST_F(EngineTiersTest, EvictedPrefixesComeBackFromHostAndDiskWithTheSameTokens) {
  const std::string dir = testing::NewTempDir("engine-tiers");
  auto e = MakeEngine(/*host_blocks=*/6, dir, /*disk_blocks=*/32);
  ASSERT_NE(e, nullptr);
  std::vector<std::vector<TokenId>> prompts;
  for (uint32_t i = 0; i < 4; ++i) prompts.push_back(Prompt(97, 10 + i));  // 6 full blocks each
  const auto want = Reference(model_, prompts);

  // Four prompts through a 12-block pool: the first ones' blocks are evicted
  // by the later ones, down to the host tier and (past 6 blocks) the disk.
  RequestId id = 1;
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(Run(*e, id++, prompts[i]), want.at(i)) << i;
  Settle(*e);
  EngineTierStats t = e->GetStats().tiers;
  EXPECT_TRUE(t.enabled);
  EXPECT_GT(t.offloaded_blocks, 0);
  EXPECT_GT(t.store.host.blocks, 0);
  EXPECT_GT(t.store.disk.blocks, 0);

  // The first prompt again: its prefix comes back from the tiers (the disk
  // for the oldest blocks), not from computation, with the same tokens.
  EXPECT_EQ(Run(*e, id++, prompts[0]), want.at(0));
  t = e->GetStats().tiers;
  EXPECT_GT(t.host_hit_tokens + t.disk_hit_tokens, 0);
  EXPECT_GE(t.host_hit_tokens + t.disk_hit_tokens, 16 * 5) << "most of the prefix came back";
  const auto onloads = e->TakeTierOnloads();
  ASSERT_FALSE(onloads.empty());
  // And the rest, in turn: each equals the engine without tiers.
  for (size_t i = 1; i < prompts.size(); ++i) EXPECT_EQ(Run(*e, id++, prompts[i]), want.at(i)) << i;
  EXPECT_GT(e->GetStats().tiers.disk_hit_tokens, 0) << "no prefix came back from the disk";

  // Every tier change was a KV event of its tier.
  int host_stored = 0, disk_stored = 0, host_removed = 0;
  for (const KvEventBatch& b : e->block_manager().DrainEvents()) {
    for (const KvEvent& ev : b.events) {
      if (const auto* s = std::get_if<KvStored>(&ev)) {
        host_stored += s->tier == KvTier::kHost;
        disk_stored += s->tier == KvTier::kDisk;
      } else if (const auto* r = std::get_if<KvRemoved>(&ev)) {
        host_removed += r->tier == KvTier::kHost;
      }
    }
  }
  EXPECT_GT(host_stored, 0);
  EXPECT_GT(disk_stored, 0);
  EXPECT_GT(host_removed, 0);
  const KvCacheSnapshot snap = e->block_manager().Snapshot();
  EXPECT_EQ(static_cast<int64_t>(snap.host_block_hashes.size()),
            e->GetStats().tiers.store.host.blocks);
  EXPECT_EQ(static_cast<int64_t>(snap.disk_block_hashes.size()),
            e->GetStats().tiers.store.disk.blocks);
  EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u) << "a block stayed held";
}

// A prefix longer than an onload's part comes back in parts (here of two
// blocks), each copied in as it comes, with the same tokens and hits.
TEST_F(EngineTiersTest, ALongPrefixComesBackInParts) {
  const std::string dir = testing::NewTempDir("engine-tiers-parts");
  auto e = MakeEngine(/*host_blocks=*/6, dir, /*disk_blocks=*/32, 0, KvDiskWrite::kThrough, 0,
                      /*onload_part_blocks=*/2);
  ASSERT_NE(e, nullptr);
  std::vector<std::vector<TokenId>> prompts;
  for (uint32_t i = 0; i < 3; ++i) prompts.push_back(Prompt(97, 40 + i));
  const auto want = Reference(model_, prompts);
  RequestId id = 1;
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(Run(*e, id++, prompts[i]), want.at(i)) << i;
  Settle(*e);
  EXPECT_EQ(Run(*e, id++, prompts[0]), want.at(0));
  const EngineTierStats t = e->GetStats().tiers;
  EXPECT_GE(t.host_hit_tokens + t.disk_hit_tokens, 16 * 5) << "most of the prefix came back";
  const auto onloads = e->TakeTierOnloads();
  ASSERT_EQ(onloads.size(), 1u);
  EXPECT_GE(onloads[0].blocks, 5) << "one onload of the whole run, in parts";
  EXPECT_EQ(t.onloads_in_flight, 0);
  EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u) << "a block stayed held";
}

// The tier thread goes on after the last step (the last evictions land in
// the host tier, pushing older blocks to disk): RecordTierChanges, which an
// idle worker's loop calls each turn, makes those changes events without
// another step, so the router's view and a snapshot follow the tiers.
TEST_F(EngineTiersTest, TierChangesAfterTheLastStepAreRecordedWithoutAnother) {
  const std::string dir = testing::NewTempDir("engine-tiers-idle");
  auto e =
      MakeEngine(/*host_blocks=*/6, dir, /*disk_blocks=*/32, /*fingerprint=*/0, KvDiskWrite::kBack);
  ASSERT_NE(e, nullptr);
  RequestId id = 1;
  for (uint32_t i = 0; i < 4; ++i) (void)Run(*e, id++, Prompt(97, 20 + i));
  // Wait for the tier thread, without stepping (write-back: it is the only
  // one moving blocks, and what it moved is recorded once nothing is queued).
  for (int i = 0; i < 20000 && e->GetStats().tiers.offloads_queued > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_EQ(e->GetStats().tiers.offloads_queued, 0);
  e->RecordTierChanges();
  const KvCacheSnapshot snap = e->block_manager().Snapshot();
  const EngineTierStats t = e->GetStats().tiers;
  EXPECT_GT(t.store.disk.blocks, 0);
  EXPECT_EQ(static_cast<int64_t>(snap.host_block_hashes.size()), t.store.host.blocks);
  EXPECT_EQ(static_cast<int64_t>(snap.disk_block_hashes.size()), t.store.disk.blocks);
}

TEST_F(EngineTiersTest, ARestartedEngineComesBackWarmFromItsDisk) {
  const std::string dir = testing::NewTempDir("engine-tiers-restart");
  std::vector<std::vector<TokenId>> prompts;
  for (uint32_t i = 0; i < 3; ++i) prompts.push_back(Prompt(97, 40 + i));
  const auto want = Reference(model_, prompts);
  {
    // No host tier: every evicted block goes straight to the disk.
    auto e = MakeEngine(0, dir, 32);
    ASSERT_NE(e, nullptr);
    RequestId id = 1;
    for (const auto& p : prompts) (void)Run(*e, id++, p);
    Settle(*e);
    EXPECT_GT(e->GetStats().tiers.store.disk.blocks, 0);
  }
  auto e = MakeEngine(0, dir, 32);
  ASSERT_NE(e, nullptr);
  const KvCacheSnapshot snap = e->block_manager().Snapshot();
  EXPECT_FALSE(snap.disk_block_hashes.empty()) << "the disk's blocks are not announced";
  EXPECT_TRUE(snap.block_hashes.empty());
  EXPECT_EQ(Run(*e, 1, prompts[0]), want.at(0));
  EXPECT_GE(e->GetStats().tiers.disk_hit_tokens, 16) << "the restarted engine recomputed";
}

TEST_F(EngineTiersTest, ACorruptDiskBlockIsRecomputedNotUsed) {
  const std::string dir = testing::NewTempDir("engine-tiers-corrupt");
  const std::vector<TokenId> p = Prompt(97, 70);
  const auto want = Reference(model_, {p});
  {
    auto e = MakeEngine(0, dir, 32);
    ASSERT_NE(e, nullptr);
    (void)Run(*e, 1, p);
    for (uint32_t i = 0; i < 3; ++i) (void)Run(*e, 2 + i, Prompt(97, 80 + i));  // push p down
    Settle(*e);
  }
  // Flip one byte in the payload of every slot of the slab.
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    const int fd = ::open(f.path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    const off_t size = ::lseek(fd, 0, SEEK_END);
    const off_t stride = ((64 + kBlockBytes + 4095) / 4096) * 4096;
    for (off_t at = 64 + 100; at < size; at += stride) {
      uint8_t b;
      ASSERT_EQ(::pread(fd, &b, 1, at), 1);
      b ^= 1;
      ASSERT_EQ(::pwrite(fd, &b, 1, at), 1);
    }
    ::close(fd);
  }
  auto e = MakeEngine(0, dir, 32);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(Run(*e, 1, p), want.at(0)) << "a corrupt block was served";
  const EngineTierStats t = e->GetStats().tiers;
  EXPECT_EQ(t.disk_hit_tokens, 0);
  EXPECT_GE(t.store.corrupt_dropped, 1);
}

TEST_F(EngineTiersTest, TenantsNeverShareALowerTierBlock) {
  const std::string dir = testing::NewTempDir("engine-tiers-tenants");
  auto e = MakeEngine(8, dir, 32);
  ASSERT_NE(e, nullptr);
  const std::vector<TokenId> p = Prompt(97, 90);
  (void)Run(*e, 1, p, "tenant-a");
  for (uint32_t i = 0; i < 3; ++i) (void)Run(*e, 2 + i, Prompt(97, 91 + i), "tenant-a");
  Settle(*e);
  // Tenant b's identical prompt finds nothing of tenant a's in any tier.
  (void)Run(*e, 10, p, "tenant-b");
  EXPECT_EQ(e->GetStats().tiers.host_hit_tokens + e->GetStats().tiers.disk_hit_tokens, 0);
  // Tenant a's does.
  (void)Run(*e, 11, p, "tenant-a");
  EXPECT_GT(e->GetStats().tiers.host_hit_tokens + e->GetStats().tiers.disk_hit_tokens, 0);
}

TEST_F(EngineTiersTest, ADiskWrittenUnderAnotherModelFingerprintIsDiscarded) {
  const std::string dir = testing::NewTempDir("engine-tiers-fingerprint");
  const std::vector<TokenId> p = Prompt(97, 60);
  const auto want = Reference(model_, {p});
  {
    auto e = MakeEngine(0, dir, 32, /*fingerprint=*/0x1111);
    ASSERT_NE(e, nullptr);
    (void)Run(*e, 1, p);
    for (uint32_t i = 0; i < 3; ++i) (void)Run(*e, 2 + i, Prompt(97, 61 + i));  // push p down
    Settle(*e);
    ASSERT_GT(e->GetStats().tiers.store.disk.blocks, 0);
  }
  // Other weights of the same name and shapes: nothing comes back.
  auto e = MakeEngine(0, dir, 32, /*fingerprint=*/0x2222);
  ASSERT_NE(e, nullptr);
  EXPECT_NE(e->kv_fingerprint(), 0x1111u);
  EXPECT_TRUE(e->block_manager().Snapshot().disk_block_hashes.empty());
  EXPECT_GT(e->GetStats().tiers.store.discarded_at_open, 0);
  EXPECT_EQ(Run(*e, 1, p), want.at(0));
  EXPECT_EQ(e->GetStats().tiers.disk_hit_tokens, 0) << "another model's KV was served";
}

TEST_F(EngineTiersTest, AFlushAtStopLeavesThePoolAndHostTierOnDisk) {
  const std::string dir = testing::NewTempDir("engine-tiers-flush");
  std::vector<std::vector<TokenId>> prompts;
  for (uint32_t i = 0; i < 3; ++i) prompts.push_back(Prompt(97, 120 + i));
  const auto want = Reference(model_, prompts);
  {
    // Write-back, and a host tier that holds everything the pool evicts:
    // nothing reaches the disk until the flush.
    auto e = MakeEngine(32, dir, 64, 0, KvDiskWrite::kBack);
    ASSERT_NE(e, nullptr);
    RequestId id = 1;
    for (const auto& p : prompts) (void)Run(*e, id++, p);
    Settle(*e);
    ASSERT_EQ(e->GetStats().tiers.store.disk.blocks, 0);
    ASSERT_GT(e->GetStats().tiers.store.host.blocks, 0);
    auto flushed = e->FlushTiersToDisk(std::chrono::steady_clock::now() + std::chrono::seconds(60));
    ASSERT_TRUE(flushed.ok()) << flushed.status().ToString();
    EXPECT_GT(flushed->evicted, 0) << "the pool's own cached blocks";
    EXPECT_GT(flushed->written, 0);
    EXPECT_EQ(flushed->left, 0);
    EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u);
  }
  auto e = MakeEngine(32, dir, 64, 0, KvDiskWrite::kBack);
  ASSERT_NE(e, nullptr);
  // Every prompt comes back from the disk, the last one (which was still in
  // the pool at the flush) included.
  RequestId id = 1;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int64_t before = e->GetStats().tiers.disk_hit_tokens;
    EXPECT_EQ(Run(*e, id++, prompts[i]), want.at(i)) << i;
    EXPECT_GE(e->GetStats().tiers.disk_hit_tokens - before, 16 * 5) << i;
  }
}

// The flush at stop evicts the pool in batches of half the offload queue,
// each written before the next: a queue of 2 blocks drops none of them.
TEST_F(EngineTiersTest, AFlushThroughASmallOffloadQueueDropsNothing) {
  const std::string dir = testing::NewTempDir("engine-tiers-flush-queue");
  const std::vector<TokenId> p = Prompt(150, 7);  // 9 full blocks cached
  const auto want = Reference(model_, {p});
  {
    auto e = MakeEngine(0, dir, 64, 0, KvDiskWrite::kThrough, /*offload_queue_blocks=*/2);
    ASSERT_NE(e, nullptr);
    (void)Run(*e, 1, p);
    auto flushed = e->FlushTiersToDisk(std::chrono::steady_clock::now() + std::chrono::seconds(60));
    ASSERT_TRUE(flushed.ok()) << flushed.status().ToString();
    EXPECT_GE(flushed->evicted, 9);
    EXPECT_EQ(flushed->written, flushed->evicted);
    EXPECT_EQ(e->GetStats().tiers.offloads_dropped, 0);
    EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u);
  }
  auto e = MakeEngine(0, dir, 64, 0, KvDiskWrite::kThrough, 2);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(Run(*e, 1, p), want.at(0));
  EXPECT_GE(e->GetStats().tiers.disk_hit_tokens, 9 * 16);
}

}  // namespace
}  // namespace pdserve
