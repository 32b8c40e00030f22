// Sliding-window models in the engine: windowed attention against the
// float64 reference (tests/support/reference_model) at windows smaller than,
// equal to and larger than the context, across prefill chunks and block
// boundaries, GQA groups and every KV dtype; each windowed preset (Gemma-2,
// Gemma-3, Mistral with a window, Qwen2 windowing its last layers) against
// the reference, greedy tokens and logprobs; the pool holding only the
// window's blocks of windowed layers while a sequence runs to 8x its
// window, in a pool too small for the dense model; prefix-cache hits of a
// repeated prompt by the windowed rule, which the router's index predicts
// from the engine's KV events; and disaggregated prefill moving only the
// blocks the decode side keeps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <unordered_set>

#include "common/kv_groups.h"
#include "engine/engine.h"
#include "engine/text_eval.h"
#include "kernels/cpu/cpu_backend.h"
#include "services/router/prefix_index.h"
#include "services/router/router_core.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/reference_tokens.h"
#include "tests/support/snapkv_runs.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::LogSoftmax;
using testing::RandomTokens;

using testing::KvRounding;
using testing::ReferenceModel;

constexpr double kNllTolerance = 1e-4;

using Loaded = testing::LoadedCpuModel;

Loaded Load(const std::string& name, const ModelSpec& spec) {
  return testing::LoadCpuModelAndReference(testing::ModelDir(name, spec));
}

// A Mistral-shaped model windowing every layer at `window`.
ModelSpec Mistral(int64_t window, int64_t kv_heads = 2) {
  ModelSpec s = *PresetModelSpec("mistral-window");
  s.sliding_window = window;
  s.num_kv_heads = kv_heads;
  s.name = "mistral-w" + std::to_string(window) + "-kv" + std::to_string(kv_heads);
  return s;
}

// The engine's per-position NLL (EvaluateText: a paged pool, prefill then
// chunks) against the reference's, K/V rounded as the cache stores them.
void CheckNll(Loaded& l, const std::vector<int32_t>& tokens, const TextEvalOptions& o,
              const KvRounding& kv, double tolerance) {
  auto r = EvaluateText(l.model.get(), tokens, o);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  const auto logits = l.reference->Forward(tokens, kv);
  ASSERT_EQ(r->token_nll.size(), tokens.size() - 1);
  for (size_t t = 0; t + 1 < tokens.size(); ++t) {
    const double expected = -LogSoftmax(logits[t])[tokens[t + 1]];
    ASSERT_NEAR(r->token_nll[t], expected, tolerance) << "position " << t;
  }
}

// Windows of 5 (inside a block), 16 (one block), 17, 90 (the whole text) and
// 200 (longer than it), chunks that cross blocks and windows, GQA groups of
// 2 and 4: every position's distribution is the reference's.
TEST(EngineWindowsTest, WindowedAttentionMatchesTheReference) {
  const auto tokens = RandomTokens(90, Mistral(5).vocab_size(), 1);
  for (const int64_t window : {5, 16, 17, 90, 200}) {
    for (const int64_t kv_heads : {2, 1}) {
      if (kv_heads == 1 && window != 17) continue;
      SCOPED_TRACE("window " + std::to_string(window) + " kv_heads " + std::to_string(kv_heads));
      Loaded l = Load("w" + std::to_string(window) + "kv" + std::to_string(kv_heads),
                      Mistral(window, kv_heads));
      ASSERT_NE(l.model, nullptr);
      for (auto [block, prefill, chunk] :
           {std::tuple{16, 20, 1}, std::tuple{5, 13, 7}, std::tuple{4, 33, 16}}) {
        SCOPED_TRACE("block " + std::to_string(block) + " prefill " + std::to_string(prefill) +
                     " chunk " + std::to_string(chunk));
        TextEvalOptions o;
        o.block_size = block;
        o.prefill_tokens = prefill;
        o.decode_chunk = chunk;
        CheckNll(l, tokens, o, {}, kNllTolerance);
      }
    }
  }
  // A window that changes nothing is full attention: window 200 agrees with
  // the same weights without a window, while window 5 does not.
  Loaded narrow = Load("w5kv2", Mistral(5)), wide = Load("w200kv2", Mistral(200));
  const auto a = narrow.reference->Forward(tokens), b = wide.reference->Forward(tokens);
  EXPECT_GT(std::fabs(a[60][3] - b[60][3]), 1e-3);
}

// Every KV dtype: fp16, bf16, fp8 (e4m3, e5m2) and nvfp4 against the
// reference that rounds K/V as the cache does (one prefill chunk, then a
// token per step). fp16's steps are the finest (2^-11 relative): the
// engine's fp32 arithmetic and the float64 reference can put a K or V
// element on either side of a rounding boundary, which here moves a few
// positions' NLL by up to 4e-4 (seen when the MLP's SiLU went from libm's
// exp to a vectorised one, both within 3 units in the last place). The
// coarser formats' boundaries are 8x to 256x farther apart and are not
// crossed by this model.
TEST(EngineWindowsTest, EveryKvDtype) {
  Loaded l = Load("w17kv2", Mistral(17));
  ASSERT_NE(l.model, nullptr);
  const auto tokens = RandomTokens(60, l.model->config().vocab_size, 2);
  struct Case {
    DType dtype;
    KvRounding::Type type;
    double tolerance;
  };
  for (auto [dtype, type, tolerance] :
       {Case{DType::kBF16, KvRounding::Type::kBF16, kNllTolerance},
        Case{DType::kFP8E4M3, KvRounding::Type::kFP8E4M3, kNllTolerance},
        Case{DType::kFP8E5M2, KvRounding::Type::kFP8E5M2, kNllTolerance},
        Case{DType::kNvFp4, KvRounding::Type::kNvFp4, kNllTolerance},
        Case{DType::kF16, KvRounding::Type::kF16, 1e-3}}) {
    SCOPED_TRACE(std::string(DTypeName(dtype)));
    TextEvalOptions o;
    o.kv_dtype = dtype;
    o.block_size = 16;
    o.prefill_tokens = 24;
    o.decode_chunk = 1;
    KvRounding kv;
    kv.type = type;
    kv.block_size = 16;
    kv.first_chunk = 24;
    CheckNll(l, tokens, o, kv, tolerance);
  }
}

// Greedy generation through the engine (chunked prefill, blocks released as
// the windows move): every token is the reference's argmax given the same
// history (up to near ties) and its logprob the reference's.
using testing::Generate;
using testing::Generated;

void ExpectReferenceTokens(const ReferenceModel& ref, const std::vector<int32_t>& prompt,
                           const Generated& g) {
  testing::ExpectReferenceTokens(ref.Forward(testing::WithSampled(prompt, g.sampled)),
                                 prompt.size(), g.sampled);
}

std::unique_ptr<Engine> MakeEngine(Model* model, int64_t kv_bytes, int64_t chunk = 16,
                                   bool record_kv_events = false) {
  EngineOptions o;
  o.kv_cache_bytes = kv_bytes;
  o.max_num_batched_tokens = chunk;
  o.record_kv_events = record_kv_events;
  auto e = Engine::Create(model, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

TEST(EngineWindowsTest, PresetsMatchTheReference) {
  for (const char* preset :
       {"gemma2", "gemma3", "mistral-window", "qwen2-window", "qwen3-window"}) {
    SCOPED_TRACE(preset);
    Loaded l = Load(preset, *PresetModelSpec(preset));
    ASSERT_NE(l.model, nullptr);
    // Qwen3 (q/k norms, head_dim 32) windows its second layer
    // (max_window_layers 1), a window of 24 across blocks of 16.
    if (std::string(preset) == "qwen3-window") {
      ASSERT_EQ(l.model->config().layer_windows, (std::vector<int64_t>{0, 24}));
    }
    const auto tokens = RandomTokens(80, l.model->config().vocab_size, 3);
    TextEvalOptions o;
    o.block_size = 16;
    o.prefill_tokens = 27;
    o.decode_chunk = 5;
    CheckNll(l, tokens, o, {}, kNllTolerance);
    auto e = MakeEngine(l.model.get(), 4 << 20, 11);
    ASSERT_NE(e, nullptr);
    const std::vector<int32_t> prompt(tokens.begin(), tokens.begin() + 45);
    const Generated g = Generate(*e, 1, prompt, 60);
    ASSERT_EQ(g.sampled.size(), 60u);
    ExpectReferenceTokens(*l.reference, prompt, g);
  }
  // Gemma with bf16 weights (its embedding scale rounded to bf16: 8 is exact,
  // so hidden 48 gives sqrt(48) = 6.928... -> 6.9375) and tied embeddings,
  // the lm_head reading the unscaled table.
  ModelSpec tied = *PresetModelSpec("gemma2");
  tied.name = "gemma2-tied-bf16";
  tied.hidden_size = 48;
  tied.tie_word_embeddings = true;
  tied.dtype = DType::kBF16;
  Loaded l = Load("gemma2-tied-bf16", tied);
  ASSERT_NE(l.model, nullptr);
  TextEvalOptions o;
  o.prefill_tokens = 30;
  o.decode_chunk = 4;
  CheckNll(l, RandomTokens(70, l.model->config().vocab_size, 4), o, {}, kNllTolerance);
}

// The capacity gauge (ContextCapacityTokens): a pool of N blocks of 16
// holds N x 16 tokens of a dense model; with windows, each windowed group
// sets aside ceil((W-1)/16) + 1 blocks and the full groups share the rest;
// a model whose every layer is windowed holds max_model_len.
TEST(EngineWindowsTest, CapacityCountsWindowedGroupsAtTheirWindow) {
  ModelSpec dense_spec = *PresetModelSpec("mistral-window");
  dense_spec.sliding_window = 0;
  dense_spec.name = "mistral-dense";
  struct Case {
    const char* name;
    ModelSpec spec;
    int64_t set_aside, full_groups;  // blocks; 0 full groups: every layer windowed
  };
  // gemma2: layers 0, 2 at 32 (3 blocks), 1 and 3 full; gemma3: layers
  // 0, 1, 3, 4 at 24 in two groups (3 blocks each), 2 and 5 full.
  const Case cases[] = {{"mistral-dense", dense_spec, 0, 1},
                        {"gemma2", *PresetModelSpec("gemma2"), 3, 1},
                        {"gemma3", *PresetModelSpec("gemma3"), 6, 1},
                        {"mistral-window", *PresetModelSpec("mistral-window"), 3, 0}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    Loaded l = Load(c.name, c.spec);
    ASSERT_NE(l.model, nullptr);
    auto e = MakeEngine(l.model.get(), 1 << 20);
    ASSERT_NE(e, nullptr);
    const int64_t n = e->kv_pool().num_blocks();
    ASSERT_GT(n, c.set_aside);
    EXPECT_EQ(e->ContextCapacityTokens(),
              c.full_groups == 0 ? e->max_model_len() : (n - c.set_aside) * 16);
  }
}

// Held blocks of a sequence's layer group.
size_t Held(const Engine& e, RequestId id, uint32_t group) {
  const auto& t = const_cast<Engine&>(e).block_manager().BlockTable(id, group);
  return static_cast<size_t>(
      std::count_if(t.begin(), t.end(), [](BlockId b) { return b != kNoBlock; }));
}

// A windowed model decoding 8x its window holds, per windowed group, at most
// the window's blocks: ceil((W-1)/B) + 1 once decoding (a prefill chunk of
// c tokens adds ceil(c/B)); full groups hold every block. A pool too small
// for the dense model serves it to the end.
TEST(EngineWindowsTest, WindowedLayersHoldOnlyTheWindow) {
  for (const char* preset : {"mistral-window", "gemma2"}) {
    SCOPED_TRACE(preset);
    Loaded l = Load(preset, *PresetModelSpec(preset));
    ASSERT_NE(l.model, nullptr);
    const KvGroups& groups = l.model->kv_groups();
    const int64_t W = *l.model->config().sliding_window, B = 16, chunk = 16;
    const auto prompt = RandomTokens(20, l.model->config().vocab_size, 5);
    const int generate = static_cast<int>(8 * W);
    auto e = MakeEngine(l.model.get(), 8 << 20, chunk);
    ASSERT_NE(e, nullptr);
    size_t most_windowed = 0, most_full = 0;
    const size_t bound = static_cast<size_t>((W - 1 + chunk - 1) / B + 1 + 1);
    const Generated g = Generate(*e, 1, prompt, generate, [&] {
      if (!e->block_manager().HasSequence(1)) return;
      for (uint32_t grp = 0; grp < groups.size(); ++grp) {
        const size_t held = Held(*e, 1, grp);
        if (groups.windows[grp] > 0) {
          most_windowed = std::max(most_windowed, held);
          EXPECT_LE(held, bound);
        } else {
          most_full = std::max(most_full, held);
        }
      }
    });
    ASSERT_EQ(g.sampled.size(), static_cast<size_t>(generate));
    ExpectReferenceTokens(*l.reference, prompt, g);
    // Decoding: the blocks of the last W-1 positions and the current one.
    EXPECT_EQ(most_windowed, static_cast<size_t>((W - 1 + B - 1) / B + 1));
    if (groups.size() > 1) {
      EXPECT_EQ(most_full, (prompt.size() + generate + B - 1) / B);
    }
  }
  // The pool: 4 blocks. The windowed model needs 3 at a time; the same
  // weights without the window (every layer full) need 18 and outgrow it.
  Loaded windowed = Load("mistral-window", *PresetModelSpec("mistral-window"));
  ModelSpec dense_spec = *PresetModelSpec("mistral-window");
  dense_spec.sliding_window = 0;
  dense_spec.name = "mistral-dense";
  Loaded dense = Load("mistral-dense", dense_spec);
  ASSERT_NE(windowed.model, nullptr);
  ASSERT_NE(dense.model, nullptr);
  const int64_t block_bytes = 2 * 2 * 2 * 16 * 16 * 4;  // K+V x layers x kv heads x B x dim x fp32
  const auto prompt = RandomTokens(20, windowed.model->config().vocab_size, 6);
  auto small = MakeEngine(windowed.model.get(), 4 * block_bytes, 16);
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->kv_pool().num_blocks(), 4);
  const Generated g = Generate(*small, 1, prompt, 256);
  EXPECT_EQ(g.sampled.size(), 256u);
  EXPECT_EQ(g.finish, FinishReason::kLength);
  EXPECT_EQ(small->GetStats().num_preemptions, 0u);
  ExpectReferenceTokens(*windowed.reference, prompt, g);
  auto dense_small = MakeEngine(dense.model.get(), 4 * block_bytes, 16);
  ASSERT_NE(dense_small, nullptr);
  const Generated d = Generate(*dense_small, 1, prompt, 256);
  EXPECT_LT(d.sampled.size(), 256u);  // outgrew the pool
}

// A repeated long prompt: the second request reuses every full block of it
// (the windowed groups' early blocks, released as the first one ran, are
// not needed); losing those early windowed blocks keeps the hit, losing a
// block the last query reaches shortens it, both exactly as the windowed
// rule over what the engine caches says; and a router index fed the
// engine's KV events predicts each hit.
TEST(EngineWindowsTest, RepeatedPromptHitsAndTheRouterPredictsIt) {
  Loaded l = Load("gemma2", *PresetModelSpec("gemma2"));
  ASSERT_NE(l.model, nullptr);
  const auto engine = MakeEngine(l.model.get(), 8 << 20, 32, /*record_kv_events=*/true);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  BlockManager& bm = e.block_manager();
  const auto prompt = RandomTokens(150, l.model->config().vocab_size, 7);
  const auto hashes = HashPrompt(BlockHashSeed(l.model->model_id()),
                                 std::span(prompt).first(prompt.size() - 1), 16);
  ASSERT_EQ(hashes.size(), 9u);
  router::PrefixIndex index;
  ASSERT_TRUE(index.AddWorker(0).ok());
  ASSERT_TRUE(index.ApplySnapshot(0, 0, {}).ok());
  auto predicted = [&] {
    for (const auto& b : bm.DrainEvents()) {
      EXPECT_EQ(index.ApplyEvents(0, b), router::ApplyOutcome::kApplied);
    }
    std::vector<uint32_t> out;
    index.GroupedOverlap(hashes, bm.group_windows(), 16, 0, &out);
    return static_cast<int64_t>(out[0]) * 16;
  };
  auto reference_hit = [&] {
    return static_cast<int64_t>(CachedPrefixBlocks(bm.group_windows(), 16, hashes.size(),
                                                   [&](size_t g, size_t i) {
                                                     return bm.IsCached(hashes[i],
                                                                        static_cast<uint32_t>(g));
                                                   })) *
           16;
  };
  const Generated first = Generate(e, 1, prompt, 3);
  EXPECT_EQ(first.cached_tokens, 0);
  EXPECT_EQ(reference_hit(), 144);
  EXPECT_EQ(predicted(), 144);
  const Generated second = Generate(e, 2, prompt, 3);
  EXPECT_EQ(second.cached_tokens, 144);
  ExpectReferenceTokens(*l.reference, prompt, second);
  // Evict the windowed blocks the first request released while it ran:
  // they are the least recently released.
  const size_t early = static_cast<size_t>(FirstBlockInReach(32, 144, 16));
  EXPECT_EQ(bm.Evict(early), early);
  for (size_t i = 0; i < early; ++i) EXPECT_FALSE(bm.IsCached(hashes[i], 0)) << i;
  EXPECT_EQ(reference_hit(), 144);
  EXPECT_EQ(predicted(), 144);
  const Generated third = Generate(e, 3, prompt, 3);
  EXPECT_EQ(third.cached_tokens, 144);
  // A windowed block the last query reaches: the hit falls back to the
  // longest prefix whose own reach is still held.
  while (bm.IsCached(hashes[8], 0)) ASSERT_EQ(bm.Evict(1), 1u);
  const int64_t shorter = reference_hit();
  EXPECT_LT(shorter, 144);
  EXPECT_EQ(predicted(), shorter);
  const Generated fourth = Generate(e, 4, prompt, 3);
  EXPECT_EQ(fourth.cached_tokens, shorter);
  ExpectReferenceTokens(*l.reference, prompt, fourth);
  const auto stats = e.GetStats().blocks;
  EXPECT_EQ(stats.prefix_cache_query_tokens, 4u * 150);
  EXPECT_EQ(stats.prefix_cache_hit_tokens, static_cast<uint64_t>(144 + 144 + shorter));
}

// The router hashes the whole prompt, the engine reuses blocks only up to
// its last token's: for a block-aligned prompt the router must judge each
// windowed group's reach as the engine does, from the block before, or it
// predicts a full hit where the engine reuses nothing (and sends a long
// prefill to the decode worker).
TEST(EngineWindowsTest, RouterPredictsTheEnginesHitForABlockAlignedPrompt) {
  Loaded l = Load("gemma2", *PresetModelSpec("gemma2"));
  ASSERT_NE(l.model, nullptr);
  const auto engine = MakeEngine(l.model.get(), 8 << 20, 32, /*record_kv_events=*/true);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  BlockManager& bm = e.block_manager();
  router::RouterOptions ro;
  ro.block_tokens = 16;
  ro.pending_ttl_us = 0;
  auto core = router::RouterCore::Create(std::move(ro));
  ASSERT_TRUE(core.ok());
  (*core)->SetKvGroupWindows(bm.group_windows());
  auto worker = (*core)->AddWorker("w", Role::kBoth);
  ASSERT_TRUE(worker.ok());
  ASSERT_TRUE((*core)->OnSnapshot(*worker, 0, {}).ok());
  // As the router hashes a prompt: every full block, the last one too.
  const auto hashes_of = [&](const std::vector<int32_t>& prompt) {
    return HashPrompt(BlockHashSeed(l.model->model_id()), prompt, 16);
  };
  uint64_t next_request = 1;
  auto predicted = [&](const std::vector<int32_t>& prompt) {
    for (const auto& b : bm.DrainEvents()) {
      EXPECT_EQ((*core)->OnKvEvents(*worker, b), router::ApplyOutcome::kApplied);
    }
    const auto hashes = hashes_of(prompt);
    EXPECT_EQ(hashes.size(), 9u);
    router::RouteRequest r;
    r.request_id = next_request++;
    r.block_hashes = hashes;
    r.prompt_tokens = static_cast<int64_t>(prompt.size());
    auto d = (*core)->Route(r);
    EXPECT_TRUE(d.ok());
    (*core)->OnRequestFinished(r.request_id);
    return d.ok() ? d->decode_overlap_blocks * 16 : -1;
  };
  const auto warm_prompt = RandomTokens(144, l.model->config().vocab_size, 9);
  EXPECT_EQ(Generate(e, 1, warm_prompt, 3).cached_tokens, 0);
  const int64_t warm = predicted(warm_prompt);
  EXPECT_EQ(warm, 128);  // the engine computes the last block again
  EXPECT_EQ(Generate(e, 2, warm_prompt, 3).cached_tokens, warm);
  // Another prompt, whose windowed block 6 goes (and what was released
  // before it): the last block's queries reach blocks 7 and 8 only, still
  // held, but those of the block before, where the engine starts, need 6.
  const auto prompt = RandomTokens(144, l.model->config().vocab_size, 10);
  EXPECT_EQ(Generate(e, 3, prompt, 3).cached_tokens, 0);
  const auto hashes = hashes_of(prompt);
  while (bm.IsCached(hashes[6], 0)) ASSERT_EQ(bm.Evict(1), 1u);
  ASSERT_TRUE(bm.IsCached(hashes[7], 0) && bm.IsCached(hashes[8], 0));
  const int64_t cold = predicted(prompt);
  EXPECT_LT(cold, 128);
  const Generated third = Generate(e, 4, prompt, 3);
  EXPECT_EQ(third.cached_tokens, cold);
  ExpectReferenceTokens(*l.reference, prompt, third);
}

// n > 1 on a model with windowed and full layer groups: sequences sharing
// a prompt (share_prompt_with) wait for its KV, then take the blocks of every
// group from the prefix cache (the windowed group's early blocks, released
// while the prompt ran, included), and generate the reference's tokens.
TEST(EngineWindowsTest, SharedPromptSequencesTakeEveryGroupsBlocks) {
  Loaded l = Load("gemma2", *PresetModelSpec("gemma2"));
  ASSERT_NE(l.model, nullptr);
  auto e = MakeEngine(l.model.get(), 8 << 20, 32);
  const auto prompt = RandomTokens(150, l.model->config().vocab_size, 8);
  for (RequestId id : {1, 2, 3}) {
    EngineRequest r;
    r.id = id;
    r.prompt = prompt;
    r.params.temperature = 0;
    r.params.max_tokens = 4;
    r.params.ignore_eos = true;
    r.params.logprobs = 0;
    r.share_prompt_with = id == 1 ? 0 : 1;
    ASSERT_TRUE(e->AddRequest(std::move(r)).ok());
  }
  std::map<RequestId, Generated> g;
  while (e->HasUnfinished()) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    for (const auto& o : *step) {
      Generated& x = g[o.id];
      if (!o.new_token_ids.empty() && x.sampled.empty()) x.cached_tokens = o.num_cached_tokens;
      x.sampled.insert(x.sampled.end(), o.logprobs.begin(), o.logprobs.end());
    }
  }
  for (RequestId id : {1, 2, 3}) {
    SCOPED_TRACE(id);
    // Nine full blocks of every group for the siblings.
    EXPECT_EQ(g[id].cached_tokens, id == 1 ? 0 : 144);
    ASSERT_EQ(g[id].sampled.size(), 4u);
    ExpectReferenceTokens(*l.reference, prompt, g[id]);
  }
  EXPECT_EQ(e->GetStats().blocks.prefix_cache_hit_tokens, 2u * 144);
}

// Disaggregated prefill on a windowed model: the decode engine reserves, and
// the prefill engine's blocks fill, only what the decode side keeps; the
// decode engine then generates exactly what one engine does, and fewer bytes
// move than the dense layout would move. What it keeps is also what a
// repeat of the prompt starts from (the queries of the block its last token
// is in, which the engine always computes): for a window a multiple of the
// block size, a block earlier than the first decode query reaches when the
// prompt ends a block or one token short of it. The repeat then reuses as
// much as on the engine that computed the prompt itself, also when the
// prefill's last chunk starts past that block's first query (gemma3's
// window of 24 at chunks of 17).
TEST(EngineWindowsTest, DisaggregatedPrefillMovesOnlyWhatTheDecodeSideKeeps) {
  for (const auto& [preset, prompt_tokens, chunk] :
       std::vector<std::tuple<const char*, int, int>>{{"gemma2", 150, 32},
                                                      {"gemma2", 159, 32},
                                                      {"gemma2", 160, 32},
                                                      {"gemma3", 160, 17},
                                                      {"mistral-window", 150, 32},
                                                      {"mistral-window", 160, 32}}) {
    SCOPED_TRACE(std::string(preset) + " " + std::to_string(prompt_tokens));
    Loaded l = Load(preset, *PresetModelSpec(preset));
    ASSERT_NE(l.model, nullptr);
    EngineRequest request;
    request.id = 1;
    request.prompt = RandomTokens(prompt_tokens, l.model->config().vocab_size, 8);
    request.params.temperature = 0;
    request.params.max_tokens = 20;
    request.params.ignore_eos = true;
    request.params.seed = 1;
    auto alone = MakeEngine(l.model.get(), 8 << 20, 32);
    ASSERT_TRUE(alone->AddRequest(request).ok());
    std::vector<TokenId> expected;
    while (alone->HasUnfinished()) {
      auto step = alone->Step();
      ASSERT_TRUE(step.ok());
      for (const auto& o : *step) {
        expected.insert(expected.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      }
    }
    ASSERT_EQ(expected.size(), 20u);

    auto prefill = MakeEngine(l.model.get(), 8 << 20, chunk);
    auto decode = MakeEngine(l.model.get(), 8 << 20, 32);
    auto plan = decode->AddRemotePrefillRequest(request);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EngineRequest p = request;
    p.prefill_only = true;
    ASSERT_TRUE(prefill->AddRequest(p).ok());
    RequestOutput done;
    while (prefill->HasUnfinished()) {
      auto step = prefill->Step();
      ASSERT_TRUE(step.ok());
      for (const auto& o : *step) {
        if (o.finished) done = o;
      }
    }
    ASSERT_TRUE(done.kv_pin.has_value());
    const int64_t bytes = decode->kv_pool().bytes_per_block();
    int64_t moved = 0;
    for (const BlockSlot& want : plan->fill) {
      auto src = std::find_if(done.kv_slots.begin(), done.kv_slots.end(), [&](const BlockSlot& s) {
        return s.group == want.group && s.index == want.index;
      });
      ASSERT_NE(src, done.kv_slots.end()) << "group " << want.group << " block " << want.index;
      std::memcpy(decode->kv_pool().block(want.block), prefill->kv_pool().block(src->block), bytes);
      moved += bytes;
    }
    ASSERT_TRUE(prefill->ReleaseKvBlocks(*done.kv_pin).ok());
    // The first token comes with the hand-off, the rest from the steps.
    auto first = decode->CompleteRemotePrefill(1, done.new_token_ids[0]);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    std::vector<TokenId> got = first->new_token_ids;
    while (decode->HasUnfinished()) {
      auto step = decode->Step();
      ASSERT_TRUE(step.ok());
      for (const auto& o : *step) {
        got.insert(got.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      }
    }
    EXPECT_EQ(got, expected);
    // The dense layout moves every group's every block.
    const int64_t dense =
        (prompt_tokens + 15) / 16 * static_cast<int64_t>(l.model->kv_groups().size()) * bytes;
    EXPECT_LT(moved, dense);
    std::printf(
        "{\"model\": \"%s\", \"prompt_tokens\": %d, \"kv_bytes_moved\": %lld, "
        "\"kv_bytes_dense_layout\": %lld}\n",
        preset, prompt_tokens, static_cast<long long>(moved), static_cast<long long>(dense));
    // The same prompt again, on each engine.
    const int64_t reusable = (prompt_tokens - 1) / 16 * 16;
    EXPECT_EQ(Generate(*alone, 2, request.prompt, 2).cached_tokens, reusable);
    EXPECT_EQ(Generate(*decode, 2, request.prompt, 2).cached_tokens, reusable);
  }
}

// Lower tiers keep what the pool keeps: blocks of every layer group the pool
// evicts go down under their group keys, and a prompt that comes back after
// the pool lost them copies back exactly the blocks the windowed rule needs
// (the full group's prefix, the windowed group's tail) and computes the same
// tokens.
TEST(EngineWindowsTest, LowerTiersHoldAndReturnEveryGroupsBlocks) {
  Loaded l = Load("gemma2", *PresetModelSpec("gemma2"));
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.kv_cache_bytes = 40 * 16384;  // 40 blocks of the preset's groups
  o.max_num_batched_tokens = 32;
  o.kv_host_cache_bytes = 200 * 16384;
  auto created = Engine::Create(l.model.get(), o);
  ASSERT_TRUE(created.ok()) << created.status().ToString();
  Engine& e = **created;
  auto run = [&](RequestId id, const std::vector<int32_t>& prompt) {
    EngineRequest r;
    r.id = id;
    r.prompt = prompt;
    r.params.temperature = 0;
    r.params.max_tokens = 4;
    r.params.ignore_eos = true;
    EXPECT_TRUE(e.AddRequest(std::move(r)).ok());
    std::vector<TokenId> out;
    int64_t cached = -1;
    for (int guard = 0; e.HasUnfinished() && guard < 200000; ++guard) {
      auto step = e.Step();
      EXPECT_TRUE(step.ok());
      if (!step.ok()) break;
      for (const auto& x : *step) {
        if (cached < 0 && !x.new_token_ids.empty()) cached = x.num_cached_tokens;
        out.insert(out.end(), x.new_token_ids.begin(), x.new_token_ids.end());
      }
      if (step->empty()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return std::pair{out, cached};
  };
  const auto prompt = RandomTokens(150, l.model->config().vocab_size, 9);
  const auto [first, none] = run(1, prompt);
  EXPECT_EQ(none, 0);
  // Other prompts push every block of the first one out of the pool.
  for (RequestId id = 2; id < 6; ++id) run(id, RandomTokens(150, 512, 100 + id));
  for (int i = 0; i < 1000 && e.GetStats().tiers.offloads_queued > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const auto hashes = HashPrompt(BlockHashSeed(l.model->model_id()),
                                 std::span(prompt).first(prompt.size() - 1), 16);
  EXPECT_FALSE(e.block_manager().IsCached(hashes[0], 1));
  const int64_t host_before = e.GetStats().tiers.host_hit_tokens;
  const auto [again, cached] = run(6, prompt);
  EXPECT_EQ(again, first);
  EXPECT_EQ(cached, 144);
  EXPECT_EQ(e.GetStats().tiers.host_hit_tokens - host_before, 144);
}

}  // namespace
}  // namespace pdserve
