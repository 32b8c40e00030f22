// Prompt logprobs (SamplingParams::prompt_logprobs): every prompt token
// after the first scored by the engine, against the float64 reference's
// log_softmax at the position before it; a prompt longer than a step's
// rows scored over several steps; a cached prompt computed again; sampled
// rows in the same steps unchanged; max_tokens 0 scoring alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <vector>

#include "engine/engine.h"
#include "engine/model_runner.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::LogSoftmax;
using testing::RandomTokens;

struct Outcome {
  std::vector<int32_t> tokens;
  std::vector<SampledToken> prompt_logprobs;
  int prompt_outputs = 0;  // outputs that carried prompt logprobs
  FinishReason finish = FinishReason::kNone;
  int64_t cached = 0;
};

// Steps `engine` until every request is done; what each one got, by id.
std::map<RequestId, Outcome> RunAll(Engine* engine, int64_t* steps = nullptr) {
  std::map<RequestId, Outcome> runs;
  while (engine->HasUnfinished()) {
    auto outs = engine->Step();
    EXPECT_TRUE(outs.ok()) << outs.status().ToString();
    if (!outs.ok()) break;
    if (steps != nullptr) ++*steps;
    for (auto& o : *outs) {
      Outcome& r = runs[o.id];
      r.tokens.insert(r.tokens.end(), o.new_token_ids.begin(), o.new_token_ids.end());
      if (!o.prompt_logprobs.empty()) {
        r.prompt_logprobs = o.prompt_logprobs;
        ++r.prompt_outputs;
      }
      r.cached = std::max(r.cached, o.num_cached_tokens);
      if (o.finished) r.finish = o.finish_reason;
    }
  }
  return runs;
}

EngineRequest Request(RequestId id, std::vector<int32_t> prompt, int max_tokens,
                      std::optional<int> prompt_logprobs) {
  EngineRequest r;
  r.id = id;
  r.prompt = std::move(prompt);
  r.params.temperature = 0;
  r.params.ignore_eos = true;
  r.params.max_tokens = max_tokens;
  r.params.prompt_logprobs = prompt_logprobs;
  return r;
}

// Each entry against the reference: the token scored, its logprob, and the
// top ones (ids in order, logprobs).
void ExpectMatchesReference(const std::vector<SampledToken>& got,
                            const std::vector<int32_t>& prompt,
                            const testing::ReferenceModel& reference, int top) {
  ASSERT_EQ(got.size(), prompt.size() - 1);
  const auto ref = reference.Forward(prompt);
  for (size_t p = 0; p + 1 < prompt.size(); ++p) {
    const std::vector<double> lp = LogSoftmax(ref[p]);
    EXPECT_EQ(got[p].token, prompt[p + 1]) << "position " << p;
    EXPECT_NEAR(got[p].logprob, lp[prompt[p + 1]], 1e-3) << "position " << p;
    std::vector<int32_t> order(lp.size());
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return lp[a] > lp[b]; });
    ASSERT_EQ(got[p].top_logprobs.size(), static_cast<size_t>(top)) << "position " << p;
    for (int j = 0; j < top; ++j) {
      EXPECT_EQ(got[p].top_logprobs[j].token, order[j]) << "position " << p << ", rank " << j;
      EXPECT_NEAR(got[p].top_logprobs[j].logprob, lp[order[j]], 1e-3) << "position " << p;
    }
  }
}

StatusOr<std::unique_ptr<Engine>> TinyEngine(Model* model, bool prefix_caching = true) {
  EngineOptions options;
  options.kv_cache_bytes = 4 << 20;
  options.enable_prefix_caching = prefix_caching;
  return Engine::Create(model, options);
}

TEST(EnginePromptLogprobsTest, ALongPromptIsScoredOverSeveralStepsAsTheReferenceScoresIt) {
  auto l = testing::LoadCpuModelAndReference(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  auto engine = TinyEngine(l.model.get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  // 150 tokens: 149 scores, more than two steps' rows.
  const auto prompt = RandomTokens(150, l.model->config().vocab_size, 5);
  ASSERT_TRUE((*engine)->AddRequest(Request(1, prompt, 0, 3)).ok());
  int64_t steps = 0;
  auto runs = RunAll(engine->get(), &steps);
  const Outcome& r = runs[1];
  EXPECT_EQ(steps, (149 + kMaxPromptLogprobRows - 1) / kMaxPromptLogprobRows);
  EXPECT_TRUE(r.tokens.empty()) << "max_tokens 0 samples nothing";
  EXPECT_EQ(r.finish, FinishReason::kLength);
  EXPECT_EQ(r.prompt_outputs, 1);
  ExpectMatchesReference(r.prompt_logprobs, prompt, *l.reference, 3);
  EXPECT_FALSE((*engine)->block_manager().HasSequence(1)) << "its blocks are released";
}

TEST(EnginePromptLogprobsTest, ACachedPromptIsComputedAgainAndDecodesAsWithoutScores) {
  auto l = testing::LoadCpuModelAndReference(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  auto engine = TinyEngine(l.model.get());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const auto prompt = RandomTokens(70, l.model->config().vocab_size, 9);
  ASSERT_TRUE((*engine)->AddRequest(Request(1, prompt, 8, std::nullopt)).ok());
  auto plain = RunAll(engine->get());
  ASSERT_EQ(plain[1].tokens.size(), 8u);
  EXPECT_TRUE(plain[1].prompt_logprobs.empty());

  ASSERT_TRUE((*engine)->AddRequest(Request(2, prompt, 8, 0)).ok());
  auto scored = RunAll(engine->get());
  EXPECT_EQ(scored[2].cached, 0) << "a prompt to score takes nothing from the prefix cache";
  EXPECT_EQ(scored[2].tokens, plain[1].tokens);
  EXPECT_EQ(scored[2].prompt_outputs, 1);
  ExpectMatchesReference(scored[2].prompt_logprobs, prompt, *l.reference, 0);

  // The prefix cache still serves the prompt to requests that do not score it.
  ASSERT_TRUE((*engine)->AddRequest(Request(3, prompt, 8, std::nullopt)).ok());
  auto again = RunAll(engine->get());
  EXPECT_EQ(again[3].cached, 64);
  EXPECT_EQ(again[3].tokens, plain[1].tokens);
}

TEST(EnginePromptLogprobsTest, DecodingRequestsInTheSameStepsGetTheirOwnTokens) {
  auto l = testing::LoadCpuModelAndReference(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  const int64_t vocab = l.model->config().vocab_size;
  auto decoding = [&](RequestId id) {
    EngineRequest r =
        Request(id, RandomTokens(10 + 7 * static_cast<int>(id), vocab, id), 20, std::nullopt);
    r.params.logprobs = 2;
    return r;
  };
  // Alone, each decoding request's tokens.
  std::map<RequestId, std::vector<int32_t>> alone;
  for (RequestId id = 1; id <= 3; ++id) {
    auto engine = TinyEngine(l.model.get(), /*prefix_caching=*/false);
    ASSERT_TRUE(engine.ok());
    ASSERT_TRUE((*engine)->AddRequest(decoding(id)).ok());
    alone[id] = RunAll(engine->get())[id].tokens;
  }
  // Together, with two prompts to score arriving while they decode (their
  // rows share steps with the sampled ones and with each other).
  auto engine = TinyEngine(l.model.get(), /*prefix_caching=*/false);
  ASSERT_TRUE(engine.ok());
  for (RequestId id = 1; id <= 3; ++id) ASSERT_TRUE((*engine)->AddRequest(decoding(id)).ok());
  std::map<RequestId, Outcome> runs;
  for (int i = 0; i < 2; ++i) {
    auto outs = (*engine)->Step();
    ASSERT_TRUE(outs.ok());
    for (auto& o : *outs) {
      runs[o.id].tokens.insert(runs[o.id].tokens.end(), o.new_token_ids.begin(),
                               o.new_token_ids.end());
    }
  }
  const auto scored_a = RandomTokens(90, vocab, 21), scored_b = RandomTokens(40, vocab, 22);
  ASSERT_TRUE((*engine)->AddRequest(Request(10, scored_a, 3, 2)).ok());
  ASSERT_TRUE((*engine)->AddRequest(Request(11, scored_b, 0, 1)).ok());
  for (auto& [id, run] : RunAll(engine->get())) {
    runs[id].tokens.insert(runs[id].tokens.end(), run.tokens.begin(), run.tokens.end());
    runs[id].prompt_logprobs = run.prompt_logprobs;
  }
  for (RequestId id = 1; id <= 3; ++id) EXPECT_EQ(runs[id].tokens, alone[id]) << "request " << id;
  EXPECT_EQ(runs[10].tokens.size(), 3u);
  EXPECT_TRUE(runs[11].tokens.empty());
  ExpectMatchesReference(runs[10].prompt_logprobs, scored_a, *l.reference, 2);
  ExpectMatchesReference(runs[11].prompt_logprobs, scored_b, *l.reference, 1);
}

TEST(EnginePromptLogprobsTest, RequestsThatCannotBeScoredAreRefused) {
  Model* model = testing::TinyCpuModel();
  ASSERT_NE(model, nullptr);
  auto engine = TinyEngine(model);
  ASSERT_TRUE(engine.ok());
  const auto prompt = RandomTokens(20, model->config().vocab_size, 3);
  EXPECT_EQ((*engine)->AddRequest(Request(1, prompt, 0, std::nullopt)).code(),
            StatusCode::kInvalidArgument)
      << "max_tokens 0 only scores a prompt";
  EXPECT_EQ((*engine)->AddRequest(Request(2, prompt, 4, kMaxLogprobs + 1)).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ((*engine)->AddRequest(Request(3, prompt, 4, -1)).code(), StatusCode::kInvalidArgument);
  EngineRequest prefill = Request(4, prompt, 4, 0);
  prefill.prefill_only = true;
  EXPECT_EQ((*engine)->AddRequest(prefill).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*engine)->AddRemotePrefillRequest(Request(5, prompt, 4, 0)).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_FALSE((*engine)->HasUnfinished());
}

// A prompt that fills the context can be scored alone (max_tokens 0), as
// rolling loglikelihood scores a text in windows of the context; asked to
// generate after it, it is refused.
TEST(EnginePromptLogprobsTest, APromptFillingTheContextIsScoredAlone) {
  auto l = testing::LoadCpuModelAndReference(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  EngineOptions options;
  options.kv_cache_bytes = 4 << 20;
  options.max_model_len = 96;
  auto engine = Engine::Create(l.model.get(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const auto prompt = RandomTokens(96, l.model->config().vocab_size, 13);
  EXPECT_EQ((*engine)->AddRequest(Request(1, prompt, 1, 0)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*engine)->AddRequest(Request(2, prompt, 0, 0)).ok());
  auto runs = RunAll(engine->get());
  EXPECT_EQ(runs[2].finish, FinishReason::kLength);
  ExpectMatchesReference(runs[2].prompt_logprobs, prompt, *l.reference, 0);
}

// A prompt scored alone needs room for itself only, not for a next token:
// one that fills the whole KV pool (here the context limit too) is scored.
TEST(EnginePromptLogprobsTest, APromptFillingThePoolIsScoredAlone) {
  auto l = testing::LoadCpuModelAndReference(testing::TinyModelDir());
  ASSERT_NE(l.model, nullptr);
  EngineOptions options;
  options.kv_cache_bytes = 8 * (8 << 10);  // 8 blocks of 16 tokens (fp32 KV)
  auto engine = Engine::Create(l.model.get(), options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const auto prompt = RandomTokens(128, l.model->config().vocab_size, 17);
  // A token after it would not fit: the context (capped at the pool's) is full.
  EXPECT_EQ((*engine)->AddRequest(Request(1, prompt, 1, 0)).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*engine)->AddRequest(Request(2, prompt, 0, 0)).ok());
  auto runs = RunAll(engine->get());
  EXPECT_EQ(runs[2].finish, FinishReason::kLength);
  ExpectMatchesReference(runs[2].prompt_logprobs, prompt, *l.reference, 0);
}

}  // namespace
}  // namespace pdserve
