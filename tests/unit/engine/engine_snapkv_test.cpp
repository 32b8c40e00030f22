// SnapKV (--kv-eviction snapkv): the engine against the float64 reference
// implementing the same rule, which chooses the kept tokens from its own
// attention weights (tests/support/reference_model.h, KvEvictionRule): the
// same kept positions per layer and KV head, and the same tokens and
// logprobs after the prompt is compressed, on the tiny preset and the real
// model stories260K; the text evaluation's compressed prompt against the
// reference's NLL; a prompt within the budget exactly as dense; the blocks a
// compressed request holds; the full prompt left in the prefix cache; and
// every refusal, naming its flag.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/kv_eviction.h"
#include "engine/engine.h"
#include "engine/text_eval.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/support/kv_eviction_modes.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/reference_tokens.h"
#include "tests/support/snapkv_runs.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::Flatten;
using testing::Generate;
using testing::Generated;
using testing::KvEvictionRule;
using testing::LogSoftmax;
using testing::RandomTokens;
using testing::ReferenceModel;

ModelSpec Spec() { return *PresetModelSpec("tiny"); }  // 4 query heads over 2 KV heads

using Loaded = testing::LoadedCpuModel;

Loaded Load(const KvEviction& e, const std::string& dir = testing::ModelDir("snapkv", Spec())) {
  return testing::LoadCpuModel(dir, e);
}

std::unique_ptr<ReferenceModel> Reference(const std::string& dir) {
  return testing::LoadReference(dir);
}

// An engine over `model` with blocks of `block_size`, prefill chunks of 16
// and 8 MiB of KV (null, with a test failure, when it cannot be made).
std::unique_ptr<Engine> MakeEngine(Model* model, int64_t block_size) {
  EngineOptions o;
  o.block_size = block_size;
  o.max_num_batched_tokens = 16;
  o.kv_cache_bytes = 8 << 20;
  auto e = Engine::Create(model, o);
  EXPECT_TRUE(e.ok()) << e.status().ToString();
  return e.ok() ? std::move(*e) : nullptr;
}

// The engine's tokens and logprobs are the reference's under `rule`.
void ExpectReferenceTokens(const ReferenceModel& ref, const KvEvictionRule& rule,
                           const std::vector<int32_t>& prompt, const Generated& g,
                           double tolerance = 1e-3) {
  testing::ExpectReferenceTokens(ref.Forward(testing::WithSampled(prompt, g.sampled), {}, rule),
                                 prompt.size(), g.sampled, tolerance);
}

// The text evaluation compresses its first step (the prompt) as the engine
// does: every later position's NLL is the reference's under the rule, for
// budgets on and off block boundaries, windows of 1 to 16, blocks of 16 and
// 5, and later chunks of 1 and 7; the prompt's own positions are dense.
TEST(EngineSnapKvTest, TextEvaluationMatchesTheReferenceRule) {
  const std::string dir = testing::ModelDir("snapkv", Spec());
  const auto ref = Reference(dir);
  ASSERT_NE(ref, nullptr);
  const auto tokens = RandomTokens(140, Spec().vocab_size(), 1);
  const int64_t P = 90;
  for (auto [budget, window] : {std::pair{32, 8}, std::pair{45, 16}, std::pair{20, 1}}) {
    SCOPED_TRACE("budget " + std::to_string(budget) + " window " + std::to_string(window));
    Loaded l = Load(testing::SnapKv(budget, window));
    ASSERT_NE(l.model, nullptr);
    const auto logits = ref->Forward(tokens, {}, KvEvictionRule::SnapKv(budget, window, P));
    for (auto [block, chunk] : {std::pair{16, 1}, std::pair{5, 7}}) {
      SCOPED_TRACE("block " + std::to_string(block) + " chunk " + std::to_string(chunk));
      TextEvalOptions o;
      o.block_size = block;
      o.prefill_tokens = P;
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
  // The rule matters: the compressed prompt changes what follows it, and
  // nothing before it.
  const auto dense = ref->Forward(tokens, {}, {});
  const auto snap = ref->Forward(tokens, {}, KvEvictionRule::SnapKv(32, 8, P));
  EXPECT_GT(std::fabs(dense[120][3] - snap[120][3]), 1e-4);
  EXPECT_EQ(dense[P - 1][3], snap[P - 1][3]);
}

// Generation through the engine, the prompt prefilled in chunks of 16 (its
// observation window whole in the last): the positions kept per layer and
// KV head are the reference's, and so are the tokens and logprobs of 40
// decode steps. The request then holds the budget's blocks, not the
// prompt's; a repeated prompt reuses the cached full prompt up to its
// observation window and compresses to the same tokens.
TEST(EngineSnapKvTest, GenerationKeepsTheReferenceTokensAndHoldsTheBudget) {
  const std::string dir = testing::ModelDir("snapkv", Spec());
  const auto ref = Reference(dir);
  ASSERT_NE(ref, nullptr);
  const int64_t B = 32, W = 8, bs = 8;
  Loaded l = Load(testing::SnapKv(B, W));
  ASSERT_NE(l.model, nullptr);
  const auto engine = MakeEngine(l.model.get(), bs);
  ASSERT_NE(engine, nullptr);
  Engine& e = *engine;
  for (int64_t P : {70, 77}) {  // the window inside one chunk, and across two chunks' edge
    SCOPED_TRACE("prompt " + std::to_string(P));
    const auto prompt = RandomTokens(P, Spec().vocab_size(), 2 + P);
    const auto g = Generate(e, 10 + P, prompt, 40);
    ASSERT_EQ(g.sampled.size(), 40u);
    std::vector<std::vector<std::vector<int64_t>>> kept;
    ExpectReferenceTokens(*ref, KvEvictionRule::SnapKv(B, W, P, &kept), prompt, g);
    ASSERT_EQ(kept.size(), static_cast<size_t>(l.model->config().num_layers));
    EXPECT_EQ(g.kept, Flatten(kept));
    for (const auto& k : g.kept) ASSERT_EQ(k.size(), static_cast<size_t>(B));
    // The kept sets differ between heads: each keeps its own tokens.
    EXPECT_NE(g.kept[0], g.kept[1]);
    // Held: the budget's blocks, not the prompt's.
    EXPECT_EQ(g.held_after_prompt, static_cast<size_t>((B + bs - 1) / bs));
    EXPECT_EQ(g.blocks_released, (P + bs - 1) / bs - (B + bs - 1) / bs);
  }
  EXPECT_EQ(e.GetStats().snapkv_evicted_tokens, static_cast<uint64_t>((70 - B) + (77 - B)));
  // The full prompt stays cached: a repeat hits up to its observation
  // window (whole blocks), recomputes the rest and keeps the same tokens.
  const auto prompt = RandomTokens(70, Spec().vocab_size(), 72);
  const auto again = Generate(e, 100, prompt, 40);
  EXPECT_EQ(again.cached_tokens, (70 - W) / bs * bs);
  std::vector<std::vector<std::vector<int64_t>>> kept;
  ExpectReferenceTokens(*ref, KvEvictionRule::SnapKv(B, W, 70, &kept), prompt, again);
  EXPECT_EQ(again.kept, Flatten(kept));
  ASSERT_TRUE(e.block_manager().CheckInvariants().ok());
}

// A prompt within the budget is never compressed: tokens and logprobs are
// those of an engine without the mode, exactly.
TEST(EngineSnapKvTest, PromptWithinTheBudgetIsDense) {
  const auto prompt = RandomTokens(40, Spec().vocab_size(), 5);
  Loaded snap = Load(testing::SnapKv(40, 8)), dense = Load({});
  ASSERT_NE(snap.model, nullptr);
  ASSERT_NE(dense.model, nullptr);
  EngineOptions o;
  o.block_size = 8;
  auto a = Engine::Create(snap.model.get(), o), b = Engine::Create(dense.model.get(), o);
  ASSERT_TRUE(a.ok() && b.ok());
  const auto ga = Generate(**a, 1, prompt, 30), gb = Generate(**b, 1, prompt, 30);
  ASSERT_EQ(ga.sampled.size(), 30u);
  EXPECT_TRUE(ga.kept.empty());
  for (size_t i = 0; i < ga.sampled.size(); ++i) {
    EXPECT_EQ(ga.sampled[i].token, gb.sampled[i].token) << i;
    EXPECT_EQ(ga.sampled[i].logprob, gb.sampled[i].logprob) << i;
  }
  EXPECT_EQ((*a)->GetStats().snapkv_evicted_tokens, 0u);
}

// The real model: a 300-token prompt (its own greedy continuation of a
// story start) compressed to 64 and to 128 tokens keeps the reference's
// positions in every layer and KV head, and decodes its tokens and logprobs.
TEST(EngineSnapKvTest, RealModelKeepsTheReferenceTokens) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty()) GTEST_SKIP() << "the real model stories260K is absent";
  const auto ref = Reference(dir);
  ASSERT_NE(ref, nullptr);
  std::vector<int32_t> prompt = {1, 403, 407};
  {
    Loaded dense = Load({}, dir);
    ASSERT_NE(dense.model, nullptr);
    auto e = Engine::Create(dense.model.get(), EngineOptions{});
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    for (const auto& s : Generate(**e, 1, prompt, 297).sampled) prompt.push_back(s.token);
  }
  ASSERT_EQ(prompt.size(), 300u);
  for (int64_t B : {64, 128}) {
    SCOPED_TRACE("budget " + std::to_string(B));
    const int64_t W = 16;
    Loaded l = Load(testing::SnapKv(B, W), dir);
    ASSERT_NE(l.model, nullptr);
    EngineOptions o;
    o.kv_cache_bytes = 16 << 20;
    o.max_num_batched_tokens = 128;
    auto e = Engine::Create(l.model.get(), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    const auto g = Generate(**e, 1, prompt, 60);
    ASSERT_EQ(g.sampled.size(), 60u);
    std::vector<std::vector<std::vector<int64_t>>> kept;
    ExpectReferenceTokens(*ref, KvEvictionRule::SnapKv(B, W, 300, &kept), prompt, g);
    EXPECT_EQ(g.kept, Flatten(kept));
  }
}

// Bad modes and budgets are refused naming the flag.
TEST(EngineSnapKvTest, RefusesWhatItCannotRun) {
  const std::string dir = testing::ModelDir("snapkv", Spec());
  kernels::CpuBackend backend(1);
  auto refused = [&](const std::string& model_dir, const KvEviction& e) {
    auto m = Model::Load(model_dir, &backend, LoadFormat::kSafetensors, e);
    EXPECT_FALSE(m.ok());
    return m.ok() ? std::string() : m.status().message();
  };
  EXPECT_NE(refused(dir, testing::SnapKv(0, 0)).find("--kv-budget-tokens"), std::string::npos);
  EXPECT_NE(refused(dir, testing::SnapKv(16, 17)).find("--kv-observation-window"),
            std::string::npos);
  EXPECT_NE(refused(dir, testing::SnapKv(16, 0)).find("--kv-observation-window"),
            std::string::npos);
  EXPECT_NE(refused(testing::ModelDir("mla", *PresetModelSpec("deepseek-v2-lite")),
                    testing::SnapKv(64, 8))
                .find("MLA"),
            std::string::npos);
  EXPECT_NE(refused(testing::ModelDir("mistral-window", *PresetModelSpec("mistral-window")),
                    testing::SnapKv(64, 8))
                .find("sliding-window"),
            std::string::npos);
  Loaded l = Load(testing::SnapKv(64, 32));
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.max_num_batched_tokens = 16;  // the observation window is one chunk's
  auto small_chunk = Engine::Create(l.model.get(), o);
  ASSERT_FALSE(small_chunk.ok());
  EXPECT_NE(small_chunk.status().message().find("--kv-observation-window"), std::string::npos);
  o.max_num_batched_tokens = 64;
}

// Disaggregated: a prefill engine compresses the prompt as a local one
// would and hands out only the budget's blocks (never streaming the full
// ones); the decode engine reserves that many blocks, takes the copied
// bytes (a memcpy standing in for the transport) and decodes exactly what
// one engine alone decodes. The full prompt stays in the prefill engine's
// prefix cache; nothing of the compressed prompt is cached on either side.
// A prompt within the budget crosses as dense.
TEST(EngineSnapKvTest, RemotePrefillHandsOffOnlyTheCompressedBlocks) {
  const int64_t B = 32, W = 8, bs = 8;
  Loaded l = Load(testing::SnapKv(B, W));
  ASSERT_NE(l.model, nullptr);
  auto make = [&] { return MakeEngine(l.model.get(), bs); };
  for (int64_t P : {70, 24}) {
    SCOPED_TRACE("prompt " + std::to_string(P));
    const auto prompt = RandomTokens(P, Spec().vocab_size(), 40 + P);
    auto alone = make();
    const auto expected = Generate(*alone, 1, prompt, 30);
    ASSERT_EQ(expected.sampled.size(), 30u);
    const int64_t dropped = P > B ? P - B : 0, kv_tokens = P - dropped;

    auto prefill = make(), decode = make();
    EngineRequest r;
    r.id = 1;
    r.prompt = prompt;
    r.params.temperature = 0;
    r.params.max_tokens = 30;
    r.params.ignore_eos = true;
    r.params.logprobs = 0;
    auto plan = decode->AddRemotePrefillRequest(r);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(plan->snapkv_dropped_tokens, dropped);
    EXPECT_EQ(plan->first_block_to_fill, 0u);
    ASSERT_EQ(plan->fill.size(), static_cast<size_t>((kv_tokens + bs - 1) / bs));

    r.prefill_only = true;
    r.stream_kv_blocks = true;  // asked for, yet a compressed prompt streams nothing
    ASSERT_TRUE(prefill->AddRequest(r).ok());
    RequestOutput done;
    while (prefill->HasUnfinished()) {
      auto step = prefill->Step();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      for (auto& out : *step) {
        if (out.finished) {
          done = std::move(out);
        } else if (out.kv_pin) {
          EXPECT_EQ(dropped, 0) << "a compressed prompt streamed its full blocks";
          ASSERT_TRUE(prefill->ReleaseKvBlocks(*out.kv_pin).ok());
        }
      }
    }
    ASSERT_EQ(done.new_token_ids.size(), 1u);
    EXPECT_EQ(done.new_token_ids[0], expected.sampled[0].token);
    EXPECT_EQ(done.snapkv_dropped_tokens, dropped);
    ASSERT_NO_FATAL_FAILURE(testing::MoveHandedOffBlocks(*prefill, done, *plan, *decode));
    const BlockManagerStats ps = prefill->GetStats().blocks;
    EXPECT_EQ(ps.used_blocks, 0u);
    EXPECT_EQ(ps.cached_blocks, static_cast<size_t>(P / bs));  // the full prompt's blocks
    EXPECT_EQ(prefill->GetStats().snapkv_evicted_tokens, static_cast<uint64_t>(dropped));

    auto first = decode->CompleteRemotePrefill(1, done.new_token_ids[0], done.logprobs[0]);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    std::vector<SampledToken> got = first->logprobs;
    while (decode->HasUnfinished()) {
      auto step = decode->Step();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      for (const auto& out : *step) got.insert(got.end(), out.logprobs.begin(), out.logprobs.end());
    }
    ASSERT_EQ(got.size(), expected.sampled.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].token, expected.sampled[i].token) << i;
      EXPECT_NEAR(got[i].logprob, expected.sampled[i].logprob, 1e-5) << i;
    }
    const BlockManagerStats ds = decode->GetStats().blocks;
    EXPECT_EQ(ds.used_blocks, 0u);
    // A compressed prompt is private: nothing of it enters the cache.
    if (dropped > 0) {
      EXPECT_EQ(ds.cached_blocks, 0u);
    }
    ASSERT_TRUE(decode->block_manager().CheckInvariants().ok());
    ASSERT_TRUE(prefill->block_manager().CheckInvariants().ok());
  }
}

// A hot-prefix copy or drain push (EngineRequest::snapkv_dense on both
// sides): the holder sends the prompt dense, by position, and the receiver
// caches its full blocks. A copy that wants one token ends with the
// holder's (the dense prefill's) token; one that decodes on prefills again
// from the blocks it now caches, compresses as a local request does, and
// decodes what one engine alone decodes. A later request hits the copied
// blocks up to the observation window.
TEST(EngineSnapKvTest, PrefixCopyMovesTheDensePromptWhichTheReceiverCaches) {
  const int64_t B = 32, W = 8, bs = 8, P = 70;
  Loaded l = Load(testing::SnapKv(B, W));
  ASSERT_NE(l.model, nullptr);
  auto make = [&] { return MakeEngine(l.model.get(), bs); };
  const auto prompt = RandomTokens(P, Spec().vocab_size(), 7);
  auto alone = make();
  const auto expected = Generate(*alone, 1, prompt, 30);
  ASSERT_EQ(expected.sampled.size(), 30u);
  for (int max_tokens : {30, 1}) {
    SCOPED_TRACE("max_tokens " + std::to_string(max_tokens));
    auto prefill = make(), decode = make();
    EngineRequest r;
    r.id = 1;
    r.prompt = prompt;
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    r.params.logprobs = 0;
    r.snapkv_dense = true;
    auto plan = decode->AddRemotePrefillRequest(r);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    EXPECT_EQ(plan->snapkv_dropped_tokens, 0);
    ASSERT_EQ(plan->fill.size(), static_cast<size_t>((P + bs - 1) / bs));  // every block

    r.prefill_only = true;
    ASSERT_TRUE(prefill->AddRequest(r).ok());
    RequestOutput done;
    while (prefill->HasUnfinished()) {
      auto step = prefill->Step();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      for (auto& out : *step) {
        if (out.finished) done = std::move(out);
      }
    }
    ASSERT_EQ(done.new_token_ids.size(), 1u);
    EXPECT_EQ(done.new_token_ids[0], expected.sampled[0].token);
    EXPECT_EQ(done.snapkv_dropped_tokens, 0);
    EXPECT_EQ(prefill->GetStats().snapkv_evicted_tokens, 0u);
    ASSERT_NO_FATAL_FAILURE(testing::MoveHandedOffBlocks(*prefill, done, *plan, *decode));

    auto first = decode->CompleteRemotePrefill(1, done.new_token_ids[0], done.logprobs[0]);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    // The full prompt's blocks are cached on the receiver either way.
    EXPECT_EQ(decode->GetStats().blocks.cached_blocks, static_cast<size_t>(P / bs));
    std::vector<SampledToken> got = first->logprobs;
    if (max_tokens == 1) {
      EXPECT_TRUE(first->finished);
    } else {
      EXPECT_TRUE(first->new_token_ids.empty());  // sampled again by the local prefill
      EXPECT_FALSE(first->finished);
    }
    while (decode->HasUnfinished()) {
      auto step = decode->Step();
      ASSERT_TRUE(step.ok()) << step.status().ToString();
      for (const auto& out : *step) got.insert(got.end(), out.logprobs.begin(), out.logprobs.end());
    }
    ASSERT_EQ(got.size(), static_cast<size_t>(max_tokens));
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].token, expected.sampled[i].token) << i;
      EXPECT_NEAR(got[i].logprob, expected.sampled[i].logprob, 1e-4) << i;
    }
    // Decoding on, the receiver compressed the prompt itself.
    EXPECT_EQ(decode->GetStats().snapkv_evicted_tokens,
              static_cast<uint64_t>(max_tokens > 1 ? P - B : 0));
    EXPECT_EQ(decode->GetStats().blocks.used_blocks, 0u);
    // The next request of the prompt hits the copied blocks up to the window.
    const auto again = Generate(*decode, 2, prompt, 4);
    EXPECT_EQ(again.cached_tokens, (P - W) / bs * bs);
    ASSERT_EQ(again.sampled.size(), 4u);
    for (size_t i = 0; i < 4; ++i) EXPECT_EQ(again.sampled[i].token, expected.sampled[i].token);
    ASSERT_TRUE(decode->block_manager().CheckInvariants().ok());
    ASSERT_TRUE(prefill->block_manager().CheckInvariants().ok());
  }
}

}  // namespace
}  // namespace pdserve
