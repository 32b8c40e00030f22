// Scheduler behaviour: greedy output does not depend on prefix-cache hits,
// prefill chunk size, batch company or preemption; cancellation frees
// everything; bad requests are refused with clear errors.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "engine/engine.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

constexpr int64_t kBlockBytes = 8 << 10;  // tiny model, fp32 KV, 16 tokens per block

class EngineSchedulerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_ = testing::TinyCpuModel();
    ASSERT_NE(model_, nullptr);
  }

  std::unique_ptr<Engine> MakeEngine(EngineOptions options = {}) {
    if (options.kv_cache_bytes == EngineOptions{}.kv_cache_bytes) options.kv_cache_bytes = 4 << 20;
    auto e = Engine::Create(model_, options);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    return std::move(*e);
  }

  static std::vector<TokenId> Prompt(int n, uint32_t seed) {
    std::mt19937 rng(seed);
    std::vector<TokenId> p(n);
    for (auto& t : p) t = static_cast<TokenId>(rng() % 512);
    return p;
  }

  static EngineRequest Greedy(RequestId id, std::vector<TokenId> prompt, int max_tokens) {
    EngineRequest r;
    r.id = id;
    r.prompt = std::move(prompt);
    r.params.temperature = 0;
    r.params.max_tokens = max_tokens;
    r.params.ignore_eos = true;
    return r;
  }

  // Runs the engine dry; returns each request's generated tokens.
  static std::map<RequestId, std::vector<TokenId>> RunAll(
      Engine& e, std::map<RequestId, RequestOutput>* last = nullptr) {
    std::map<RequestId, std::vector<TokenId>> out;
    int guard = 0;
    while (e.HasUnfinished()) {
      auto step = e.Step();
      EXPECT_TRUE(step.ok()) << step.status().ToString();
      if (!step.ok()) break;
      for (const auto& o : *step) {
        auto& v = out[o.id];
        v.insert(v.end(), o.new_token_ids.begin(), o.new_token_ids.end());
        if (last && o.finished) (*last)[o.id] = o;
      }
      EXPECT_LT(++guard, 100000) << "engine does not make progress";
      if (guard >= 100000) break;
    }
    Status inv = e.block_manager().CheckInvariants();
    EXPECT_TRUE(inv.ok()) << inv.ToString();
    return out;
  }

  std::vector<TokenId> Alone(const EngineRequest& r, EngineOptions options = {}) {
    auto e = MakeEngine(options);
    EXPECT_TRUE(e->AddRequest(r).ok());
    return RunAll(*e)[r.id];
  }

  static Model* model_;
};
Model* EngineSchedulerTest::model_ = nullptr;

TEST_F(EngineSchedulerTest, PrefixCacheHitGivesSameTokens) {
  const auto prompt = Prompt(70, 1);
  EngineOptions no_cache;
  no_cache.enable_prefix_caching = false;
  const auto expected = Alone(Greedy(1, prompt, 24), no_cache);
  ASSERT_EQ(expected.size(), 24u);

  auto e = MakeEngine();
  ASSERT_TRUE(e->AddRequest(Greedy(1, prompt, 24)).ok());
  std::map<RequestId, RequestOutput> last;
  auto first = RunAll(*e, &last);
  EXPECT_EQ(first[1], expected);
  ASSERT_TRUE(e->AddRequest(Greedy(2, prompt, 24)).ok());
  auto step = e->Step();
  ASSERT_TRUE(step.ok());
  ASSERT_EQ(step->size(), 1u);
  // 69 tokens hashable (the last is always computed): 4 full blocks reused.
  EXPECT_EQ((*step)[0].num_cached_tokens, 64);
  auto rest = RunAll(*e);
  std::vector<TokenId> second = (*step)[0].new_token_ids;
  second.insert(second.end(), rest[2].begin(), rest[2].end());
  EXPECT_EQ(second, expected);
  const auto stats = e->GetStats().blocks;
  EXPECT_EQ(stats.prefix_cache_query_tokens, 140u);
  EXPECT_EQ(stats.prefix_cache_hit_tokens, 64u);
  EXPECT_EQ(stats.used_blocks, 0u);
  // A different cache salt must not hit.
  EngineRequest salted = Greedy(3, prompt, 4);
  salted.cache_salt = "tenant-b";
  ASSERT_TRUE(e->AddRequest(salted).ok());
  auto salted_step = e->Step();
  ASSERT_TRUE(salted_step.ok());
  EXPECT_EQ((*salted_step)[0].num_cached_tokens, 0);
  RunAll(*e);
}

TEST_F(EngineSchedulerTest, ChunkSizeDoesNotChangeTokens) {
  const auto prompt = Prompt(75, 2);
  EngineOptions reference_options;
  reference_options.max_num_batched_tokens = 4096;
  const auto expected = Alone(Greedy(1, prompt, 20), reference_options);
  for (int64_t chunk : {1, 7, 16, 512}) {
    SCOPED_TRACE(chunk);
    EngineOptions o;
    o.max_num_batched_tokens = chunk;
    EXPECT_EQ(Alone(Greedy(1, prompt, 20), o), expected);
  }
}

TEST_F(EngineSchedulerTest, BatchCompanyDoesNotChangeTokens) {
  const EngineRequest target = Greedy(100, Prompt(41, 3), 30);
  const auto expected = Alone(target);
  // A seeded sampled request must also be reproducible inside a batch.
  EngineRequest sampled = Greedy(200, Prompt(19, 4), 25);
  sampled.params.temperature = 0.8f;
  sampled.params.top_p = 0.9f;
  sampled.params.seed = 42;
  const auto expected_sampled = Alone(sampled);

  EngineOptions o;
  o.max_num_batched_tokens = 64;  // forces mixed prefill chunks and decodes
  auto e = MakeEngine(o);
  std::mt19937 rng(5);
  for (int i = 0; i < 8; ++i) {
    EngineRequest other = Greedy(i + 1, Prompt(5 + rng() % 90, 10 + i), 5 + rng() % 30);
    if (i % 2) {
      other.params.temperature = 1.0f;
      other.params.top_k = 20;
      other.params.seed = i;
    }
    ASSERT_TRUE(e->AddRequest(other).ok());
    if (i == 3) {
      ASSERT_TRUE(e->AddRequest(target).ok());
    }
  }
  ASSERT_TRUE(e->AddRequest(sampled).ok());
  auto out = RunAll(*e);
  EXPECT_EQ(out[100], expected);
  EXPECT_EQ(out[200], expected_sampled);
  EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u);
}

TEST_F(EngineSchedulerTest, PreemptionAndRecomputeGiveSameTokens) {
  std::vector<EngineRequest> requests;
  std::map<RequestId, std::vector<TokenId>> expected;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(Greedy(i + 1, Prompt(40, 20 + i), 30));
    if (i == 2) {
      requests.back().params.temperature = 0.7f;
      requests.back().params.seed = 7;
    }
    expected[i + 1] = Alone(requests.back());
  }
  EngineOptions o;
  o.kv_cache_bytes = 9 * kBlockBytes;  // 9 blocks; each request grows to 5
  auto e = MakeEngine(o);
  for (const auto& r : requests) ASSERT_TRUE(e->AddRequest(r).ok());
  auto out = RunAll(*e);
  EXPECT_GT(e->GetStats().num_preemptions, 0u);
  for (const auto& [id, tokens] : expected) EXPECT_EQ(out[id], tokens) << "request " << id;
  const auto stats = e->GetStats().blocks;
  EXPECT_EQ(stats.used_blocks, 0u);
  EXPECT_EQ(stats.free_blocks + stats.evictable_blocks, stats.num_blocks);
}

// Every request sampled with its own seed, so whichever is preempted (the
// newest running one) is a seeded one: its recomputed prompt and outputs
// continue the tokens it would have drawn alone (sampling is keyed by seed
// and output index, not by step).
TEST_F(EngineSchedulerTest, SeededSamplingIsUnchangedByPreemption) {
  std::vector<EngineRequest> requests;
  std::map<RequestId, std::vector<TokenId>> expected;
  for (int i = 0; i < 4; ++i) {
    requests.push_back(Greedy(i + 1, Prompt(40, 30 + i), 30));
    requests.back().params.temperature = 0.8f;
    requests.back().params.top_p = 0.95f;
    requests.back().params.seed = 100 + i;
    expected[i + 1] = Alone(requests.back());
  }
  EngineOptions o;
  o.kv_cache_bytes = 9 * kBlockBytes;  // 9 blocks; each request grows to 5
  auto e = MakeEngine(o);
  for (const auto& r : requests) ASSERT_TRUE(e->AddRequest(r).ok());
  auto out = RunAll(*e);
  EXPECT_GT(e->GetStats().num_preemptions, 0u);
  for (const auto& [id, tokens] : expected) {
    EXPECT_EQ(out[id].size(), 30u);
    EXPECT_EQ(out[id], tokens) << "request " << id;
  }
  // The seeds matter: two requests of one prompt and other seeds differ.
  EngineRequest a = requests[0], b = requests[0];
  b.id = 99;
  b.params.seed = 101;
  EXPECT_NE(Alone(a), Alone(b));
}

// A request that ends before its first token (its masks allow none) still
// reports the prefix it found cached, for its usage.
TEST_F(EngineSchedulerTest, ARequestEndingWithoutATokenReportsItsCachedPrefix) {
  auto e = MakeEngine();
  const std::vector<TokenId> prompt = Prompt(40, 60);
  ASSERT_TRUE(e->AddRequest(Greedy(1, prompt, 2)).ok());
  RunAll(*e);
  EngineRequest none = Greedy(2, prompt, 2);
  none.params.allowed_token_ids = {5};
  none.params.bad_words_token_ids = {{5}};
  ASSERT_TRUE(e->AddRequest(none).ok());
  std::map<RequestId, RequestOutput> last;
  auto out = RunAll(*e, &last);
  EXPECT_TRUE(out[2].empty());
  ASSERT_TRUE(last.count(2));
  EXPECT_EQ(last[2].finish_reason, FinishReason::kLength);
  EXPECT_EQ(last[2].num_cached_tokens, 32);  // two full blocks of the prompt
}

// Priority (vLLM's policy): the queue runs lower values first, arrival
// order among equals.
TEST_F(EngineSchedulerTest, PriorityOrdersTheQueue) {
  EngineOptions o;
  o.max_num_seqs = 1;  // one at a time: the order is the finishing order
  auto e = MakeEngine(o);
  const int priorities[] = {1, 0, 1, -3};
  for (int i = 0; i < 4; ++i) {
    EngineRequest r = Greedy(i + 1, Prompt(20, 40 + i), 4);
    r.priority = priorities[i];
    ASSERT_TRUE(e->AddRequest(r).ok());
  }
  std::vector<RequestId> finished;
  while (e->HasUnfinished()) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    for (const auto& out : *step) {
      if (out.finished) finished.push_back(out.id);
    }
  }
  EXPECT_EQ(finished, (std::vector<RequestId>{4, 2, 1, 3}));
}

// A request that finds no room preempts a running one of a lower priority
// (and only such a one), which later resumes with the tokens it would have
// had alone.
TEST_F(EngineSchedulerTest, AHigherPriorityRequestPreemptsALowerOne) {
  for (const int late_priority : {0, -1}) {
    SCOPED_TRACE(late_priority);
    EngineRequest early = Greedy(1, Prompt(40, 50), 60);  // 100 tokens: 7 of the 9 blocks
    EngineRequest late = Greedy(2, Prompt(40, 51), 20);   // needs 3 to start
    late.priority = late_priority;
    const std::vector<TokenId> early_alone = Alone(early), late_alone = Alone(late);
    EngineOptions o;
    o.kv_cache_bytes = 9 * kBlockBytes;
    auto e = MakeEngine(o);
    ASSERT_TRUE(e->AddRequest(early).ok());
    std::map<RequestId, std::vector<TokenId>> out;
    std::vector<RequestId> finished;
    auto step = [&] {
      auto s = e->Step();
      ASSERT_TRUE(s.ok()) << s.status().ToString();
      for (const auto& o : *s) {
        out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
        if (o.finished) finished.push_back(o.id);
      }
    };
    while (out[1].size() < 57) step();  // 97 tokens: 7 blocks held, 2 free
    ASSERT_TRUE(e->AddRequest(late).ok());
    while (e->HasUnfinished()) step();
    EXPECT_EQ(out[1], early_alone);
    EXPECT_EQ(out[2], late_alone);
    if (late_priority < 0) {
      EXPECT_GT(e->GetStats().num_preemptions, 0u);
      EXPECT_EQ(finished, (std::vector<RequestId>{2, 1}));
    } else {
      // Equal priority: the request that came first keeps its place.
      EXPECT_EQ(finished, (std::vector<RequestId>{1, 2}));
    }
    Status inv = e->block_manager().CheckInvariants();
    EXPECT_TRUE(inv.ok()) << inv.ToString();
    EXPECT_EQ(e->GetStats().blocks.used_blocks, 0u);
  }
}

// The load report's queued prefill tokens: what is not in the pool yet,
// chunk by chunk, a cached prefix not counted once admitted, remote prompts
// not at all (their prefill worker counts them), decoding sequences zero.
TEST_F(EngineSchedulerTest, QueuedPrefillTokensCountWhatIsNotComputedYet) {
  EngineOptions o;
  o.max_num_batched_tokens = 32;
  auto e = MakeEngine(o);
  EXPECT_EQ(e->GetStats().queued_prefill_tokens, 0);
  const std::vector<TokenId> prompt = Prompt(100, 7);
  ASSERT_TRUE(e->AddRequest(Greedy(1, prompt, 3)).ok());
  ASSERT_TRUE(e->AddRemotePrefillRequest(Greedy(2, Prompt(40, 8), 3)).ok());
  EXPECT_EQ(e->GetStats().queued_prefill_tokens, 100);
  ASSERT_TRUE(e->Step().ok());  // one chunk of 32
  EXPECT_EQ(e->GetStats().queued_prefill_tokens, 68);
  while (e->GetStats().queued_prefill_tokens > 0) ASSERT_TRUE(e->Step().ok());
  // Decoding now: nothing queued while it runs.
  ASSERT_TRUE(e->HasUnfinished());
  ASSERT_TRUE(e->Step().ok());
  EXPECT_EQ(e->GetStats().queued_prefill_tokens, 0);
  ASSERT_TRUE(e->Cancel(2).ok());
  RunAll(*e);
  // The same prompt again: whole while it waits, then its cached prefix
  // (96 tokens in full blocks) is not counted.
  ASSERT_TRUE(e->AddRequest(Greedy(3, prompt, 3)).ok());
  EXPECT_EQ(e->GetStats().queued_prefill_tokens, 100);
  ASSERT_TRUE(e->Step().ok());
  EXPECT_EQ(e->GetStats().queued_prefill_tokens, 0);
  RunAll(*e);
}

TEST_F(EngineSchedulerTest, MaxNumSeqsIsRespected) {
  EngineOptions o;
  o.max_num_seqs = 2;
  auto e = MakeEngine(o);
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(e->AddRequest(Greedy(i + 1, Prompt(10, i), 6)).ok());
  while (e->HasUnfinished()) {
    ASSERT_TRUE(e->Step().ok());
    EXPECT_LE(e->GetStats().num_running, 2);
  }
}

// Remote prefills complete whenever their KV arrives, however many requests
// run: those past max_num_seqs wait their turn in the step, never a step
// past the runner's limits (which would fail every request the worker holds).
TEST_F(EngineSchedulerTest, RemotePrefillsCompletingPastMaxNumSeqsWaitTheirTurn) {
  EngineOptions o;
  o.max_num_seqs = 2;
  auto e = MakeEngine(o);
  for (RequestId id = 1; id <= 3; ++id) {
    ASSERT_TRUE(
        e->AddRemotePrefillRequest(Greedy(id, Prompt(20, static_cast<uint32_t>(id)), 5)).ok());
  }
  std::map<RequestId, int> tokens;
  for (RequestId id = 1; id <= 3; ++id) {
    auto first = e->CompleteRemotePrefill(id, 7);
    ASSERT_TRUE(first.ok()) << first.status().ToString();
    tokens[id] += static_cast<int>(first->new_token_ids.size());
  }
  EXPECT_EQ(e->GetStats().num_running, 3);
  int steps = 0;
  while (e->HasUnfinished()) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    ASSERT_LT(++steps, 100);
    EXPECT_LE(step->size(), 2u);
    for (const auto& out : *step) tokens[out.id] += static_cast<int>(out.new_token_ids.size());
  }
  for (RequestId id = 1; id <= 3; ++id) EXPECT_EQ(tokens[id], 5) << id;
  EXPECT_TRUE(e->block_manager().CheckInvariants().ok());
}

// A queue that cannot move (a sibling waiting on its parked leader) steps
// empty and says so (num_stalled_steps), so that a worker waits for news
// instead of spinning; a step that runs something is not counted.
TEST_F(EngineSchedulerTest, AStepThatCannotMoveCountsAsStalled) {
  auto e = MakeEngine();
  const std::vector<TokenId> prompt = Prompt(40, 10);
  ASSERT_TRUE(e->AddRemotePrefillRequest(Greedy(1, prompt, 4)).ok());
  EngineRequest sibling = Greedy(2, prompt, 4);
  sibling.share_prompt_with = 1;
  ASSERT_TRUE(e->AddRequest(sibling).ok());
  for (int i = 0; i < 3; ++i) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok());
    EXPECT_TRUE(step->empty());
  }
  EXPECT_EQ(e->num_stalled_steps(), 3u);
  EXPECT_EQ(e->GetStats().num_stalled_steps, 3u);
  ASSERT_TRUE(e->CompleteRemotePrefill(1, 7).ok());
  auto step = e->Step();
  ASSERT_TRUE(step.ok());
  EXPECT_FALSE(step->empty());
  EXPECT_EQ(e->num_stalled_steps(), 3u);
}

TEST_F(EngineSchedulerTest, CancelAtAnyPointFreesEverything) {
  // Cancel after k steps, for every k through the life of the requests.
  for (int cancel_after = 0; cancel_after < 12; ++cancel_after) {
    SCOPED_TRACE(cancel_after);
    EngineOptions o;
    o.max_num_batched_tokens = 16;  // several prefill chunks
    auto e = MakeEngine(o);
    ASSERT_TRUE(e->AddRequest(Greedy(1, Prompt(50, 1), 8)).ok());
    ASSERT_TRUE(e->AddRequest(Greedy(2, Prompt(20, 2), 8)).ok());
    for (int s = 0; s < cancel_after && e->HasUnfinished(); ++s) ASSERT_TRUE(e->Step().ok());
    if (e->HasRequest(1)) {
      ASSERT_TRUE(e->Cancel(1).ok());
      EXPECT_EQ(e->Cancel(1).code(), StatusCode::kNotFound);
    }
    RunAll(*e);
    EXPECT_FALSE(e->HasRequest(1));
    const auto stats = e->GetStats().blocks;
    EXPECT_EQ(stats.used_blocks, 0u);
    EXPECT_EQ(stats.num_sequences, 0u);
  }
}

TEST_F(EngineSchedulerTest, StopTokenAndMaxTokensFinish) {
  const auto prompt = Prompt(12, 9);
  const auto greedy = Alone(Greedy(1, prompt, 10));
  ASSERT_EQ(greedy.size(), 10u);
  EngineRequest r = Greedy(1, prompt, 10);
  r.params.stop_token_ids = {greedy[3]};
  auto e = MakeEngine();
  ASSERT_TRUE(e->AddRequest(r).ok());
  std::map<RequestId, RequestOutput> last;
  auto out = RunAll(*e, &last);
  const size_t first_stop = std::find(greedy.begin(), greedy.end(), greedy[3]) - greedy.begin() + 1;
  EXPECT_EQ(out[1].size(), first_stop);
  EXPECT_EQ(last[1].finish_reason, FinishReason::kStop);

  ASSERT_TRUE(e->AddRequest(Greedy(2, prompt, 3)).ok());
  out = RunAll(*e, &last);
  EXPECT_EQ(out[2].size(), 3u);
  EXPECT_EQ(last[2].finish_reason, FinishReason::kLength);
}

TEST_F(EngineSchedulerTest, ContextLimitFinishesWithLength) {
  EngineOptions o;
  o.max_model_len = 20;
  auto e = MakeEngine(o);
  ASSERT_TRUE(e->AddRequest(Greedy(1, Prompt(15, 3), 100)).ok());
  std::map<RequestId, RequestOutput> last;
  auto out = RunAll(*e, &last);
  EXPECT_EQ(out[1].size(), 5u);  // 15 + 5 = the 20-token context
  EXPECT_EQ(last[1].finish_reason, FinishReason::kLength);
}

TEST_F(EngineSchedulerTest, BadRequestsAreRefusedClearly) {
  EngineOptions o;
  o.max_model_len = 100;
  auto e = MakeEngine(o);
  auto expect_error = [&](EngineRequest r, StatusCode code, const std::string& needle) {
    Status st = e->AddRequest(std::move(r));
    EXPECT_EQ(st.code(), code) << st.ToString();
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  expect_error(Greedy(1, {}, 5), StatusCode::kInvalidArgument, "empty");
  expect_error(Greedy(1, Prompt(100, 1), 5), StatusCode::kInvalidArgument, "context");
  expect_error(Greedy(1, Prompt(5, 1), 0), StatusCode::kInvalidArgument, "max_tokens");
  EngineRequest r = Greedy(1, Prompt(5, 1), 5);
  r.params.temperature = -0.5f;
  expect_error(r, StatusCode::kInvalidArgument, "temperature");
  r = Greedy(1, Prompt(5, 1), 5);
  r.params.top_p = 0.0f;
  expect_error(r, StatusCode::kInvalidArgument, "top_p");
  r.params.top_p = 1.5f;
  expect_error(r, StatusCode::kInvalidArgument, "top_p");
  expect_error(Greedy(1, {1, 2, 99999}, 5), StatusCode::kInvalidArgument, "vocabulary");
  r = Greedy(1, Prompt(5, 1), 5);
  r.params.stop = {"x"};
  expect_error(r, StatusCode::kInvalidArgument, "tokenizer");
  // A prompt that cannot fit in the pool at all: the context is what the
  // pool holds (2 blocks), so it is refused as too long for it.
  EngineOptions small;
  small.kv_cache_bytes = 2 * kBlockBytes;
  auto tiny_pool = MakeEngine(small);
  EXPECT_EQ(tiny_pool->max_model_len(), 32);
  const Status too_long = tiny_pool->AddRequest(Greedy(1, Prompt(40, 1), 5));
  EXPECT_EQ(too_long.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(too_long.message().find("32"), std::string::npos) << too_long.message();
  // Nothing was queued, and the engine still works.
  EXPECT_FALSE(e->HasUnfinished());
  ASSERT_TRUE(e->AddRequest(Greedy(1, Prompt(5, 1), 3)).ok());
  expect_error(Greedy(1, Prompt(5, 2), 3), StatusCode::kInvalidArgument, "already");
  EXPECT_EQ(RunAll(*e)[1].size(), 3u);
}

TEST_F(EngineSchedulerTest, KvPoolIsOneContiguousRegion) {
  EngineOptions o;
  o.kv_cache_bytes = 1 << 20;
  o.kv_dtype = DType::kFP8E4M3;
  auto e = MakeEngine(o);
  const auto& pool = e->kv_pool();
  const auto& layout = pool.layout();
  // 2 layers x (K + V) x 2 heads x 16 tokens x 16 dims x 1 byte, plus 2 x 2 float scales per layer.
  EXPECT_EQ(pool.bytes_per_block(), 2 * (2 * 2 * 16 * 16 + 2 * 2 * 4));
  EXPECT_EQ(pool.num_blocks(), (1 << 20) / pool.bytes_per_block());
  EXPECT_EQ(pool.total_bytes(), pool.num_blocks() * pool.bytes_per_block());
  EXPECT_EQ(pool.block(3), static_cast<uint8_t*>(pool.base()) + 3 * pool.bytes_per_block());
  EXPECT_EQ(layout.v_offset(1, 1, 0) - layout.block_offset(1),
            layout.layer_stride_bytes() + layout.kv_bytes_per_layer());
  EXPECT_NE(pool.Describe().find("dtype=fp8"), std::string::npos);
}

// n > 1: sequences sharing a prompt (share_prompt_with) wait for its KV,
// take its full blocks from the prefix cache, and draw the same tokens as
// requests run alone with their seeds.
TEST_F(EngineSchedulerTest, SharedPromptIsComputedOnceAndSequencesKeepTheirSeeds) {
  const std::vector<TokenId> prompt = Prompt(40, 9);  // two full blocks and 8 tokens
  auto request = [&](RequestId id, uint64_t seed, RequestId share) {
    EngineRequest r;
    r.id = id;
    r.prompt = prompt;
    r.params.temperature = 1.0f;
    r.params.seed = seed;
    r.params.max_tokens = 8;
    r.params.ignore_eos = true;
    r.share_prompt_with = share;
    return r;
  };
  auto e = MakeEngine();
  ASSERT_TRUE(e->AddRequest(request(1, 100, 0)).ok());
  ASSERT_TRUE(e->AddRequest(request(2, 101, 1)).ok());
  ASSERT_TRUE(e->AddRequest(request(3, 102, 1)).ok());
  std::map<RequestId, RequestOutput> last;
  std::map<RequestId, int64_t> cached;
  std::map<RequestId, std::vector<TokenId>> out;
  while (e->HasUnfinished()) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok());
    for (const auto& o : *step) {
      if (!o.new_token_ids.empty() && !cached.count(o.id)) cached[o.id] = o.num_cached_tokens;
      out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
    }
  }
  EXPECT_EQ(cached[1], 0);
  EXPECT_EQ(cached[2], 32);  // both full blocks shared
  EXPECT_EQ(cached[3], 32);
  EXPECT_EQ(e->block_manager().GetStats().prefix_cache_hit_tokens, 64u);
  for (auto [id, seed] : {std::pair<RequestId, uint64_t>{1, 100}, {2, 101}, {3, 102}}) {
    EXPECT_EQ(out[id], Alone(request(id, seed, 0))) << "sequence " << id;
  }
  EXPECT_NE(out[2], out[3]);  // different seeds, different samples
}

// More sequences of one prompt than run at once (n = 40 over max_num_seqs
// 4, as OpenAI's n allows up to 128): the rest wait their turn, and each
// still draws what it draws alone with its seed.
TEST_F(EngineSchedulerTest, MoreSharedSequencesThanRunAtOnceEachKeepTheirSeed) {
  const std::vector<TokenId> prompt = Prompt(40, 12);
  auto request = [&](RequestId id, RequestId share) {
    EngineRequest r;
    r.id = id;
    r.prompt = prompt;
    r.params.temperature = 1.0f;
    r.params.seed = 500 + id;
    r.params.max_tokens = 6;
    r.params.ignore_eos = true;
    r.share_prompt_with = share;
    return r;
  };
  EngineOptions o;
  o.max_num_seqs = 4;
  auto e = MakeEngine(o);
  constexpr RequestId kSequences = 40;
  for (RequestId id = 1; id <= kSequences; ++id) {
    ASSERT_TRUE(e->AddRequest(request(id, id == 1 ? 0 : 1)).ok());
  }
  std::map<RequestId, std::vector<TokenId>> out;
  while (e->HasUnfinished()) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    for (const auto& o : *step)
      out[o.id].insert(out[o.id].end(), o.new_token_ids.begin(), o.new_token_ids.end());
  }
  ASSERT_EQ(out.size(), kSequences);
  for (RequestId id = 1; id <= kSequences; ++id) {
    EXPECT_EQ(out[id], Alone(request(id, 0))) << "sequence " << id;
  }
  EXPECT_EQ(e->block_manager().GetStats().used_blocks, 0u) << "blocks left held";
}

TEST_F(EngineSchedulerTest, SharedPromptWaitsForARemotePrefill) {
  const std::vector<TokenId> prompt = Prompt(40, 10);
  auto e = MakeEngine();
  EngineRequest leader = Greedy(1, prompt, 4);
  ASSERT_TRUE(e->AddRemotePrefillRequest(leader).ok());
  EngineRequest sibling = Greedy(2, prompt, 4);
  sibling.share_prompt_with = 1;
  ASSERT_TRUE(e->AddRequest(sibling).ok());
  EngineRequest other = Greedy(3, Prompt(20, 11), 4);  // behind it in the queue: not held up
  ASSERT_TRUE(e->AddRequest(other).ok());
  std::map<RequestId, int> tokens;
  for (int i = 0; i < 10; ++i) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok());
    for (const auto& o : *step) tokens[o.id] += static_cast<int>(o.new_token_ids.size());
  }
  EXPECT_EQ(tokens[2], 0) << "the sibling ran before the shared prompt was there";
  EXPECT_EQ(tokens[3], 4);
  auto first = e->CompleteRemotePrefill(1, 7);
  ASSERT_TRUE(first.ok());
  tokens[1] += static_cast<int>(first->new_token_ids.size());
  while (e->HasUnfinished()) {
    auto step = e->Step();
    ASSERT_TRUE(step.ok());
    for (const auto& o : *step) tokens[o.id] += static_cast<int>(o.new_token_ids.size());
  }
  EXPECT_EQ(tokens[1], 4);
  EXPECT_EQ(tokens[2], 4);
}

}  // namespace
}  // namespace pdserve
