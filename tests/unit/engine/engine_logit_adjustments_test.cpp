// OpenAI's logit_bias, presence_penalty and frequency_penalty and vLLM's
// repetition_penalty, min_tokens, allowed_token_ids and bad_words through
// the engine: greedy requests with
// and without them running in one batch, every token and logprob checked
// against the float64 reference's logits with the adjustments applied by
// this test's own reading of the rule (bias added; then a token of the
// prompt or of the output so far divided by the repetition penalty when
// positive, multiplied by it otherwise, as vLLM's apply_penalties does; then
// frequency penalty times the count of the token among the tokens generated
// before, presence penalty once if it is among them, the prompt not
// counted), eagerly and through the runner's graph lifecycle.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

using testing::ArgMax;
using testing::LogSoftmax;
using testing::RandomTokens;

ModelSpec Spec() {
  ModelSpec s = *PresetModelSpec("tiny");
  s.name = "logit-adjustments-tiny";
  return s;
}

struct Request {
  std::vector<int32_t> prompt;
  SamplingParams params;
  std::vector<SampledToken> sampled;
};

// Greedy requests (ids 1, 2, ...) stepped together to the end.
void GenerateTogether(Engine& e, std::vector<Request>& runs) {
  for (size_t i = 0; i < runs.size(); ++i) {
    EngineRequest r;
    r.id = i + 1;
    r.prompt = runs[i].prompt;
    r.params = runs[i].params;
    ASSERT_TRUE(e.AddRequest(std::move(r)).ok());
  }
  while (e.HasUnfinished()) {
    auto step = e.Step();
    ASSERT_TRUE(step.ok()) << step.status().ToString();
    for (const auto& o : *step) {
      auto& sampled = runs[o.id - 1].sampled;
      sampled.insert(sampled.end(), o.logprobs.begin(), o.logprobs.end());
    }
  }
}

// The reference's logits at every generated position, adjusted as the
// request asks; each token must be their argmax (or within 1e-4 of it) and
// its logprob their log-softmax at the token.
void ExpectAdjustedReference(const testing::ReferenceModel& ref, const Request& run) {
  std::vector<int32_t> all = run.prompt;
  for (const auto& s : run.sampled) all.push_back(s.token);
  const auto logits = ref.Forward(all);
  std::map<int32_t, int> counts;  // tokens generated before the current one
  const double repetition = run.params.repetition_penalty;
  for (size_t i = 0; i < run.sampled.size(); ++i) {
    std::vector<double> adjusted = logits[run.prompt.size() - 1 + i];
    for (const auto& [token, bias] : run.params.logit_bias) adjusted[token] += bias;
    // vLLM's repetition penalty: every token seen in the prompt or the
    // output so far, by the sign of its (biased) logit.
    std::vector<bool> seen(adjusted.size(), false);
    for (int32_t t : run.prompt) seen[t] = true;
    for (const auto& [token, count] : counts) seen[token] = true;
    for (size_t t = 0; t < adjusted.size(); ++t) {
      if (seen[t])
        adjusted[t] = adjusted[t] > 0 ? adjusted[t] / repetition : adjusted[t] * repetition;
    }
    for (const auto& [token, count] : counts) {
      adjusted[token] -= run.params.frequency_penalty * count + run.params.presence_penalty;
    }
    // allowed_token_ids: every other token out. bad_words, as vLLM's
    // apply_bad_words reads them: a word's last token out where the output
    // so far ends with its other tokens.
    const auto& allowed = run.params.allowed_token_ids;
    for (size_t t = 0; t < adjusted.size(); ++t) {
      if (!allowed.empty() && std::find(allowed.begin(), allowed.end(), t) == allowed.end())
        adjusted[t] = -std::numeric_limits<double>::infinity();
    }
    for (const auto& word : run.params.bad_words_token_ids) {
      const size_t prefix = word.size() - 1;
      if (prefix > i) continue;
      bool ends_with = true;
      for (size_t k = 0; k < prefix; ++k) ends_with &= run.sampled[i - prefix + k].token == word[k];
      if (ends_with) adjusted[word.back()] = -std::numeric_limits<double>::infinity();
    }
    const auto lp = LogSoftmax(adjusted);
    const int32_t best = ArgMax(lp), got = run.sampled[i].token;
    EXPECT_TRUE(got == best || lp[best] - lp[got] < 1e-4) << "step " << i;
    EXPECT_NEAR(run.sampled[i].logprob, lp[got], 1e-3) << "step " << i;
    ++counts[got];
  }
}

SamplingParams Greedy(int max_tokens) {
  SamplingParams p;
  p.temperature = 0;
  p.max_tokens = max_tokens;
  p.ignore_eos = true;
  p.logprobs = 0;
  return p;
}

class EngineLogitAdjustmentsTest : public ::testing::TestWithParam<GraphMode> {
 protected:
  // The tiny model on the CPU with its float64 reference, and an engine of
  // 8-token blocks over it in this test's graph mode.
  void LoadEngine() {
    loaded_ = testing::LoadCpuModelAndReference(testing::ModelDir("logit-adjustments", Spec()));
    ASSERT_NE(loaded_.model, nullptr);
    ASSERT_NE(loaded_.reference, nullptr);
    EngineOptions o;
    o.block_size = 8;
    o.graphs = GetParam();
    auto e = Engine::Create(loaded_.model.get(), o);
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(*e);
  }

  testing::LoadedCpuModel loaded_;
  std::unique_ptr<Engine> engine_;
};

TEST_P(EngineLogitAdjustmentsTest, PenaltiesAndBiasMatchTheReferenceBesidePlainRows) {
  ASSERT_NO_FATAL_FAILURE(LoadEngine());
  const testing::LoadedCpuModel& l = loaded_;
  Engine* const e = engine_.get();
  const int64_t vocab = Spec().vocab_size();
  const auto prompt = RandomTokens(12, vocab, 5);
  constexpr int kTokens = 40;

  // 1: plain greedy (the baseline); 2: penalties on the same prompt;
  // 3: a bias that bans what greedy would pick first and lifts two others;
  // 4: negative penalties (repetition encouraged), another prompt.
  std::vector<Request> plain = {{prompt, Greedy(kTokens), {}}};
  GenerateTogether(*e, plain);
  ASSERT_EQ(plain[0].sampled.size(), static_cast<size_t>(kTokens));
  const int32_t first = plain[0].sampled[0].token;

  std::vector<Request> runs(6);
  runs[0] = {prompt, Greedy(kTokens), {}};
  runs[1] = {prompt, Greedy(kTokens), {}};
  runs[1].params.frequency_penalty = 1.5f;
  runs[1].params.presence_penalty = 0.75f;
  runs[2] = {prompt, Greedy(kTokens), {}};
  const int32_t lifted = (first + 7) % static_cast<int32_t>(vocab);
  runs[2].params.logit_bias = {{first, -100.0f}, {lifted, 3.0f}};
  std::sort(runs[2].params.logit_bias.begin(), runs[2].params.logit_bias.end());
  runs[3] = {RandomTokens(9, vocab, 6), Greedy(kTokens), {}};
  runs[3].params.frequency_penalty = -0.5f;
  runs[3].params.presence_penalty = -1.0f;
  // 5: a repetition penalty alone; 6: with a bias and penalties on the
  // same tokens (each applies in its turn).
  runs[4] = {prompt, Greedy(kTokens), {}};
  runs[4].params.repetition_penalty = 1.8f;
  runs[5] = {RandomTokens(9, vocab, 6), Greedy(kTokens), {}};
  runs[5].params.repetition_penalty = 1.3f;
  runs[5].params.frequency_penalty = 0.5f;
  runs[5].params.presence_penalty = 0.25f;
  runs[5].params.logit_bias = {{runs[5].prompt[0], 2.0f}, {lifted, -1.0f}};
  std::sort(runs[5].params.logit_bias.begin(), runs[5].params.logit_bias.end());
  if (runs[5].params.logit_bias[0].first == runs[5].params.logit_bias[1].first)
    runs[5].params.logit_bias.pop_back();
  GenerateTogether(*e, runs);

  for (size_t i = 0; i < runs.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i + 1));
    ASSERT_EQ(runs[i].sampled.size(), static_cast<size_t>(kTokens));
    ExpectAdjustedReference(*l.reference, runs[i]);
  }
  // The plain row beside adjusted ones is the plain request's alone; the
  // adjustments changed the tokens (so the checks above could fail).
  for (int t = 0; t < kTokens; ++t) EXPECT_EQ(runs[0].sampled[t].token, plain[0].sampled[t].token);
  auto tokens = [](const Request& r) {
    std::vector<int32_t> v;
    for (const auto& s : r.sampled) v.push_back(s.token);
    return v;
  };
  EXPECT_NE(tokens(runs[1]), tokens(plain[0]));
  EXPECT_NE(tokens(runs[4]), tokens(plain[0])) << "the repetition penalty changed nothing";
  EXPECT_NE(runs[2].sampled[0].token, first);
  for (const auto& s : runs[2].sampled) EXPECT_NE(s.token, first);
}

// A bias of +100 on one token takes every step, however the model leans.
TEST_P(EngineLogitAdjustmentsTest, ALargeBiasForcesItsToken) {
  ASSERT_NO_FATAL_FAILURE(LoadEngine());
  std::vector<Request> runs = {{RandomTokens(5, Spec().vocab_size(), 9), Greedy(6), {}}};
  runs[0].params.logit_bias = {{42, 100.0f}};
  runs[0].params.temperature = 0.8f;  // sampled, not greedy: the bias still decides
  runs[0].params.seed = 3;
  GenerateTogether(*engine_, runs);
  ASSERT_EQ(runs[0].sampled.size(), 6u);
  for (const auto& s : runs[0].sampled) EXPECT_EQ(s.token, 42);
}

// min_tokens: EOS and the stop token ids are never sampled before the
// output is that long, however the model leans (+100 on them here), and
// end it the step after.
TEST_P(EngineLogitAdjustmentsTest, MinTokensHoldsOffEosAndStopIds) {
  ASSERT_NO_FATAL_FAILURE(LoadEngine());
  const std::vector<TokenId>& eos = loaded_.model->config().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  const TokenId stop_id = 42;
  std::vector<Request> runs(4);
  for (size_t i = 0; i < runs.size(); ++i) {
    runs[i] = {RandomTokens(6, Spec().vocab_size(), 11 + static_cast<uint32_t>(i)), Greedy(20), {}};
    runs[i].params.ignore_eos = false;
    runs[i].params.stop_token_ids = {stop_id};
  }
  runs[0].params.logit_bias = {{eos[0], 100.0f}};  // EOS the likeliest
  runs[0].params.min_tokens = 5;
  runs[1].params.logit_bias = {{stop_id, 100.0f}};  // a stop id the likeliest, sampled
  runs[1].params.min_tokens = 3;
  runs[1].params.temperature = 0.7f;
  runs[1].params.seed = 4;
  runs[2].params.logit_bias = {{eos[0], 100.0f}};  // no min_tokens: EOS at once
  // ignore_eos: EOS ends nothing, and is still held off for min_tokens (as
  // vLLM holds it), then taken.
  runs[3].params.logit_bias = {{eos[0], 100.0f}};
  runs[3].params.ignore_eos = true;
  runs[3].params.min_tokens = 3;
  runs[3].params.max_tokens = 5;
  GenerateTogether(*engine_, runs);
  auto is_stop = [&](TokenId t) {
    return t == stop_id || std::find(eos.begin(), eos.end(), t) != eos.end();
  };
  ASSERT_EQ(runs[0].sampled.size(), 6u);
  for (size_t i = 0; i < 5; ++i) EXPECT_FALSE(is_stop(runs[0].sampled[i].token)) << i;
  EXPECT_EQ(runs[0].sampled[5].token, eos[0]);
  ASSERT_EQ(runs[1].sampled.size(), 4u);
  for (size_t i = 0; i < 3; ++i) EXPECT_FALSE(is_stop(runs[1].sampled[i].token)) << i;
  EXPECT_EQ(runs[1].sampled[3].token, stop_id);
  ASSERT_EQ(runs[2].sampled.size(), 1u);
  EXPECT_EQ(runs[2].sampled[0].token, eos[0]);
  ASSERT_EQ(runs[3].sampled.size(), 5u);
  for (size_t i = 0; i < 3; ++i) EXPECT_FALSE(is_stop(runs[3].sampled[i].token)) << i;
  EXPECT_EQ(runs[3].sampled[3].token, eos[0]);
  EXPECT_EQ(runs[3].sampled[4].token, eos[0]);
}

// allowed_token_ids and bad_words beside a plain row: tokens and logprobs
// are the reference's with the other tokens out; the plain row's first two
// tokens, banned alone and as a pair, change the output where they would
// have come; a ban applies beside min_tokens' and a sampled row stays in
// its allowed set.
TEST_P(EngineLogitAdjustmentsTest, AllowedTokenIdsAndBadWordsMatchTheReference) {
  ASSERT_NO_FATAL_FAILURE(LoadEngine());
  const testing::LoadedCpuModel& l = loaded_;
  Engine* const e = engine_.get();
  const int64_t vocab = Spec().vocab_size();
  const auto prompt = RandomTokens(10, vocab, 21);
  constexpr int kTokens = 24;
  std::vector<Request> plain = {{prompt, Greedy(kTokens), {}}};
  GenerateTogether(*e, plain);
  ASSERT_EQ(plain[0].sampled.size(), static_cast<size_t>(kTokens));
  const TokenId g0 = plain[0].sampled[0].token, g1 = plain[0].sampled[1].token;

  std::vector<Request> runs(5, {prompt, Greedy(kTokens), {}});
  // 2: twenty allowed tokens, none of the plain row's first two.
  for (TokenId t = 3; runs[1].params.allowed_token_ids.size() < 20; t += 7) {
    if (t != g0 && t != g1) runs[1].params.allowed_token_ids.push_back(t % vocab);
  }
  std::sort(runs[1].params.allowed_token_ids.begin(), runs[1].params.allowed_token_ids.end());
  runs[1].params.allowed_token_ids.erase(
      std::unique(runs[1].params.allowed_token_ids.begin(), runs[1].params.allowed_token_ids.end()),
      runs[1].params.allowed_token_ids.end());
  // 3: the first token banned; 4: the first two as a pair (the first still
  // comes, the second not after it), and a word longer than any output.
  runs[2].params.bad_words_token_ids = {{g0}};
  runs[3].params.bad_words_token_ids = {{g0, g1}, std::vector<TokenId>(kTokens + 2, g0)};
  // 5: a ban beside min_tokens' EOS ban, EOS the likeliest.
  const std::vector<TokenId>& eos = l.model->config().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  runs[4].params.ignore_eos = false;
  runs[4].params.min_tokens = 4;
  runs[4].params.logit_bias = {{eos[0], 100.0f}};
  runs[4].params.bad_words_token_ids = {{g1}, {g0, g0}};
  GenerateTogether(*e, runs);
  for (size_t i = 0; i < 4; ++i) {  // the fifth's min_tokens is not the reference's to apply
    SCOPED_TRACE("request " + std::to_string(i + 1));
    ExpectAdjustedReference(*l.reference, runs[i]);
  }
  ASSERT_EQ(runs[1].sampled.size(), static_cast<size_t>(kTokens));
  for (const auto& s : runs[1].sampled) {
    EXPECT_TRUE(std::binary_search(runs[1].params.allowed_token_ids.begin(),
                                   runs[1].params.allowed_token_ids.end(), s.token))
        << s.token;
  }
  for (const auto& s : runs[2].sampled) EXPECT_NE(s.token, g0);
  ASSERT_GE(runs[3].sampled.size(), 2u);
  EXPECT_EQ(runs[3].sampled[0].token, g0);
  EXPECT_NE(runs[3].sampled[1].token, g1);
  ASSERT_EQ(runs[4].sampled.size(), 5u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_NE(runs[4].sampled[i].token, eos[0]) << i;
    EXPECT_NE(runs[4].sampled[i].token, g1) << i;
    if (i > 0 && runs[4].sampled[i - 1].token == g0) {
      EXPECT_NE(runs[4].sampled[i].token, g0) << i;
    }
  }
  EXPECT_EQ(runs[4].sampled[4].token, eos[0]);

  // Sampled, not greedy: still only allowed tokens.
  std::vector<Request> sampled = {{prompt, Greedy(kTokens), {}}};
  sampled[0].params.temperature = 1.5f;
  sampled[0].params.seed = 8;
  sampled[0].params.allowed_token_ids = {5, 17, 40};
  GenerateTogether(*e, sampled);
  ASSERT_EQ(sampled[0].sampled.size(), static_cast<size_t>(kTokens));
  for (const auto& s : sampled[0].sampled) {
    EXPECT_TRUE(s.token == 5 || s.token == 17 || s.token == 40) << s.token;
  }
}

// When the bans take every allowed token (allowed_token_ids of EOS alone
// under min_tokens, or of a bad word's token alone), nothing can be
// sampled: the request ends at once with no token, never with a banned one.
TEST_P(EngineLogitAdjustmentsTest, BansThatTakeEveryAllowedTokenEndTheRequest) {
  ASSERT_NO_FATAL_FAILURE(LoadEngine());
  const std::vector<TokenId>& eos = loaded_.model->config().eos_token_ids;
  ASSERT_FALSE(eos.empty());
  std::vector<Request> runs(3, {RandomTokens(6, Spec().vocab_size(), 31), Greedy(8), {}});
  runs[0].params.allowed_token_ids = {eos[0]};
  runs[0].params.ignore_eos = false;
  runs[0].params.min_tokens = 3;
  runs[1].params.allowed_token_ids = {42};
  runs[1].params.bad_words_token_ids = {{42}};
  runs[2].params.allowed_token_ids = {42, 43};  // one left: it every time
  runs[2].params.bad_words_token_ids = {{42}};
  GenerateTogether(*engine_, runs);
  EXPECT_TRUE(runs[0].sampled.empty());
  EXPECT_TRUE(runs[1].sampled.empty());
  ASSERT_EQ(runs[2].sampled.size(), 8u);
  for (const auto& s : runs[2].sampled) EXPECT_EQ(s.token, 43);
  EXPECT_FALSE(engine_->HasUnfinished());
}

INSTANTIATE_TEST_SUITE_P(Graphs, EngineLogitAdjustmentsTest,
                         ::testing::Values(GraphMode::kOff, GraphMode::kAlways),
                         [](const auto& info) {
                           return info.param == GraphMode::kOff ? std::string("Eager")
                                                                : std::string("GraphLifecycle");
                         });

}  // namespace
}  // namespace pdserve
