// Attention sinks (--kv-eviction streaming): the engine against the float64
// reference implementing StreamingLLM's rule as the paper states it (keys
// cached before RoPE, re-rotated by their rank in the cache), across sink
// counts inside and beyond a block, windows, block sizes and prefill
// chunks; generation through the engine in a pool whose released blocks are
// reused; the blocks a sequence holds against the sinks + window bound;
// prefix-cache hits of a repeated prompt by the sinks rule; the real model
// stories260K running 6,000 tokens (12x its trained context) in a bounded
// pool; and every refusal, naming its flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "common/kv_eviction.h"
#include "common/kv_groups.h"
#include "engine/engine.h"
#include "engine/text_eval.h"
#include "kernels/cpu/cpu_backend.h"
#include "services/router/prefix_index.h"
#include "tests/support/kv_eviction_modes.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/reference_tokens.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::LogSoftmax;
using testing::RandomTokens;

using testing::KvEvictionRule;
using testing::ReferenceModel;

// The tiny preset with a short trained context, so that the tests run past it.
ModelSpec Spec() {
  ModelSpec s = *PresetModelSpec("tiny");
  s.max_position_embeddings = 64;
  s.name = "streaming-tiny";
  return s;
}

using Loaded = testing::LoadedCpuModel;

Loaded Load(const KvEviction& e, const std::string& dir = testing::ModelDir("streaming", Spec())) {
  return testing::LoadCpuModel(dir, e);
}

std::unique_ptr<ReferenceModel> Reference() {
  return testing::LoadReference(testing::ModelDir("streaming", Spec()));
}

// Every position's NLL through the paged pool (a prefill chunk, then chunks)
// equals the reference's under the same rule, 150 tokens (2.3x the model's
// context): sinks inside one block, sinks spanning blocks, no sinks (a
// plain window), windows at and off block boundaries.
TEST(EngineStreamingTest, MatchesTheReferenceRule) {
  const auto ref = Reference();
  ASSERT_NE(ref, nullptr);
  const auto tokens = RandomTokens(150, Spec().vocab_size(), 1);
  for (auto [sinks, window] : {std::pair{4, 16}, std::pair{4, 23}, std::pair{20, 17},
                               std::pair{0, 16}, std::pair{1, 40}}) {
    SCOPED_TRACE("sinks " + std::to_string(sinks) + " window " + std::to_string(window));
    Loaded l = Load(testing::Streaming(sinks, window));
    ASSERT_NE(l.model, nullptr);
    const auto logits = ref->Forward(tokens, {}, KvEvictionRule{sinks, window});
    for (auto [block, prefill, chunk] :
         {std::tuple{16, 20, 1}, std::tuple{5, 13, 7}, std::tuple{8, 70, 16}}) {
      SCOPED_TRACE("block " + std::to_string(block) + " prefill " + std::to_string(prefill) +
                   " chunk " + std::to_string(chunk));
      TextEvalOptions o;
      o.block_size = block;
      o.prefill_tokens = prefill;
      o.decode_chunk = chunk;
      auto r = EvaluateText(l.model.get(), tokens, o);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_EQ(r->token_nll.size(), tokens.size() - 1);
      for (size_t t = 0; t + 1 < tokens.size(); ++t) {
        ASSERT_NEAR(r->token_nll[t], -LogSoftmax(logits[t])[tokens[t + 1]], 1e-4)
            << "position " << t;
      }
    }
  }
  // The rule matters: sinks change the distribution once the window has
  // left them, and re-rotating them differs from keeping their positions.
  const auto with = ref->Forward(tokens, {}, {4, 16}), without = ref->Forward(tokens, {}, {0, 16});
  EXPECT_GT(std::fabs(with[100][3] - without[100][3]), 1e-4);
  EXPECT_LT(std::fabs(with[10][3] - without[10][3]), 1e-12);  // window still holds everything
}

struct Generated {
  std::vector<SampledToken> sampled;
  int64_t cached_tokens = 0;
  size_t most_held = 0;
  int64_t blocks_released = 0;  // RequestOutput::kv_blocks_released
};

size_t Held(Engine& e, RequestId id) {
  const auto& t = e.block_manager().BlockTable(id);
  return static_cast<size_t>(
      std::count_if(t.begin(), t.end(), [](BlockId b) { return b != kNoBlock; }));
}

// Runs `prompts` together (ids 1, 2, ...), greedy, recording the most
// blocks any of them held after a step.
std::vector<Generated> Generate(Engine& e, const std::vector<std::vector<int32_t>>& prompts,
                                int max_tokens, RequestId first_id = 1) {
  std::vector<Generated> out(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    EngineRequest r;
    r.id = first_id + i;
    r.prompt = prompts[i];
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.logprobs = 0;
    EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
  }
  while (e.HasUnfinished()) {
    auto step = e.Step();
    EXPECT_TRUE(step.ok()) << step.status().ToString();
    if (!step.ok()) break;
    for (const auto& o : *step) {
      Generated& g = out[o.id - first_id];
      if (!o.new_token_ids.empty() && g.sampled.empty()) g.cached_tokens = o.num_cached_tokens;
      g.sampled.insert(g.sampled.end(), o.logprobs.begin(), o.logprobs.end());
      if (o.finished) g.blocks_released = o.kv_blocks_released;
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (e.block_manager().HasSequence(first_id + i)) {
        out[i].most_held = std::max(out[i].most_held, Held(e, first_id + i));
      }
    }
  }
  return out;
}

void ExpectReferenceTokens(const ReferenceModel& ref, const KvEvictionRule& rule,
                           const std::vector<int32_t>& prompt, const Generated& g) {
  testing::ExpectReferenceTokens(ref.Forward(testing::WithSampled(prompt, g.sampled), {}, rule),
                                 prompt.size(), g.sampled);
}

// Two sequences decode 200 tokens each (3x the model's context) in a pool
// of 12 blocks, which the dense model outgrows at 6 blocks each: blocks
// between the sinks and the window are released and handed to the other
// sequence, so a kernel reading them would see the other's keys. Each
// sequence's tokens and logprobs are the reference's, and it never holds
// more than the sink blocks + the window's blocks + one chunk's.
TEST(EngineStreamingTest, GenerationReleasesTheMiddleAndMatchesTheReference) {
  const auto ref = Reference();
  ASSERT_NE(ref, nullptr);
  const int64_t S = 4, N = 16, B = 4, chunk = 8;
  Loaded l = Load(testing::Streaming(S, N));
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.block_size = B;
  o.max_num_batched_tokens = chunk;
  o.kv_cache_bytes = 12 * l.model->config().num_layers * 2 * l.model->config().num_kv_heads *
                     l.model->config().head_dim * B * 4;
  auto e = Engine::Create(l.model.get(), o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  ASSERT_EQ((*e)->kv_pool().num_blocks(), 12);
  const std::vector<std::vector<int32_t>> prompts = {RandomTokens(10, Spec().vocab_size(), 2),
                                                     RandomTokens(7, Spec().vocab_size(), 3)};
  const auto g = Generate(**e, prompts, 200);
  const size_t sink_blocks = SinkBlocks(S, B), window_blocks = (N - 1 + B - 1) / B + 1;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE("sequence " + std::to_string(i));
    ASSERT_EQ(g[i].sampled.size(), 200u);
    ExpectReferenceTokens(*ref, {S, N}, prompts[i], g[i]);
    EXPECT_LE(g[i].most_held, sink_blocks + window_blocks + (chunk + B - 1) / B);
  }
  EXPECT_EQ((*e)->GetStats().num_preemptions, 0u);
  ASSERT_TRUE((*e)->block_manager().CheckInvariants().ok());
}

// A prefill worker's job in one chunk: the blocks the first decode query
// does not reach are released when the job ends and counted as evicted,
// as a decoding sequence's are, and what it hands off is exactly what a
// decode worker reserves for the prompt (its AddRemotePrefillRequest).
TEST(EngineStreamingTest, APrefillJobReleasesAndCountsWhatItDoesNotHandOff) {
  const int64_t S = 4, N = 16, B = 8, P = 100;
  Loaded l = Load(testing::Streaming(S, N));
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.block_size = B;
  o.max_num_batched_tokens = 128;  // the prompt in one chunk
  auto prefill = Engine::Create(l.model.get(), o);
  auto decode = Engine::Create(l.model.get(), o);
  ASSERT_TRUE(prefill.ok() && decode.ok());
  EngineRequest r;
  r.id = 1;
  r.prompt = RandomTokens(P, Spec().vocab_size(), 5);
  r.params.max_tokens = 4;
  r.params.temperature = 0;
  auto plan = (*decode)->AddRemotePrefillRequest(r);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  r.prefill_only = true;
  ASSERT_TRUE((*prefill)->AddRequest(r).ok());
  RequestOutput last;
  while ((*prefill)->HasUnfinished()) {
    auto step = (*prefill)->Step();
    ASSERT_TRUE(step.ok());
    for (const auto& out : *step) {
      if (out.finished) last = out;
    }
  }
  ASSERT_TRUE(last.kv_pin.has_value());
  auto indices = [](const std::vector<BlockSlot>& slots) {
    std::vector<size_t> i;
    for (const BlockSlot& s : slots) i.push_back(s.index);
    return i;
  };
  EXPECT_EQ(indices(last.kv_slots), indices(plan->fill));
  const uint64_t table = (P + B - 1) / B;  // 13 blocks computed
  EXPECT_LT(last.kv_slots.size(), table);
  EXPECT_EQ((*prefill)->block_manager().GetStats().released_out_of_reach_blocks_total,
            table - last.kv_slots.size());
  ASSERT_TRUE((*prefill)->ReleaseKvBlocks(*last.kv_pin).ok());
  EXPECT_EQ((*prefill)->GetStats().blocks.used_blocks, 0u);
  ASSERT_TRUE((*prefill)->block_manager().CheckInvariants().ok());
}

// A repeated prompt longer than the window: the second request reuses the
// prefix the sinks rule says is usable (the sink blocks and the window's,
// the middle released but still cached), equal to CachedPrefixBlocks over
// what the engine caches and to the router's prediction from the KV events;
// evicting a sink block then takes the hit away entirely.
TEST(EngineStreamingTest, RepeatedPromptHitsAndTheRouterPredictsIt) {
  const auto ref = Reference();
  ASSERT_NE(ref, nullptr);
  const int64_t S = 4, N = 32, B = 16;
  Loaded l = Load(testing::Streaming(S, N));
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.kv_cache_bytes = 8 << 20;
  o.max_num_batched_tokens = 32;
  o.record_kv_events = true;
  auto created = Engine::Create(l.model.get(), o);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  Engine& e = **created;
  BlockManager& bm = e.block_manager();
  const auto prompt = RandomTokens(150, Spec().vocab_size(), 7);
  const auto hashes =
      HashPrompt(BlockHashSeed(l.model->model_id()), std::span(prompt).first(prompt.size() - 1), B);
  router::PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0).ok());
  ASSERT_TRUE(index.ApplySnapshot(0, 0, {}).ok());
  auto predicted = [&] {
    for (const auto& b : bm.DrainEvents()) {
      EXPECT_EQ(index.ApplyEvents(0, b), router::ApplyOutcome::kApplied);
    }
    std::vector<uint32_t> out;
    index.GroupedOverlap(hashes, bm.group_windows(), B, 0, &out, S);
    return static_cast<int64_t>(out[0]) * B;
  };
  auto rule_hit = [&] {
    return static_cast<int64_t>(CachedPrefixBlocks(
               bm.group_windows(), B, hashes.size(),
               [&](size_t g, size_t i) { return bm.IsCached(hashes[i], static_cast<uint32_t>(g)); },
               S)) *
           B;
  };
  const auto first = Generate(e, {prompt}, 3, 1);
  EXPECT_EQ(first[0].cached_tokens, 0);
  EXPECT_EQ(rule_hit(), 144);
  EXPECT_EQ(predicted(), 144);
  const auto second = Generate(e, {prompt}, 3, 2);
  EXPECT_EQ(second[0].cached_tokens, 144);
  ExpectReferenceTokens(*ref, {S, N}, prompt, second[0]);
  // Evict until the sink block goes: the middle blocks (least recently
  // released) go first and keep the hit; without the sink block no prefix
  // past it is usable.
  while (bm.IsCached(hashes[0], 0)) {
    ASSERT_EQ(bm.Evict(1), 1u);
    EXPECT_EQ(predicted(), rule_hit());
  }
  EXPECT_EQ(rule_hit(), 0);
  EXPECT_EQ(predicted(), 0);
  const auto third = Generate(e, {prompt}, 3, 3);
  EXPECT_EQ(third[0].cached_tokens, 0);
  ExpectReferenceTokens(*ref, {S, N}, prompt, third[0]);
}

// The real model (trained context 512) generates 6,000 tokens with 4 sinks
// and a window of 252: the sequence never holds more than the blocks of
// sinks + window (+ the current one), and every logprob is finite.
TEST(EngineStreamingTest, RealModelRunsFarPastItsContextInBoundedBlocks) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty()) GTEST_SKIP() << "the real model stories260K is absent";
  const int64_t S = 4, N = 252, B = 16;
  Loaded l = Load(testing::Streaming(S, N), dir);
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.block_size = B;
  o.kv_cache_bytes = 64 << 20;
  auto e = Engine::Create(l.model.get(), o);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  const auto g = Generate(**e, {{1, 403, 407}}, 6000);
  ASSERT_EQ(g[0].sampled.size(), 6000u);
  for (const auto& s : g[0].sampled) ASSERT_TRUE(std::isfinite(s.logprob));
  const size_t bound = SinkBlocks(S, B) + (N - 1 + B - 1) / B + 1;  // 1 + 16 + 1 = 18 blocks
  EXPECT_LE(g[0].most_held, bound);
  EXPECT_GE(g[0].most_held, bound - 1);
  // What it saved: every entry of its table (the KV of its 6,002 tokens
  // before the last) but the sink and window blocks it held at the end.
  const auto entries = static_cast<int64_t>((3 + 6000 - 1 + B - 1) / B);
  EXPECT_GE(g[0].blocks_released, entries - static_cast<int64_t>(bound));
  EXPECT_LE(g[0].blocks_released, entries - static_cast<int64_t>(bound) + 1);
  EXPECT_EQ((*e)->block_manager().GetStats().released_out_of_reach_blocks_total,
            static_cast<uint64_t>(g[0].blocks_released));
}

// Bad modes and budgets are refused naming the flag.
TEST(EngineStreamingTest, RefusesWhatItCannotRun) {
  const std::string dir = testing::ModelDir("streaming", Spec());
  kernels::CpuBackend backend(1);
  auto refused = [&](const std::string& model_dir, const KvEviction& e) {
    auto m = Model::Load(model_dir, &backend, LoadFormat::kSafetensors, e);
    EXPECT_FALSE(m.ok());
    return m.ok() ? std::string() : m.status().message();
  };
  EXPECT_NE(refused(dir, testing::Streaming(4, 0)).find("--kv-window-tokens"), std::string::npos);
  EXPECT_NE(refused(dir, testing::Streaming(-1, 16)).find("--kv-sink-tokens"), std::string::npos);
  EXPECT_NE(refused(dir, testing::Streaming(4, 61)).find("max_position_embeddings"),
            std::string::npos);
  EXPECT_NE(refused(testing::ModelDir("mla", *PresetModelSpec("deepseek-v2-lite")),
                    testing::Streaming(4, 16))
                .find("MLA"),
            std::string::npos);
  EXPECT_NE(refused(testing::ModelDir("mistral-window", *PresetModelSpec("mistral-window")),
                    testing::Streaming(4, 16))
                .find("sliding-window"),
            std::string::npos);
  // Budgets against the block size and the pool.
  Loaded l = Load(testing::Streaming(4, 12));
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  auto small_window = Engine::Create(l.model.get(), o);
  ASSERT_FALSE(small_window.ok());
  EXPECT_NE(small_window.status().message().find("smaller than one block"), std::string::npos);
  Loaded big = Load(testing::Streaming(4, 48));
  ASSERT_NE(big.model, nullptr);
  o.kv_cache_bytes = 3 * big.model->config().num_layers * 2 * big.model->config().num_kv_heads *
                     big.model->config().head_dim * 16 * 4;
  auto too_big = Engine::Create(big.model.get(), o);
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find("--kv-window-tokens"), std::string::npos);
  EXPECT_NE(too_big.status().message().find("more than the KV pool"), std::string::npos);
}

}  // namespace
}  // namespace pdserve
