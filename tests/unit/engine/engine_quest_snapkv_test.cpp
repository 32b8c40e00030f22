// Quest beside SnapKV (--kv-selection quest with --kv-eviction snapkv): once
// SnapKV has gathered a prompt's kept tokens into blocks of the request's
// own, each layer and KV head holding its own positions at cache indices
// 0..B-1, the engine bounds those blocks' keys and a decode query selects
// among them (and the blocks after them) by cache index. Against the
// float64 reference applying both rules independently (SnapKV's kept set
// from its own attention weights, then Quest's bounds and selection over
// the kept rows numbered by cache index): the text evaluation's NLL at
// every position, generation's kept sets, tokens and logprobs on the tiny
// preset and stories260K, and a disaggregated hand-off whose receiver
// computes the bounds of the compressed blocks it was sent.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/kv_eviction.h"
#include "engine/engine.h"
#include "engine/text_eval.h"
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

ModelSpec Spec() { return testing::TinyForQuest(); }  // 4 query heads over 2 KV heads

const std::string& Dir() {
  static const std::string dir = testing::ModelDir("quest-snapkv", Spec());
  return dir;
}

KvEviction Both(int64_t budget, int64_t window, int64_t quest_blocks) {
  KvEviction e = testing::SnapKv(budget, window);
  e.quest_blocks = quest_blocks;
  return e;
}

// Request 1: greedy, EOS ignored, with the chosen tokens' logprobs.
EngineRequest GreedyRequest(const std::vector<int32_t>& prompt, int64_t max_tokens) {
  EngineRequest r;
  r.id = 1;
  r.prompt = prompt;
  r.params.temperature = 0;
  r.params.max_tokens = max_tokens;
  r.params.ignore_eos = true;
  r.params.logprobs = 0;
  return r;
}

KvEvictionRule Rule(int64_t budget, int64_t window, int64_t prompt, int64_t quest_blocks,
                    int64_t block_size,
                    std::vector<std::vector<std::vector<int64_t>>>* kept = nullptr) {
  KvEvictionRule r = KvEvictionRule::SnapKv(budget, window, prompt, kept);
  r.quest_blocks = quest_blocks;
  r.block_size = block_size;
  r.first_decode = prompt;
  return r;
}

// `r` prefilled alone on `prefill` (EngineRequest::prefill_only): its
// finished output, with the first token and the blocks to hand off.
void PrefillOnly(Engine& prefill, EngineRequest r, RequestOutput* done) {
  r.prefill_only = true;
  ASSERT_TRUE(prefill.AddRequest(r).ok());
  while (prefill.HasUnfinished()) {
    auto step = prefill.Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    for (auto& out : *step) {
      if (out.finished) *done = std::move(out);
    }
  }
}

// The text evaluation: a 90-token prompt compressed to B, then 110 one-token
// decode steps, each selecting K blocks of cache indices. Every position's
// NLL is the reference's under both rules, for budgets on and off a block
// boundary (the last compacted block partly filled, then continued by
// decode) at blocks of 8 and 5; the selection changes what SnapKV alone
// gives, and a K covering every block is SnapKV alone.
TEST(EngineQuestSnapKvTest, TextEvaluationMatchesTheReferenceRules) {
  const auto ref = testing::LoadReference(Dir());
  ASSERT_NE(ref, nullptr);
  const auto tokens = RandomTokens(200, Spec().vocab_size(), 11);
  const int64_t P = 90, W = 8;
  for (const int64_t budget : {32, 30}) {
    const auto alone = ref->Forward(tokens, {}, KvEvictionRule::SnapKv(budget, W, P));
    for (const int64_t block : {8, 5}) {
      for (const int64_t k : {2, 40}) {
        SCOPED_TRACE("budget " + std::to_string(budget) + " block " + std::to_string(block) +
                     " K " + std::to_string(k));
        testing::LoadedCpuModel l = testing::LoadCpuModel(Dir(), Both(budget, W, k));
        ASSERT_NE(l.model, nullptr);
        TextEvalOptions o;
        o.block_size = block;
        o.prefill_tokens = P;
        o.decode_chunk = 1;
        auto r = EvaluateText(l.model.get(), tokens, o);
        ASSERT_TRUE(r.ok()) << r.status().ToString();
        const auto logits = ref->Forward(tokens, {}, Rule(budget, W, P, k, block));
        double most_from_alone = 0;
        for (size_t t = 0; t + 1 < tokens.size(); ++t) {
          const double expected = -LogSoftmax(logits[t])[tokens[t + 1]];
          ASSERT_NEAR(r->token_nll[t], expected, 1e-4) << "position " << t;
          most_from_alone =
              std::max(most_from_alone, std::fabs(expected + LogSoftmax(alone[t])[tokens[t + 1]]));
        }
        // The cache holds at most budget + 110 indices: K = 40 covers them.
        if (k * block < budget + 110) {
          EXPECT_GT(most_from_alone, 1e-3);  // the selection changed something
        } else {
          EXPECT_LT(most_from_alone, 1e-9);  // every block: SnapKV alone
        }
      }
    }
  }
}

// The engine's tokens and logprobs are the reference's under `rule`; returns
// the largest logprob difference from `other` (the reference under another
// rule, for the same tokens).
double ExpectReferenceTokens(const ReferenceModel& ref, const KvEvictionRule& rule,
                             const KvEvictionRule& other, const std::vector<int32_t>& prompt,
                             const Generated& g) {
  const std::vector<int32_t> all = testing::WithSampled(prompt, g.sampled);
  const auto logits = ref.Forward(all, {}, rule), others = ref.Forward(all, {}, other);
  testing::ExpectReferenceTokens(logits, prompt.size(), g.sampled);
  double most = 0;
  for (size_t i = 0; i < g.sampled.size(); ++i) {
    const size_t t = prompt.size() - 1 + i;
    const int32_t got = g.sampled[i].token;
    most = std::max(most, std::fabs(LogSoftmax(logits[t])[got] - LogSoftmax(others[t])[got]));
  }
  return most;
}

// Generation through the engine (prompts of 70 and 77 in chunks of 16,
// blocks of 8, 60 decode steps, K = 2): SnapKV keeps the reference's
// positions in every layer and KV head and Quest then decodes the
// reference's tokens and logprobs, at a budget of whole blocks and one
// ending inside a block; the selection differs from SnapKV alone, and the
// attention reads fewer bytes than SnapKV alone does.
TEST(EngineQuestSnapKvTest, GenerationMatchesTheReferenceRules) {
  const auto ref = testing::LoadReference(Dir());
  ASSERT_NE(ref, nullptr);
  const int64_t W = 8, bs = 8, K = 2;
  for (const int64_t B : {32, 30}) {
    testing::LoadedCpuModel both = testing::LoadCpuModel(Dir(), Both(B, W, K));
    testing::LoadedCpuModel snap = testing::LoadCpuModel(Dir(), testing::SnapKv(B, W));
    ASSERT_NE(both.model, nullptr);
    ASSERT_NE(snap.model, nullptr);
    EngineOptions o;
    o.block_size = bs;
    o.max_num_batched_tokens = 16;
    o.kv_cache_bytes = 8 << 20;
    auto e = Engine::Create(both.model.get(), o), alone = Engine::Create(snap.model.get(), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    ASSERT_TRUE(alone.ok()) << alone.status().ToString();
    for (const int64_t P : {70, 77}) {
      SCOPED_TRACE("budget " + std::to_string(B) + " prompt " + std::to_string(P));
      const auto prompt = RandomTokens(P, Spec().vocab_size(), 20 + P);
      const int64_t before = both.backend->kv_bytes_read();
      const auto g = Generate(**e, P, prompt, 60);
      const int64_t read = both.backend->kv_bytes_read() - before;
      ASSERT_EQ(g.sampled.size(), 60u);
      std::vector<std::vector<std::vector<int64_t>>> kept;
      const double most = ExpectReferenceTokens(*ref, Rule(B, W, P, K, bs, &kept),
                                                KvEvictionRule::SnapKv(B, W, P), prompt, g);
      EXPECT_EQ(g.kept, Flatten(kept));
      EXPECT_NE(g.kept[0], g.kept[1]);  // each KV head's blocks hold its own positions
      EXPECT_GT(most, 1e-3);            // Quest changed what SnapKV alone gives
      const int64_t before_alone = snap.backend->kv_bytes_read();
      const auto a = Generate(**alone, P, prompt, 60);
      ASSERT_EQ(a.kept, g.kept);
      EXPECT_LT(read, snap.backend->kv_bytes_read() - before_alone);
    }
    ASSERT_TRUE((*e)->block_manager().CheckInvariants().ok());
  }
}

// The real model: a 300-token prompt (its own greedy continuation of a story
// start) compressed to 64 and to 128 tokens at blocks of 16, then 60 decode
// steps selecting 2 and 4 blocks: the reference's kept sets, tokens and
// logprobs.
TEST(EngineQuestSnapKvTest, RealModelMatchesTheReferenceRules) {
  const std::string dir = testing::RealModelDir();
  if (dir.empty()) GTEST_SKIP() << "the real model stories260K is absent";
  const auto ref = testing::LoadReference(dir);
  ASSERT_NE(ref, nullptr);
  std::vector<int32_t> prompt = {1, 403, 407};
  {
    testing::LoadedCpuModel dense = testing::LoadCpuModel(dir);
    ASSERT_NE(dense.model, nullptr);
    auto e = Engine::Create(dense.model.get(), EngineOptions{});
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    for (const auto& s : Generate(**e, 1, prompt, 297).sampled) prompt.push_back(s.token);
  }
  ASSERT_EQ(prompt.size(), 300u);
  const int64_t W = 16, bs = 16;
  for (auto [B, K] : {std::pair<int64_t, int64_t>{64, 2}, std::pair<int64_t, int64_t>{128, 4}}) {
    SCOPED_TRACE("budget " + std::to_string(B) + " K " + std::to_string(K));
    testing::LoadedCpuModel l = testing::LoadCpuModel(dir, Both(B, W, K));
    ASSERT_NE(l.model, nullptr);
    EngineOptions o;
    o.block_size = bs;
    o.kv_cache_bytes = 16 << 20;
    o.max_num_batched_tokens = 128;
    auto e = Engine::Create(l.model.get(), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    const auto g = Generate(**e, 1, prompt, 60);
    ASSERT_EQ(g.sampled.size(), 60u);
    std::vector<std::vector<std::vector<int64_t>>> kept;
    const double most = ExpectReferenceTokens(*ref, Rule(B, W, 300, K, bs, &kept),
                                              KvEvictionRule::SnapKv(B, W, 300), prompt, g);
    EXPECT_EQ(g.kept, Flatten(kept));
    EXPECT_GT(most, 1e-3);
  }
}

// Disaggregated: a prefill engine compresses a 70-token prompt to 30 (blocks
// of 8: the last of 4 compacted blocks holds 6 rows) and hands out only the
// compacted blocks' bytes (a memcpy standing in for the transport; key
// bounds live beside the pool, so none cross). The decode engine computes
// the bounds of what it received and decodes exactly what one engine alone
// decodes, which Quest makes differ from SnapKV alone.
TEST(EngineQuestSnapKvTest, RemotePrefillRecomputesTheBoundsOnTheReceiver) {
  const int64_t B = 30, W = 8, bs = 8, K = 2, P = 70;
  testing::LoadedCpuModel l = testing::LoadCpuModel(Dir(), Both(B, W, K));
  testing::LoadedCpuModel snap = testing::LoadCpuModel(Dir(), testing::SnapKv(B, W));
  ASSERT_NE(l.model, nullptr);
  ASSERT_NE(snap.model, nullptr);
  EngineOptions o;
  o.block_size = bs;
  o.max_num_batched_tokens = 16;
  o.kv_cache_bytes = 8 << 20;
  auto make = [&](Model* m) {
    auto e = Engine::Create(m, o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(*e);
  };
  const auto prompt = RandomTokens(P, Spec().vocab_size(), 33);
  const auto expected = Generate(*make(l.model.get()), 1, prompt, 40).sampled;
  const auto without = Generate(*make(snap.model.get()), 1, prompt, 40).sampled;
  ASSERT_EQ(expected.size(), 40u);
  ASSERT_EQ(without.size(), 40u);
  bool differs = false;
  for (size_t i = 0; i < expected.size(); ++i) {
    differs |= expected[i].token != without[i].token ||
               std::fabs(expected[i].logprob - without[i].logprob) > 1e-3;
  }
  EXPECT_TRUE(differs) << "Quest selected nothing that matters here";

  auto prefill = make(l.model.get()), decode = make(l.model.get());
  EngineRequest r = GreedyRequest(prompt, 40);
  auto plan = decode->AddRemotePrefillRequest(r);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->snapkv_dropped_tokens, P - B);
  ASSERT_EQ(plan->fill.size(), static_cast<size_t>((B + bs - 1) / bs));
  RequestOutput done;
  ASSERT_NO_FATAL_FAILURE(PrefillOnly(*prefill, r, &done));
  ASSERT_EQ(done.new_token_ids.size(), 1u);
  ASSERT_NO_FATAL_FAILURE(testing::MoveHandedOffBlocks(*prefill, done, *plan, *decode));
  auto first = decode->CompleteRemotePrefill(1, done.new_token_ids[0], done.logprobs[0]);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  std::vector<SampledToken> got = first->logprobs;
  while (decode->HasUnfinished()) {
    auto step = decode->Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    for (const auto& out : *step) got.insert(got.end(), out.logprobs.begin(), out.logprobs.end());
  }
  ASSERT_EQ(got.size(), expected.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].token, expected[i].token) << i;
    EXPECT_NEAR(got[i].logprob, expected[i].logprob, 1e-5) << i;
  }
  EXPECT_EQ(decode->GetStats().blocks.used_blocks, 0u);
  ASSERT_TRUE(decode->block_manager().CheckInvariants().ok());
}

// A hot-prefix copy of a prompt SnapKV would compress (EngineRequest::
// snapkv_dense, a request that decodes on) caches the dense blocks it
// received before prefilling again from them: their key bounds are computed
// then, so a later request within the budget that hits them (28 tokens, 24
// cached) decodes as it does on an engine of its own.
TEST(EngineQuestSnapKvTest, CopiedDenseBlocksAreCachedWithTheirBounds) {
  const int64_t B = 32, W = 8, bs = 8, K = 2, P = 70;
  testing::LoadedCpuModel l = testing::LoadCpuModel(Dir(), Both(B, W, K));
  ASSERT_NE(l.model, nullptr);
  EngineOptions o;
  o.block_size = bs;
  o.max_num_batched_tokens = 16;
  o.kv_cache_bytes = 8 << 20;
  auto make = [&] {
    auto e = Engine::Create(l.model.get(), o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(*e);
  };
  const auto prompt = RandomTokens(P, Spec().vocab_size(), 7);
  const std::vector<int32_t> shorter(prompt.begin(), prompt.begin() + 28);
  const auto expected = Generate(*make(), 5, shorter, 60).sampled;
  ASSERT_EQ(expected.size(), 60u);

  auto prefill = make(), decode = make();
  EngineRequest r = GreedyRequest(prompt, 30);
  r.snapkv_dense = true;
  auto plan = decode->AddRemotePrefillRequest(r);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  RequestOutput done;
  ASSERT_NO_FATAL_FAILURE(PrefillOnly(*prefill, r, &done));
  ASSERT_EQ(done.new_token_ids.size(), 1u);
  ASSERT_NO_FATAL_FAILURE(testing::MoveHandedOffBlocks(*prefill, done, *plan, *decode));
  ASSERT_TRUE(decode->CompleteRemotePrefill(1, done.new_token_ids[0], done.logprobs[0]).ok());
  while (decode->HasUnfinished()) ASSERT_TRUE(decode->Step().ok());

  const testing::Generated later = Generate(*decode, 2, shorter, 60);
  EXPECT_EQ(later.cached_tokens, 24);
  ASSERT_EQ(later.sampled.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_EQ(later.sampled[i].token, expected[i].token) << i;
    EXPECT_NEAR(later.sampled[i].logprob, expected[i].logprob, 1e-5) << i;
  }
}

}  // namespace
}  // namespace pdserve
