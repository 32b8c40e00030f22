// Disaggregated prefill/decode between two engines in one process: the
// prefill engine computes a prompt's KV and hands out its block ids; a
// memcpy between the two pools stands in for the transport; the decode
// engine continues from the first token and must produce exactly what one
// engine alone produces.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "engine/engine.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

class EngineDisaggTest : public ::testing::TestWithParam<DType> {
 protected:
  static void SetUpTestSuite() {
    model_ = testing::TinyCpuModel();
    ASSERT_NE(model_, nullptr);
  }

  std::unique_ptr<Engine> MakeEngine() {
    EngineOptions o;
    o.kv_cache_bytes = 2 << 20;
    o.kv_dtype = GetParam();
    o.max_num_batched_tokens = 32;
    auto e = Engine::Create(model_, o);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(*e);
  }

  static EngineRequest Request(RequestId id, int prompt_len, uint32_t seed, int max_tokens) {
    std::mt19937 rng(seed);
    EngineRequest r;
    r.id = id;
    for (int i = 0; i < prompt_len; ++i) r.prompt.push_back(static_cast<TokenId>(rng() % 512));
    r.params.temperature = 0.9f;  // sampled, with a seed both engines share
    r.params.seed = seed;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    return r;
  }

  static std::vector<TokenId> Drain(Engine& e, RequestId id) {
    std::vector<TokenId> out;
    while (e.HasUnfinished()) {
      auto step = e.Step();
      EXPECT_TRUE(step.ok()) << step.status().ToString();
      if (!step.ok()) break;
      for (const auto& o : *step) {
        if (o.id == id) out.insert(out.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      }
    }
    return out;
  }

  // The remote prefill is done: the first token's output, then the rest.
  static std::vector<TokenId> CompleteAndDrain(Engine& e, RequestId id, TokenId first) {
    auto out = e.CompleteRemotePrefill(id, first);
    EXPECT_TRUE(out.ok()) << out.status().ToString();
    if (!out.ok()) return {};
    EXPECT_EQ(out->id, id);
    std::vector<TokenId> tokens = out->new_token_ids;
    const std::vector<TokenId> rest = Drain(e, id);
    tokens.insert(tokens.end(), rest.begin(), rest.end());
    return tokens;
  }

  // The prefill side: runs the prompt, returns its first token and pinned blocks.
  static RequestOutput Prefill(Engine& p, EngineRequest r) {
    r.prefill_only = true;
    EXPECT_TRUE(p.AddRequest(std::move(r)).ok());
    RequestOutput result;
    while (p.HasUnfinished()) {
      auto step = p.Step();
      EXPECT_TRUE(step.ok());
      for (const auto& o : *step) {
        if (o.finished) result = o;
      }
    }
    return result;
  }

  static void CopyBlocks(const Engine& from, const std::vector<BlockId>& src, Engine& to,
                         const RemotePrefillPlan& plan) {
    ASSERT_EQ(src.size(), plan.block_ids.size());
    const int64_t bytes = from.kv_pool().bytes_per_block();
    ASSERT_EQ(bytes, to.kv_pool().bytes_per_block());
    for (size_t i = plan.first_block_to_fill; i < src.size(); ++i) {
      std::memcpy(to.kv_pool().block(plan.block_ids[i]), from.kv_pool().block(src[i]), bytes);
    }
  }

  static Model* model_;
};
Model* EngineDisaggTest::model_ = nullptr;

TEST_P(EngineDisaggTest, RemotePrefillContinuesExactly) {
  const EngineRequest request = Request(1, 50, 1234, 20);
  auto alone = MakeEngine();
  ASSERT_TRUE(alone->AddRequest(request).ok());
  const auto expected = Drain(*alone, 1);
  ASSERT_EQ(expected.size(), 20u);

  auto prefill = MakeEngine();
  auto decode = MakeEngine();
  auto plan = decode->AddRemotePrefillRequest(request);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_EQ(plan->block_ids.size(), 4u);  // 50 tokens in blocks of 16
  EXPECT_EQ(plan->first_block_to_fill, 0u);
  EXPECT_EQ(decode->GetStats().num_remote_waiting, 1);
  // Parked: stepping the decode engine does nothing for it.
  auto idle = decode->Step();
  ASSERT_TRUE(idle.ok());
  EXPECT_TRUE(idle->empty());

  const RequestOutput done = Prefill(*prefill, request);
  ASSERT_TRUE(done.finished);
  ASSERT_EQ(done.new_token_ids.size(), 1u);
  EXPECT_EQ(done.new_token_ids[0], expected[0]);
  ASSERT_TRUE(done.kv_pin.has_value());
  CopyBlocks(*prefill, done.kv_blocks, *decode, *plan);
  ASSERT_TRUE(prefill->ReleaseKvBlocks(*done.kv_pin).ok());
  EXPECT_EQ(prefill->GetStats().blocks.used_blocks, 0u);
  EXPECT_EQ(prefill->GetStats().blocks.cached_blocks, 3u);  // the full blocks stay cached

  EXPECT_EQ(CompleteAndDrain(*decode, 1, done.new_token_ids[0]), expected);
  EXPECT_EQ(decode->GetStats().blocks.used_blocks, 0u);

  // The received blocks are now in the decode engine's prefix cache: a
  // second request with the same prompt reuses them and fills only the rest.
  EngineRequest again = request;
  again.id = 2;
  auto plan2 = decode->AddRemotePrefillRequest(again);
  ASSERT_TRUE(plan2.ok());
  EXPECT_EQ(plan2->first_block_to_fill, 3u);
  EXPECT_EQ(plan2->num_cached_tokens, 48);
  // The hit rate counts prefill computation only: a decode engine that
  // computed no prompt itself has neither queries nor hits.
  EXPECT_EQ(decode->GetStats().blocks.prefix_cache_query_tokens, 0u);
  EXPECT_EQ(decode->GetStats().blocks.prefix_cache_hit_tokens, 0u);
  const RequestOutput done2 = Prefill(*prefill, again);
  CopyBlocks(*prefill, done2.kv_blocks, *decode, *plan2);
  ASSERT_TRUE(prefill->ReleaseKvBlocks(*done2.kv_pin).ok());
  EXPECT_EQ(CompleteAndDrain(*decode, 2, done2.new_token_ids[0]), expected);
}

TEST_P(EngineDisaggTest, FailedRemotePrefillFallsBackToLocal) {
  const EngineRequest request = Request(1, 37, 99, 10);
  auto alone = MakeEngine();
  ASSERT_TRUE(alone->AddRequest(request).ok());
  const auto expected = Drain(*alone, 1);

  auto decode = MakeEngine();
  ASSERT_TRUE(decode->AddRemotePrefillRequest(request).ok());
  EXPECT_GT(decode->GetStats().blocks.used_blocks, 0u);
  auto failed = decode->FailRemotePrefill(1);
  ASSERT_TRUE(failed.ok());
  EXPECT_FALSE(failed->has_value()) << "nothing is held unless asked";
  EXPECT_EQ(decode->FailRemotePrefill(1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(Drain(*decode, 1), expected);
  // The local prefill is this engine's prefill computation: it counts in the
  // prefix-cache query counter (it used to count nothing after a remote try).
  EXPECT_EQ(decode->GetStats().blocks.prefix_cache_query_tokens, 37u);
}

// A peer that was given up on may still write into the blocks it was to
// fill: held, they stay out of every other use (the request prefills into
// other blocks) until released, while the cached prefix stays shared.
TEST_P(EngineDisaggTest, FailedRemotePrefillCanHoldTheBlocksThePeerWasToFill) {
  const EngineRequest first = Request(1, 40, 5, 4);
  EngineRequest second = Request(2, 70, 6, 6);
  // The second prompt starts with the first's two full blocks (16 tokens each).
  std::copy(first.prompt.begin(), first.prompt.begin() + 32, second.prompt.begin());
  auto alone = MakeEngine();
  ASSERT_TRUE(alone->AddRequest(second).ok());
  const auto expected = Drain(*alone, 2);

  auto decode = MakeEngine();
  ASSERT_TRUE(decode->AddRequest(first).ok());
  Drain(*decode, 1);  // leaves its two full blocks cached
  auto plan = decode->AddRemotePrefillRequest(second);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->first_block_to_fill, 2u);
  const std::vector<BlockId> to_fill(plan->block_ids.begin() + 2, plan->block_ids.end());
  ASSERT_EQ(to_fill.size(), 3u);

  auto held = decode->FailRemotePrefill(2, /*hold_unfilled=*/true);
  ASSERT_TRUE(held.ok()) << held.status().ToString();
  ASSERT_TRUE(held->has_value());
  EXPECT_EQ(decode->block_manager().PinnedBlocks(**held), to_fill);
  for (BlockId b : to_fill) EXPECT_EQ(decode->block_manager().RefCount(b), 1u) << b;

  // The local prefill never touches a held block, and gets the same tokens.
  std::vector<TokenId> got;
  while (decode->HasUnfinished()) {
    for (BlockId b : decode->block_manager().BlockTable(2)) {
      EXPECT_EQ(std::count(to_fill.begin(), to_fill.end(), b), 0) << "block " << b << " reused";
    }
    auto outs = decode->Step();
    ASSERT_TRUE(outs.ok());
    for (const auto& o : *outs)
      got.insert(got.end(), o.new_token_ids.begin(), o.new_token_ids.end());
  }
  EXPECT_EQ(got, expected);
  for (BlockId b : to_fill) EXPECT_EQ(decode->block_manager().RefCount(b), 1u) << b;

  ASSERT_TRUE(decode->ReleaseKvBlocks(**held).ok());
  for (BlockId b : to_fill) EXPECT_EQ(decode->block_manager().RefCount(b), 0u) << b;
  EXPECT_EQ(decode->GetStats().blocks.used_blocks, 0u);
}

// A streamed prefill reports each chunk's full blocks as it completes them,
// under pins of their own; copying those early and the rest at the end gives
// the decode engine exactly what one engine alone produces.
TEST_P(EngineDisaggTest, StreamedPrefillReportsFullBlocksChunkByChunk) {
  const EngineRequest request = Request(1, 100, 4321, 12);  // 32-token chunks, 16-token blocks
  auto alone = MakeEngine();
  ASSERT_TRUE(alone->AddRequest(request).ok());
  const auto expected = Drain(*alone, 1);

  auto prefill = MakeEngine();
  auto decode = MakeEngine();
  auto plan = decode->AddRemotePrefillRequest(request);
  ASSERT_TRUE(plan.ok());
  ASSERT_EQ(plan->block_ids.size(), 7u);
  EngineRequest streamed = request;
  streamed.prefill_only = true;
  streamed.stream_kv_blocks = true;
  ASSERT_TRUE(prefill->AddRequest(streamed).ok());
  const int64_t bytes = prefill->kv_pool().bytes_per_block();
  std::vector<size_t> reported;
  size_t sent = 0;
  RequestOutput last;
  while (prefill->HasUnfinished()) {
    auto step = prefill->Step();
    ASSERT_TRUE(step.ok());
    for (const auto& o : *step) {
      ASSERT_TRUE(o.kv_pin.has_value());
      for (; sent < o.kv_blocks.size(); ++sent) {
        std::memcpy(decode->kv_pool().block(plan->block_ids[sent]),
                    prefill->kv_pool().block(o.kv_blocks[sent]), bytes);
      }
      if (o.finished) {
        last = o;
      } else {
        EXPECT_TRUE(o.new_token_ids.empty());
        reported.push_back(o.kv_blocks.size());
        ASSERT_TRUE(prefill->ReleaseKvBlocks(*o.kv_pin).ok());
      }
    }
  }
  EXPECT_EQ(reported, (std::vector<size_t>{2, 4, 6}));  // after 32, 64 and 96 tokens
  ASSERT_TRUE(last.finished);
  EXPECT_EQ(last.kv_blocks.size(), 7u);
  ASSERT_TRUE(prefill->ReleaseKvBlocks(*last.kv_pin).ok());
  EXPECT_EQ(prefill->GetStats().blocks.used_blocks, 0u);
  EXPECT_EQ(prefill->GetStats().blocks.num_pins, 0u);
  EXPECT_EQ(CompleteAndDrain(*decode, 1, last.new_token_ids[0]), expected);
}

TEST_P(EngineDisaggTest, CancelParkedRequestFreesReservation) {
  auto decode = MakeEngine();
  ASSERT_TRUE(decode->AddRemotePrefillRequest(Request(1, 40, 5, 10)).ok());
  EXPECT_EQ(decode->GetStats().blocks.used_blocks, 3u);
  ASSERT_TRUE(decode->Cancel(1).ok());
  EXPECT_EQ(decode->GetStats().blocks.used_blocks, 0u);
  EXPECT_FALSE(decode->HasUnfinished());
  EXPECT_EQ(decode->CompleteRemotePrefill(1, 0).status().code(), StatusCode::kNotFound);
}

// A prefill peer's scores of the first token are taken as a sampler's
// would be: no more alternatives than the request asked for, and
// log-probabilities (a NaN is -inf, nothing above 0).
TEST_P(EngineDisaggTest, APeersFirstTokenScoresAreBoundedAsTheRequestAsked) {
  auto decode = MakeEngine();
  EngineRequest r = Request(1, 40, 5, 3);
  r.params.logprobs = 2;
  ASSERT_TRUE(decode->AddRemotePrefillRequest(r).ok());
  SampledToken peer;
  peer.token = 7;
  peer.logprob = std::nanf("");
  for (int k = 0; k < 50; ++k) peer.top_logprobs.push_back({k, k == 0 ? 3.0f : -1.0f * k});
  auto first = decode->CompleteRemotePrefill(1, 7, peer);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  ASSERT_EQ(first->logprobs.size(), 1u);
  const SampledToken& got = first->logprobs[0];
  EXPECT_EQ(got.logprob, -INFINITY);
  ASSERT_EQ(got.top_logprobs.size(), 2u);
  EXPECT_EQ(got.top_logprobs[0].logprob, 0.0f);
  EXPECT_EQ(got.top_logprobs[1].logprob, -1.0f);
  ASSERT_TRUE(decode->Cancel(1).ok() || !decode->HasUnfinished());
}

// A prefill peer's first token outside allowed_token_ids, or a one-token
// bad word, is refused (the worker then prefills locally) and changes
// nothing: an allowed one is taken after.
TEST_P(EngineDisaggTest, RemoteFirstTokensTheRequestForbidsAreRefused) {
  auto decode = MakeEngine();
  EngineRequest r = Request(1, 40, 5, 10);
  r.params.allowed_token_ids = {5, 6};
  r.params.bad_words_token_ids = {{5}, {6, 6}};
  ASSERT_TRUE(decode->AddRemotePrefillRequest(r).ok());
  for (TokenId refused : {7, 5}) {
    auto out = decode->CompleteRemotePrefill(1, refused);
    ASSERT_FALSE(out.ok()) << refused;
    EXPECT_EQ(out.status().code(), StatusCode::kInvalidArgument) << refused;
  }
  auto out = decode->CompleteRemotePrefill(1, 6);
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_EQ(out->new_token_ids, (std::vector<TokenId>{6}));
  ASSERT_TRUE(decode->Cancel(1).ok());
  EXPECT_EQ(decode->GetStats().blocks.used_blocks, 0u);
}

// A first token that ends the request (max_tokens 1, a stop token) comes
// back finished from CompleteRemotePrefill itself: nothing is left to step,
// and every block is free at once.
TEST_P(EngineDisaggTest, RemoteFirstTokenThatEndsTheRequestFinishesAtOnce) {
  auto prefill = MakeEngine();
  auto decode = MakeEngine();
  EngineRequest one = Request(1, 40, 7, 1);
  EngineRequest stop = Request(2, 45, 8, 10);
  const RequestOutput first_of_stop = Prefill(*prefill, stop);
  ASSERT_TRUE(prefill->ReleaseKvBlocks(*first_of_stop.kv_pin).ok());
  stop.params.stop_token_ids = {first_of_stop.new_token_ids[0]};
  for (const EngineRequest& r : {one, stop}) {
    SCOPED_TRACE(r.id);
    auto plan = decode->AddRemotePrefillRequest(r);
    ASSERT_TRUE(plan.ok()) << plan.status().ToString();
    const RequestOutput done = Prefill(*prefill, r);
    CopyBlocks(*prefill, done.kv_blocks, *decode, *plan);
    ASSERT_TRUE(prefill->ReleaseKvBlocks(*done.kv_pin).ok());
    auto out = decode->CompleteRemotePrefill(r.id, done.new_token_ids[0]);
    ASSERT_TRUE(out.ok()) << out.status().ToString();
    EXPECT_EQ(out->new_token_ids, done.new_token_ids);
    EXPECT_TRUE(out->finished);
    EXPECT_EQ(out->finish_reason, r.id == 1 ? FinishReason::kLength : FinishReason::kStop);
    EXPECT_FALSE(decode->HasUnfinished());
    EXPECT_EQ(decode->GetStats().blocks.used_blocks, 0u);
    auto step = decode->Step();
    ASSERT_TRUE(step.ok());
    EXPECT_TRUE(step->empty()) << "a finished request was reported again";
    EXPECT_EQ(decode->Cancel(r.id).code(), StatusCode::kNotFound);
  }
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, EngineDisaggTest,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kFP8E4M3,
                                           DType::kFP8E5M2, DType::kNvFp4),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

}  // namespace
}  // namespace pdserve
