// The router's prediction for a streaming worker (--kv-eviction streaming)
// with a host tier, against the engine's own rule: a real CPU engine runs
// a prompt, other prompts push some or all of its blocks down to the host
// tier, and a RouterCore fed with nothing but the engine's KV events
// predicts the prompt's next admission. Predicted device hits, host hits
// (only the sink and window blocks come back) and tokens left to compute
// must equal what the engine then counts. The same for a model with
// several layer groups (gemma2's full and sliding-window layers).
#include <gtest/gtest.h>

#include <thread>

#include "common/block_hash.h"
#include "engine/engine.h"
#include "services/router/router_core.h"
#include "tests/support/kv_eviction_modes.h"
#include "tests/support/numerics.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using router::RouteDecision;
using router::RouterCore;
using router::RouteRequest;
using router::RouterOptions;
using testing::RandomTokens;

constexpr int64_t kB = 16;
constexpr int64_t kBlockBytes = 8 << 10;  // the tiny preset, fp32 KV, 16 tokens per block

// The tiny preset with a context of 64, which streaming runs past.
std::string Dir() {
  ModelSpec s = *PresetModelSpec("tiny");
  s.max_position_embeddings = 64;
  s.name = "tiers-modes-tiny";
  return testing::ModelDir("tiers-modes", s);
}

// One greedy request run to the end; returns its first output's cached tokens.
int64_t Run(Engine& e, RequestId id, const std::vector<TokenId>& prompt, int max_tokens) {
  EngineRequest r;
  r.id = id;
  r.prompt = prompt;
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
  int64_t cached = -1;
  for (int guard = 0; e.HasUnfinished() && guard < 100000; ++guard) {
    auto step = e.Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step) {
      if (cached < 0 && !o.new_token_ids.empty()) cached = o.num_cached_tokens;
    }
    if (step->empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return cached;
}

// Steps until every evicted block is in the tier (and its event recorded).
void Settle(Engine& e) {
  for (int i = 0; i < 2000 && e.GetStats().tiers.offloads_queued > 0; ++i) {
    (void)e.Step();
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  (void)e.Step();
}

struct Counts {
  int64_t device = 0, host = 0, computed = 0;
};

struct TierCase {
  std::string dir;
  KvEviction eviction;
  int64_t pool_bytes = 0, host_bytes = 0;
};

// Streaming, 4 sinks + 32, a 12-block pool: after `prompt`, no other
// prompt of 150 tokens leaves it all on the device, one a mix, three all
// of it in the host tier.
TierCase StreamingCase() {
  return {Dir(), testing::Streaming(4, 32), 12 * kBlockBytes, 64 * kBlockBytes};
}

void ExpectPredictedEqualsActual(const TierCase& c, int64_t prompt_tokens, int others,
                                 Counts* seen) {
  SCOPED_TRACE("prompt " + std::to_string(prompt_tokens) + ", " + std::to_string(others) +
               " other prompts");
  testing::LoadedCpuModel l = testing::LoadCpuModel(c.dir, c.eviction);
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.kv_cache_bytes = c.pool_bytes;
  o.kv_host_cache_bytes = c.host_bytes;
  o.record_kv_events = true;
  auto created = Engine::Create(l.model.get(), o);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  Engine& e = **created;
  const BlockManager& bm = e.block_manager();

  RouterOptions ro;
  ro.policy = "kv";
  ro.block_tokens = kB;
  ro.pending_ttl_us = 0;
  auto core = RouterCore::Create(ro);
  ASSERT_TRUE(core.ok()) << core.status().ToString();
  (*core)->SetKvGroupWindows(bm.group_windows(), static_cast<int64_t>(bm.sink_tokens()));
  auto w = (*core)->AddWorker("w0", Role::kBoth);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE((*core)->OnSnapshot(*w, 0, {}).ok());

  const auto prompt = RandomTokens(prompt_tokens, 512, 7);
  RequestId id = 1;
  Run(e, id++, prompt, 8);
  for (int i = 0; i < others; ++i) Run(e, id++, RandomTokens(150, 512, 20 + i), 8);
  Settle(e);
  for (const KvEventBatch& b : e.block_manager().DrainEvents()) {
    ASSERT_EQ((*core)->OnKvEvents(*w, b), router::ApplyOutcome::kApplied);
  }

  const auto hashes = HashPrompt(BlockHashSeed(l.model->model_id()), prompt, kB);
  RouteRequest r;
  r.request_id = 1;
  r.block_hashes = hashes;
  r.prompt_tokens = prompt_tokens;
  r.max_new_tokens = 8;
  auto d = (*core)->Route(r);
  ASSERT_TRUE(d.ok()) << d.status().ToString();

  const uint64_t device_before = e.GetStats().blocks.prefix_cache_hit_tokens;
  const int64_t host_before = e.GetStats().tiers.host_hit_tokens;
  const int64_t cached = Run(e, id++, prompt, 8);
  const Counts actual{
      static_cast<int64_t>(e.GetStats().blocks.prefix_cache_hit_tokens - device_before),
      e.GetStats().tiers.host_hit_tokens - host_before, prompt_tokens - cached};
  EXPECT_EQ(d->decode_overlap_blocks * kB, actual.device);
  EXPECT_EQ(d->prefill_host_blocks * kB, actual.host);
  EXPECT_EQ(d->prefill_disk_blocks, 0);
  EXPECT_EQ(d->prefill_tokens, actual.computed);
  seen->device += actual.device;
  seen->host += actual.host;
  seen->computed += actual.computed;
}

TEST(StreamingTierPredictionTest, PredictedHitsEqualTheEnginesWithBlocksInTheHostTier) {
  Counts seen;
  // 150 and 120 tokens: 9 and 7 full blocks, the window (32) reaching 2 or
  // 3 blocks back from the last full one, the sink block first.
  for (int64_t p : {150, 120}) {
    for (int others : {0, 1, 2, 3}) ExpectPredictedEqualsActual(StreamingCase(), p, others, &seen);
  }
  // The runs covered device hits and host hits.
  EXPECT_GT(seen.device, 0);
  EXPECT_GT(seen.host, 0);
}

// All of a 150-token prompt in the host tier: its 144 prefix tokens are
// usable, and only the 3 blocks copied back (the sink block and the
// window's two) count as host hits, as the router predicts.
TEST(StreamingTierPredictionTest, OnlyTheSinkAndWindowBlocksCountAsHostHits) {
  Counts seen;
  ExpectPredictedEqualsActual(StreamingCase(), 150, 3, &seen);
  EXPECT_EQ(seen.device, 0);
  EXPECT_EQ(seen.host, 3 * kB);
  EXPECT_EQ(seen.computed, 150 - 144);
}

// The same rule for a model with several layer groups (gemma2: full and
// sliding-window layers, no sinks): every full group's block comes back,
// the windowed group's only within the first query's reach.
TEST(StreamingTierPredictionTest, PredictedHitsEqualTheEnginesForSlidingWindowGroups) {
  const TierCase gemma{
      testing::ModelDir("gemma2", *PresetModelSpec("gemma2")), {}, 40 * 16384, 200 * 16384};
  Counts seen;
  for (int others : {0, 1, 2, 4}) ExpectPredictedEqualsActual(gemma, 150, others, &seen);
  EXPECT_GT(seen.device, 0);
  EXPECT_GT(seen.host, 0);
}

}  // namespace
}  // namespace pdserve
