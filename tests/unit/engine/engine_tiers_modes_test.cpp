// Lower KV tiers with a token eviction or selection mode (docs/kv-eviction.md):
// attention sinks (streaming), SnapKV and Quest. For each, a prompt whose
// blocks the pool evicted to the host tier comes back from there with the
// greedy tokens (and logprobs) of an engine in the same mode without tiers,
// and the hit counters and onload records show what came back. A streaming
// prompt onloads its sink and window blocks only, never the middle blocks it
// had released (though the tier holds them); SnapKV's private compressed
// blocks never reach a tier and a repeated prompt keeps the same positions;
// Quest's selection after an onload reads key bounds computed from the
// onloaded keys. A disk tier comes back warm for a restarted streaming
// engine. Everything the tiers hold is a block the pool had committed.
#include <gtest/gtest.h>

#include <filesystem>
#include <thread>
#include <unordered_set>

#include "common/kv_eviction.h"
#include "engine/engine.h"
#include "tests/support/kv_eviction_modes.h"
#include "tests/support/numerics.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::RandomTokens;

constexpr int64_t kBlockBytes = 8 << 10;  // the tiny preset, fp32 KV, 16 tokens per block

KvEviction Streaming() { return testing::Streaming(4, 32); }
KvEviction SnapKv() { return testing::SnapKv(32, 8); }
KvEviction Quest() { return testing::Quest(2); }

// The tiny preset with a context of 64, which streaming runs past.
std::string Dir() {
  ModelSpec s = *PresetModelSpec("tiny");
  s.max_position_embeddings = 64;
  s.name = "tiers-modes-tiny";
  return testing::ModelDir("tiers-modes", s);
}

// The tiny preset as it is (a context of 4,096), for SnapKV and Quest.
std::string LongDir() {
  ModelSpec s = *PresetModelSpec("tiny");
  s.name = "tiers-modes-long";
  return testing::ModelDir("tiers-modes-long", s);
}

struct Result {
  std::vector<TokenId> tokens;
  std::vector<float> logprobs;
  int64_t cached = -1;                     // num_cached_tokens of the first output
  std::vector<std::vector<int32_t>> kept;  // SnapKV's kept positions
};

// One greedy request run alone to the end; steps wait a little when nothing
// could run (an onload in flight).
Result RunGreedy(Engine& e, RequestId id, const std::vector<TokenId>& prompt, int max_tokens) {
  EngineRequest r;
  r.id = id;
  r.prompt = prompt;
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.params.logprobs = true;
  EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
  Result out;
  for (int guard = 0; e.HasUnfinished() && guard < 100000; ++guard) {
    auto step = e.Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    if (out.kept.empty()) out.kept = e.SnapKvKept(id);
    for (const auto& o : *step) {
      if (out.cached < 0 && !o.new_token_ids.empty()) out.cached = o.num_cached_tokens;
      out.tokens.insert(out.tokens.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      for (const auto& lp : o.logprobs) out.logprobs.push_back(lp.logprob);
    }
    if (step->empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return out;
}

// Steps until the tier thread has put every evicted block away, and records
// its changes.
void Settle(Engine& e) {
  for (int i = 0; i < 2000 && e.GetStats().tiers.offloads_queued > 0; ++i) {
    (void)e.Step();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  (void)e.Step();
}

std::unique_ptr<Engine> MakeEngine(Model* model, int64_t pool_blocks, int64_t host_blocks,
                                   const std::string& disk_dir = "") {
  EngineOptions o;
  o.kv_cache_bytes = pool_blocks * kBlockBytes;
  o.record_kv_events = true;
  o.kv_host_cache_bytes = host_blocks * kBlockBytes;
  o.kv_disk_cache_dir = disk_dir;
  if (!disk_dir.empty()) o.kv_disk_cache_bytes = 64 * (kBlockBytes + 4096);
  auto e = Engine::Create(model, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

void ExpectSame(const Result& got, const Result& want) {
  EXPECT_EQ(got.tokens, want.tokens);
  ASSERT_EQ(got.logprobs.size(), want.logprobs.size());
  for (size_t i = 0; i < got.logprobs.size(); ++i) {
    EXPECT_NEAR(got.logprobs[i], want.logprobs[i], 1e-4) << "token " << i;
  }
}

// Every block hash a tier holds is the hash of a full block of one of the
// token sequences the engine ran (prompt and output): no private block, and
// nothing the pool had not committed, went down.
void ExpectTiersHoldOnlyCommittedBlocks(Engine& e,
                                        const std::vector<std::vector<TokenId>>& sequences) {
  std::unordered_set<BlockHash> known;
  const BlockHash seed = BlockHashSeed(e.model().model_id());
  for (const auto& seq : sequences) {
    for (BlockHash h : HashPrompt(seed, seq, 16)) known.insert(h);
  }
  const KvCacheSnapshot snap = e.block_manager().Snapshot();
  for (BlockHash h : snap.host_block_hashes) EXPECT_TRUE(known.count(h)) << "a foreign host block";
  for (BlockHash h : snap.disk_block_hashes) EXPECT_TRUE(known.count(h)) << "a foreign disk block";
  // What a router rebuilds from the events, tier by tier, is what the
  // engine holds (the events of the whole run: none was drained before).
  std::unordered_set<BlockHash> device, host, disk;
  for (const KvEventBatch& b : e.block_manager().DrainEvents()) {
    ApplyKvEventBatch(b, &device, KvTier::kDevice);
    ApplyKvEventBatch(b, &host, KvTier::kHost);
    ApplyKvEventBatch(b, &disk, KvTier::kDisk);
  }
  auto set = [](const std::vector<BlockHash>& v) {
    return std::unordered_set<BlockHash>(v.begin(), v.end());
  };
  EXPECT_EQ(device, set(snap.block_hashes));
  EXPECT_EQ(host, set(snap.host_block_hashes));
  EXPECT_EQ(disk, set(snap.disk_block_hashes));
}

std::vector<TokenId> Joined(const std::vector<TokenId>& prompt, const Result& r) {
  std::vector<TokenId> all = prompt;
  all.insert(all.end(), r.tokens.begin(), r.tokens.end());
  return all;
}

// Attention sinks: a 150-token prompt (2.3x the context) is evicted to the
// host tier whole (its middle blocks were released to the LRU list while it
// decoded, then evicted like the rest); coming back, it onloads the sink
// block and the window's two blocks and nothing between them.
TEST(EngineTiersModesTest, StreamingOnloadsItsSinkAndWindowBlocksOnly) {
  testing::LoadedCpuModel l = testing::LoadCpuModel(Dir(), Streaming());
  ASSERT_NE(l.model, nullptr);
  const auto prompt = RandomTokens(150, 512, 7);
  std::vector<std::vector<TokenId>> others;
  for (uint32_t i = 0; i < 3; ++i) others.push_back(RandomTokens(150, 512, 20 + i));
  auto plain = MakeEngine(l.model.get(), 64, 0);
  ASSERT_NE(plain, nullptr);
  const Result want = RunGreedy(*plain, 1, prompt, 8);

  auto e = MakeEngine(l.model.get(), 12, 64);
  ASSERT_NE(e, nullptr);
  std::vector<std::vector<TokenId>> ran;
  const Result first = RunGreedy(*e, 1, prompt, 8);
  ExpectSame(first, want);
  ran.push_back(Joined(prompt, first));
  RequestId id = 2;
  for (const auto& p : others) ran.push_back(Joined(p, RunGreedy(*e, id++, p, 8)));
  Settle(*e);
  const auto hashes = HashPrompt(BlockHashSeed(l.model->model_id()),
                                 std::span(prompt).first(prompt.size() - 1), 16);
  ASSERT_EQ(hashes.size(), 9u);
  EXPECT_EQ(e->block_manager().FindCachedPrefix(hashes), 0u) << "the pool still holds it";
  // The host tier holds every block of it, the released middle ones too.
  const KvCacheSnapshot snap = e->block_manager().Snapshot();
  const std::unordered_set<BlockHash> host(snap.host_block_hashes.begin(),
                                           snap.host_block_hashes.end());
  for (BlockHash h : hashes) EXPECT_TRUE(host.count(h));
  (void)e->TakeTierOnloads();

  const int64_t hits_before = e->GetStats().tiers.host_hit_tokens;
  const Result again = RunGreedy(*e, id++, prompt, 8);
  ExpectSame(again, want);
  EXPECT_EQ(again.cached, 144) << "the whole 9-block prefix is usable";
  const auto onloads = e->TakeTierOnloads();
  ASSERT_EQ(onloads.size(), 1u);
  // Sink block 0 and the window's blocks 7 and 8 (the query at 144 reaches
  // 113..143): blocks 1..6 stay down.
  EXPECT_EQ(onloads[0].blocks, 3);
  EXPECT_EQ(e->GetStats().tiers.host_hit_tokens - hits_before, 3 * 16);
  ExpectTiersHoldOnlyCommittedBlocks(*e, ran);
  EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u) << "a block stayed held";
  EXPECT_TRUE(e->block_manager().CheckInvariants().ok());
}

// SnapKV: the full prompt's blocks go down (they were committed), the
// compressed private ones never do; a repeated prompt onloads its prefix up
// to the observation window, computes the rest, keeps the same positions
// and decodes the same tokens.
TEST(EngineTiersModesTest, SnapKvOnloadsThePromptBlocksAndCompressesAlike) {
  testing::LoadedCpuModel l = testing::LoadCpuModel(LongDir(), SnapKv());
  ASSERT_NE(l.model, nullptr);
  const auto prompt = RandomTokens(97, 512, 8);
  auto plain = MakeEngine(l.model.get(), 64, 0);
  ASSERT_NE(plain, nullptr);
  const Result want = RunGreedy(*plain, 1, prompt, 10);
  ASSERT_FALSE(want.kept.empty()) << "the prompt was not compressed";

  auto e = MakeEngine(l.model.get(), 12, 64);
  ASSERT_NE(e, nullptr);
  std::vector<std::vector<TokenId>> ran;
  const Result first = RunGreedy(*e, 1, prompt, 10);
  ExpectSame(first, want);
  EXPECT_EQ(first.kept, want.kept);
  ran.push_back(Joined(prompt, first));
  RequestId id = 2;
  for (uint32_t i = 0; i < 3; ++i) {
    const auto p = RandomTokens(97, 512, 30 + i);
    ran.push_back(Joined(p, RunGreedy(*e, id++, p, 10)));
  }
  Settle(*e);
  EXPECT_GT(e->GetStats().tiers.offloaded_blocks, 0);
  ExpectTiersHoldOnlyCommittedBlocks(*e, ran);
  (void)e->TakeTierOnloads();

  const int64_t hits_before = e->GetStats().tiers.host_hit_tokens;
  const Result again = RunGreedy(*e, id++, prompt, 10);
  ExpectSame(again, want);
  EXPECT_EQ(again.kept, want.kept);
  // (97 - 8) / 16 = 5 blocks before the observation window come back.
  EXPECT_EQ(again.cached, 80);
  EXPECT_EQ(e->GetStats().tiers.host_hit_tokens - hits_before, 80);
  const auto onloads = e->TakeTierOnloads();
  ASSERT_EQ(onloads.size(), 1u);
  EXPECT_EQ(onloads[0].blocks, 5);
  EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u);
}

// Quest: the onloaded blocks' key bounds are computed from their keys, so
// 40 decode steps over a prompt of 9 full blocks select what the engine
// without tiers selects. (Without the bounds the blocks would keep those of
// whatever the pool held there before.)
TEST(EngineTiersModesTest, QuestSelectsByTheBoundsOfOnloadedBlocks) {
  // Layers past the two Quest leaves dense; its blocks are `x` times the
  // preset's, which MakeEngine's counts are in.
  const ModelSpec spec = testing::TinyForQuest();
  const int64_t x = spec.num_layers / PresetModelSpec("tiny")->num_layers;
  const std::string dir = testing::ModelDir("tiers-modes-quest", spec);
  testing::LoadedCpuModel l = testing::LoadCpuModel(dir, Quest());
  ASSERT_NE(l.model, nullptr);
  testing::LoadedCpuModel dense = testing::LoadCpuModel(dir);
  ASSERT_NE(dense.model, nullptr);
  const auto prompt = RandomTokens(150, 512, 9);
  auto plain = MakeEngine(l.model.get(), 64 * x, 0);
  ASSERT_NE(plain, nullptr);
  const Result want = RunGreedy(*plain, 1, prompt, 40);
  auto dense_engine = MakeEngine(dense.model.get(), 64 * x, 0);
  ASSERT_NE(dense_engine, nullptr);
  EXPECT_NE(RunGreedy(*dense_engine, 1, prompt, 40).tokens, want.tokens)
      << "the selection should matter for this prompt";

  auto e = MakeEngine(l.model.get(), 16 * x, 64 * x);
  ASSERT_NE(e, nullptr);
  ExpectSame(RunGreedy(*e, 1, prompt, 40), want);
  RequestId id = 2;
  for (uint32_t i = 0; i < 3; ++i) (void)RunGreedy(*e, id++, RandomTokens(150, 512, 40 + i), 40);
  Settle(*e);
  const int64_t hits_before = e->GetStats().tiers.host_hit_tokens;
  const Result again = RunGreedy(*e, id++, prompt, 40);
  EXPECT_EQ(e->GetStats().tiers.host_hit_tokens - hits_before, 144);
  EXPECT_EQ(again.cached, 144);
  ExpectSame(again, want);
}

// A disk tier alone, streaming: a restarted engine on the same folder
// announces the blocks it finds and serves the prompt's sink and window
// blocks from there.
TEST(EngineTiersModesTest, StreamingComesBackWarmFromTheDisk) {
  testing::LoadedCpuModel l = testing::LoadCpuModel(Dir(), Streaming());
  ASSERT_NE(l.model, nullptr);
  const std::string dir = testing::NewTempDir("tiers-modes-disk");
  const auto prompt = RandomTokens(150, 512, 11);
  auto plain = MakeEngine(l.model.get(), 64, 0);
  ASSERT_NE(plain, nullptr);
  const Result want = RunGreedy(*plain, 1, prompt, 8);
  {
    auto e = MakeEngine(l.model.get(), 12, 0, dir);
    ASSERT_NE(e, nullptr);
    ExpectSame(RunGreedy(*e, 1, prompt, 8), want);
    for (uint32_t i = 0; i < 3; ++i) (void)RunGreedy(*e, 2 + i, RandomTokens(150, 512, 50 + i), 8);
    Settle(*e);
    EXPECT_GT(e->GetStats().tiers.store.disk.blocks, 0);
  }
  auto e = MakeEngine(l.model.get(), 12, 0, dir);
  ASSERT_NE(e, nullptr);
  EXPECT_FALSE(e->block_manager().Snapshot().disk_block_hashes.empty());
  const Result again = RunGreedy(*e, 1, prompt, 8);
  ExpectSame(again, want);
  EXPECT_EQ(again.cached, 144);
  EXPECT_EQ(e->GetStats().tiers.disk_hit_tokens, 3 * 16);
}

}  // namespace
}  // namespace pdserve
