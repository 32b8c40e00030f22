// Sampler tests against independent computations written here: a long-double
// reference of the filtered distribution, chi-square goodness of fit of the
// draws, a log-softmax reference for logprobs, and a brute-force reference for
// stop strings.
#include "engine/sampler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace pdserve {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

SamplingParams Params(float temperature, int top_k = -1, float top_p = 1, float min_p = 0) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.min_p = min_p;
  return p;
}

// ---- Reference distribution: straight from the definitions, long double. ----
std::map<TokenId, long double> ReferenceDistribution(const std::vector<float>& logits,
                                                     const SamplingParams& p) {
  const size_t n = logits.size();
  long double mx = -std::numeric_limits<long double>::infinity();
  for (float l : logits) mx = std::max(mx, static_cast<long double>(l) / p.temperature);
  std::vector<std::pair<long double, TokenId>> probs;  // softmax(l / T)
  long double sum = 0;
  for (size_t i = 0; i < n; ++i) sum += std::exp(logits[i] / (long double)p.temperature - mx);
  for (size_t i = 0; i < n; ++i) {
    probs.push_back({std::exp(logits[i] / (long double)p.temperature - mx) / sum, TokenId(i)});
  }
  // Descending probability, ascending id on ties.
  std::sort(probs.begin(), probs.end(), [](auto a, auto b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < probs.size()) probs.resize(p.top_k);
  long double mass = 0;
  for (auto& e : probs) mass += e.first;
  for (auto& e : probs) e.first /= mass;
  if (p.top_p < 1) {
    // Keep a token while the mass of the tokens before it is below top_p.
    long double before = 0;
    size_t keep = 0;
    while (keep < probs.size() && before < p.top_p) before += probs[keep++].first;
    probs.resize(keep);
  }
  const long double top = probs[0].first;
  std::erase_if(probs, [&](auto& e) { return e.first < p.min_p * top; });
  mass = 0;
  for (auto& e : probs) mass += e.first;
  std::map<TokenId, long double> out;
  for (auto& e : probs) out[e.second] = e.first / mass;
  return out;
}

std::vector<float> RandomLogits(std::mt19937_64& rng, size_t n, float scale) {
  std::normal_distribution<float> d(0, scale);
  std::vector<float> l(n);
  for (auto& v : l) v = d(rng);
  return l;
}

// Upper chi-square quantile, Wilson-Hilferty: z = 6 is a tail of about 1e-9,
// so a correct sampler essentially never exceeds it, while a wrong
// distribution with 20000 draws exceeds it by orders of magnitude.
double ChiSquareBound(int df) {
  const double z = 6.0;
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

TEST(SamplerValidationTest, AcceptsDefaultsAndRejectsEachBadField) {
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}).ok());
  auto expect_bad = [](SamplingParams p, const std::string& field) {
    Status s = ValidateSamplingParams(p, 1000);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s.message();
  };
  SamplingParams p;
  p.max_tokens = 0;
  expect_bad(p, "max_tokens");
  p = {};
  p.temperature = -0.5f;
  expect_bad(p, "temperature");
  p.temperature = std::nanf("");
  expect_bad(p, "temperature");
  p = {};
  p.top_p = 0;
  expect_bad(p, "top_p");
  p = {};
  p.repetition_penalty = 0;
  expect_bad(p, "repetition_penalty");
  p.repetition_penalty = 10.5f;
  expect_bad(p, "repetition_penalty");
  p = {};
  p.min_tokens = -1;
  expect_bad(p, "min_tokens");
  p.min_tokens = p.max_tokens + 1;
  expect_bad(p, "min_tokens");
  p.min_tokens = p.max_tokens;
  EXPECT_TRUE(ValidateSamplingParams(p).ok());
  p.constraint = OutputConstraint{OutputConstraint::Kind::kJsonObject, ""};
  expect_bad(p, "min_tokens");
  p.top_p = 1.5f;
  expect_bad(p, "top_p");
  p.top_p = std::nanf("");
  expect_bad(p, "top_p");
  p = {};
  p.top_k = -2;
  expect_bad(p, "top_k");
  p = {};
  p.min_p = 1.1f;
  expect_bad(p, "min_p");
  p = {};
  p.stop_token_ids = {1000};
  expect_bad(p, "stop_token_ids");
  p.stop_token_ids = {-1};
  expect_bad(p, "stop_token_ids");
  p = {};
  p.stop = {""};
  expect_bad(p, "stop");
  p = {};
  p.logprobs = 21;
  expect_bad(p, "logprobs");
  p = {};
  p.presence_penalty = 2.5f;
  expect_bad(p, "presence_penalty");
  p = {};
  p.frequency_penalty = std::nanf("");
  expect_bad(p, "frequency_penalty");
  p = {};
  p.logit_bias = {{1000, 1.0f}};  // past the vocabulary (a peer's message)
  expect_bad(p, "logit_bias");
  p.logit_bias = {{5, 1.0f}, {5, 2.0f}};  // twice
  expect_bad(p, "logit_bias");
  p.logit_bias = {{6, 1.0f}, {5, 2.0f}};  // out of order
  expect_bad(p, "logit_bias");
  p.logit_bias = {{5, -101.0f}};
  expect_bad(p, "logit_bias");
  p.logit_bias.assign(kMaxLogitBias + 1, {0, 1.0f});
  for (size_t i = 0; i < p.logit_bias.size(); ++i) p.logit_bias[i].first = static_cast<TokenId>(i);
  const Status too_many = ValidateSamplingParams(p, 100000);
  EXPECT_NE(too_many.message().find("logit_bias: at most"), std::string::npos)
      << too_many.message();

  p = {};
  p.allowed_token_ids = {1000};  // past the vocabulary
  expect_bad(p, "allowed_token_ids");
  p.allowed_token_ids = {5, 5};
  expect_bad(p, "allowed_token_ids");
  p.allowed_token_ids.assign(kMaxAllowedTokenIds + 1, 0);
  expect_bad(p, "allowed_token_ids");
  p = {};
  p.bad_words_token_ids = {{}};
  expect_bad(p, "bad_words");
  p.bad_words_token_ids = {{1, 1000}};
  expect_bad(p, "bad_words");
  p.bad_words_token_ids = {std::vector<TokenId>(kMaxBadWordTokens + 1, 1)};
  expect_bad(p, "bad_words");
  p.bad_words_token_ids.assign(kMaxBadWordSequences + 1, {1});
  expect_bad(p, "bad_words");

  // Edges that are valid.
  p = {};
  p.allowed_token_ids = {0, 999};
  p.bad_words_token_ids = {{999}, std::vector<TokenId>(kMaxBadWordTokens, 0)};
  p.top_p = 1;
  p.top_k = 0;
  p.temperature = 0;
  p.min_p = 1;
  p.max_tokens = 1;
  p.logprobs = 0;
  p.stop_token_ids = {999};
  p.presence_penalty = -2;
  p.frequency_penalty = 2;
  p.logit_bias = {{0, -100.0f}, {999, 100.0f}};
  EXPECT_TRUE(ValidateSamplingParams(p, 1000).ok());
}

TEST(SamplerTest, GreedyIsArgmaxLowestIdOnTiesAndIgnoresKnobs) {
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 2.0f, std::nanf("")};
  auto p = Params(0, /*top_k=*/3, /*top_p=*/0.1f);
  for (uint64_t seed = 0; seed < 20; ++seed) {
    EXPECT_EQ(SampleToken(logits, p, seed, seed * 7).token, 1);
  }
  auto dist = SamplingDistribution(logits, p);
  ASSERT_EQ(dist.size(), 1u);
  EXPECT_EQ(dist[0].token, 1);
}

TEST(SamplerTest, TopKOneIsGreedy) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 50; ++trial) {
    auto logits = RandomLogits(rng, 100, 2);
    TokenId argmax = TokenId(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(SampleToken(logits, Params(1.3f, 1), trial, 0).token, argmax);
  }
}

TEST(SamplerTest, DistributionMatchesReferenceDefinition) {
  std::mt19937_64 rng(11);
  const float temps[] = {0.3f, 0.7f, 1.0f, 1.8f};
  const int top_ks[] = {-1, 0, 1, 5, 40, 5000};
  const float top_ps[] = {1.0f, 0.95f, 0.5f, 0.1f, 0.01f};
  const float min_ps[] = {0.0f, 0.05f, 0.3f};
  int cases = 0;
  for (float t : temps) {
    for (int k : top_ks) {
      for (float tp : top_ps) {
        for (float mp : min_ps) {
          // Vocabularies larger than the 64-token first pass of top-p.
          auto logits = RandomLogits(rng, 300 + (cases % 3) * 500, 3);
          auto p = Params(t, k, tp, mp);
          auto ref = ReferenceDistribution(logits, p);
          auto got = SamplingDistribution(logits, p);
          ASSERT_EQ(got.size(), ref.size()) << "T=" << t << " k=" << k << " p=" << tp;
          double total = 0;
          for (const auto& tp_ : got) {
            ASSERT_TRUE(ref.count(tp_.token)) << "token " << tp_.token << " should be filtered";
            // Weights are computed in float: relative error well under 1e-5.
            EXPECT_NEAR(tp_.prob, static_cast<double>(ref[tp_.token]),
                        1e-5 * static_cast<double>(ref[tp_.token]) + 1e-12);
            total += tp_.prob;
          }
          EXPECT_NEAR(total, 1.0, 1e-12);
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 360);
}

TEST(SamplerTest, TopPKeepsSmallestHeadReachingTheMass) {
  // Probabilities 0.5, 0.25, 0.125, 0.0625, ... (logits ln 2 apart).
  std::vector<float> logits;
  for (int i = 0; i < 10; ++i) logits.push_back(-0.6931472f * i);
  auto kept = [&](float top_p) {
    return SamplingDistribution(logits, Params(1, -1, top_p)).size();
  };
  EXPECT_EQ(kept(0.4f), 1u);   // 0.5 >= 0.4
  EXPECT_EQ(kept(0.6f), 2u);   // 0.5 < 0.6 <= 0.75
  EXPECT_EQ(kept(0.8f), 3u);   // 0.75 < 0.8 <= 0.875
  EXPECT_EQ(kept(1.0f), 10u);  // off
  // Mass property for random cases: kept mass >= p and the mass without the
  // last kept token < p (renormalised over the top-k set: here all tokens).
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 100; ++trial) {
    auto l = RandomLogits(rng, 2000, 4);
    float top_p = std::uniform_real_distribution<float>(0.05f, 0.99f)(rng);
    auto dist = SamplingDistribution(l, Params(1, -1, top_p));
    auto full = ReferenceDistribution(l, Params(1));
    long double mass = 0;
    for (const auto& e : dist) mass += full[e.token];
    EXPECT_GE(mass, top_p - 1e-6);
    EXPECT_LT(mass - full[dist.back().token], top_p + 1e-6);
  }
}

TEST(SamplerTest, DrawsFollowTheDistributionChiSquare) {
  const std::vector<float> logits = {1.0f, 0.2f, -0.5f, 2.0f, 0.0f, -3.0f, 1.5f, 0.7f};
  const SamplingParams configs[] = {Params(1.0f), Params(0.6f), Params(1.5f, 5),
                                    Params(1.0f, -1, 0.8f), Params(1.0f, 6, 0.9f, 0.1f)};
  const int kDraws = 20000;
  for (const auto& p : configs) {
    auto ref = ReferenceDistribution(logits, p);
    // Two ways of varying the draw: across request seeds, and across the
    // positions of one request.
    for (int mode = 0; mode < 2; ++mode) {
      std::map<TokenId, int> counts;
      for (int i = 0; i < kDraws; ++i) {
        uint64_t seed = mode == 0 ? 1000 + i : 77;
        uint64_t pos = mode == 0 ? 3 : i;
        TokenId t = SampleToken(logits, p, seed, pos).token;
        ASSERT_TRUE(ref.count(t)) << "drew filtered token " << t;
        ++counts[t];
      }
      double chi2 = 0;
      for (const auto& [tok, prob] : ref) {
        double expected = kDraws * static_cast<double>(prob);
        double diff = counts[tok] - expected;
        chi2 += diff * diff / expected;
      }
      const int df = static_cast<int>(ref.size()) - 1;
      if (df > 0) {
        EXPECT_LT(chi2, ChiSquareBound(df)) << "T=" << p.temperature << " mode " << mode;
      }
    }
  }
  // The bound is not vacuous: a wrong distribution (temperature 1 instead of
  // 0.6) fails it by far.
  auto wrong = ReferenceDistribution(logits, Params(1.0f));
  std::map<TokenId, int> counts;
  for (int i = 0; i < kDraws; ++i) ++counts[SampleToken(logits, Params(0.6f), 1000 + i, 3).token];
  double chi2 = 0;
  for (const auto& [tok, prob] : wrong) {
    double expected = kDraws * static_cast<double>(prob);
    chi2 += (counts[tok] - expected) * (counts[tok] - expected) / expected;
  }
  EXPECT_GT(chi2, 10 * ChiSquareBound(7));
}

TEST(SamplerTest, SeededDrawsAreReproducibleAndBatchIndependent) {
  std::mt19937_64 rng(9);
  std::vector<std::vector<float>> steps;
  for (int i = 0; i < 32; ++i) steps.push_back(RandomLogits(rng, 500, 2));
  SamplingParams p = Params(0.9f, 50, 0.95f);
  p.seed = 1234;
  const uint64_t seed = ResolveSeed(p);
  EXPECT_EQ(seed, 1234u);
  std::vector<TokenId> alone;
  for (size_t i = 0; i < steps.size(); ++i)
    alone.push_back(SampleToken(steps[i], p, seed, i).token);
  // The same request interleaved with other requests (other seeds, other
  // logits, other params) in a batch, in another order.
  std::vector<TokenId> batched(steps.size());
  SamplingParams other = Params(1.2f);
  for (size_t i = steps.size(); i-- > 0;) {
    (void)SampleToken(steps[(i + 5) % steps.size()], other, 99 + i, i);
    batched[i] = SampleToken(steps[i], p, seed, i).token;
    (void)SampleToken(steps[i], other, ResolveSeed(other), i);
  }
  EXPECT_EQ(alone, batched);
  // A different seed gives a different sequence (32 draws over a spread
  // distribution cannot all coincide).
  std::vector<TokenId> reseeded;
  for (size_t i = 0; i < steps.size(); ++i)
    reseeded.push_back(SampleToken(steps[i], p, 1235, i).token);
  EXPECT_NE(alone, reseeded);
}

TEST(SamplerTest, UnseededRequestsGetDistinctSeeds) {
  SamplingParams p;
  EXPECT_NE(ResolveSeed(p), ResolveSeed(p));
}

TEST(SamplerTest, NonFiniteLogits) {
  std::vector<float> all_neg_inf(5, -kInf);
  EXPECT_EQ(SampleToken(all_neg_inf, Params(1), 1, 0).token, 0);
  EXPECT_EQ(SampleToken(all_neg_inf, Params(0), 1, 0).token, 0);
  std::vector<float> with_nan = {std::nanf(""), -kInf, 1.0f, std::nanf("")};
  for (uint64_t s = 0; s < 50; ++s) EXPECT_EQ(SampleToken(with_nan, Params(1), s, 0).token, 2);
  std::vector<float> with_inf = {0.0f, kInf, 3.0f, kInf};
  std::map<TokenId, int> counts;
  for (uint64_t s = 0; s < 200; ++s) ++counts[SampleToken(with_inf, Params(1), s, 0).token];
  EXPECT_EQ(counts.size(), 2u);
  EXPECT_GT(counts[1], 0);
  EXPECT_GT(counts[3], 0);
}

TEST(SamplerTest, LogprobsAreRawLogSoftmax) {
  std::mt19937_64 rng(21);
  auto logits = RandomLogits(rng, 1000, 3);
  long double mx = *std::max_element(logits.begin(), logits.end());
  long double sum = 0;
  for (float l : logits) sum += std::exp(l - mx);
  auto ref = [&](TokenId t) { return static_cast<double>(logits[t] - mx - std::log(sum)); };

  SamplingParams p = Params(0.5f, 20);  // processing does not change logprobs
  p.logprobs = 5;
  auto out = SampleToken(logits, p, 7, 0);
  EXPECT_NEAR(out.logprob, ref(out.token), 1e-4);
  ASSERT_EQ(out.top_logprobs.size(), 5u);
  std::vector<TokenId> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = TokenId(i);
  std::sort(order.begin(), order.end(),
            [&](TokenId a, TokenId b) { return logits[a] > logits[b]; });
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(out.top_logprobs[i].token, order[i]);
    EXPECT_NEAR(out.top_logprobs[i].logprob, ref(order[i]), 1e-4);
  }
  p.logprobs = 0;
  out = SampleToken(logits, p, 7, 0);
  EXPECT_TRUE(out.top_logprobs.empty());
  EXPECT_NEAR(out.logprob, ref(out.token), 1e-4);
  p.logprobs.reset();
  EXPECT_TRUE(SampleToken(logits, p, 7, 0).top_logprobs.empty());
}

// ---- StopChecker ----

SamplingParams StopParams(std::vector<std::string> stop, int max_tokens = 100) {
  SamplingParams p;
  p.stop = std::move(stop);
  p.max_tokens = max_tokens;
  return p;
}

TEST(StopCheckerTest, StopStringAcrossTokensIsCutBeforeIt) {
  StopChecker c(StopParams({"lo W"}), {});
  auto s1 = c.OnToken(1, "Hel");
  EXPECT_EQ(s1.finish, FinishReason::kNone);
  EXPECT_EQ(s1.text, "He");  // "l" might start "lo W"
  auto s2 = c.OnToken(2, "lo World");
  EXPECT_EQ(s2.finish, FinishReason::kStop);
  EXPECT_EQ(s2.text, "l");
  EXPECT_EQ(s2.matched_stop_string, "lo W");
  EXPECT_EQ(c.num_tokens(), 2u);
  // Finished: further tokens change nothing.
  auto s3 = c.OnToken(3, "more");
  EXPECT_EQ(s3.finish, FinishReason::kStop);
  EXPECT_EQ(s3.text, "");
}

TEST(StopCheckerTest, EarliestOfSeveralStopStringsWins) {
  StopChecker c(StopParams({"world", "o w"}), {});
  auto s = c.OnToken(1, "hello world");
  EXPECT_EQ(s.finish, FinishReason::kStop);
  EXPECT_EQ(s.text, "hell");
  EXPECT_EQ(s.matched_stop_string, "o w");
}

TEST(StopCheckerTest, EosAndStopTokens) {
  const std::vector<TokenId> eos = {2, 7};
  SamplingParams p = StopParams({"zz"});
  p.stop_token_ids = {9};
  {
    StopChecker c(p, eos);
    EXPECT_EQ(c.OnToken(5, "ab z").text, "ab ");
    EXPECT_TRUE(c.EndsAt(7));
    EXPECT_FALSE(c.EndsAt(5));
    auto s = c.OnToken(7, "");
    EXPECT_EQ(s.finish, FinishReason::kStop);
    EXPECT_EQ(s.matched_stop_token, 7);
    EXPECT_EQ(s.text, "z");  // held-back text released
  }
  {
    // What the detokenizer held until the stop token is searched too: a
    // stop string in it ends the text there, and is the reason.
    StopChecker c(p, eos);
    EXPECT_EQ(c.OnToken(5, "ab ").text, "ab ");
    auto s = c.OnToken(7, "xzzy");
    EXPECT_EQ(s.finish, FinishReason::kStop);
    EXPECT_EQ(s.matched_stop_string, "zz");
    EXPECT_FALSE(s.matched_stop_token.has_value());
    EXPECT_EQ(s.text, "x");
  }
  {
    StopChecker c(p, eos);
    EXPECT_EQ(c.OnToken(9, "x").finish, FinishReason::kStop);
  }
  p.ignore_eos = true;
  {
    StopChecker c(p, eos);
    EXPECT_EQ(c.OnToken(2, "<eos>").finish, FinishReason::kNone);
    EXPECT_EQ(c.OnToken(9, "x").finish, FinishReason::kStop);  // explicit ids still stop
  }
}

// min_tokens (vLLM v1's): up to the min_tokens-th token nothing stops the
// output, a stop string there included; after it, stop strings, stop tokens
// and EOS end it as usual, a stop string that reaches past the min_tokens-th
// token's text included wherever it starts (vLLM searches from the new
// text back the length of a stop string).
TEST(StopCheckerTest, MinTokensDefersEveryStop) {
  const std::vector<TokenId> eos = {2};
  SamplingParams p = StopParams({"zz"});
  p.min_tokens = 2;
  StopChecker c(p, eos);
  EXPECT_FALSE(c.EndsAt(2));
  auto first = c.OnToken(5, "azz z");
  EXPECT_EQ(first.finish, FinishReason::kNone);
  EXPECT_EQ(first.text, "azz ");  // the stop string within min_tokens is text
  EXPECT_FALSE(c.EndsAt(2));
  // EOS as the 2nd token; "zz" across the two tokens, both within min_tokens.
  auto second = c.OnToken(2, "z");
  EXPECT_EQ(second.finish, FinishReason::kNone);
  EXPECT_EQ(second.text, "z");
  EXPECT_TRUE(c.EndsAt(2));  // the 3rd token may end it
  auto third = c.OnToken(6, "bzzc");
  EXPECT_EQ(third.finish, FinishReason::kStop);
  EXPECT_EQ(third.text, "zb");
  EXPECT_EQ(third.matched_stop_string, "zz");
  // A stop string that starts within min_tokens and ends after it stops the
  // output where it starts (vLLM: "a<S" + "TOP>b" ends as "a").
  SamplingParams straddle = StopParams({"<STOP>"});
  straddle.min_tokens = 1;
  StopChecker s(straddle, eos);
  EXPECT_EQ(s.OnToken(5, "a<S").text, "a");
  auto stopped = s.OnToken(6, "TOP>b");
  EXPECT_EQ(stopped.finish, FinishReason::kStop);
  EXPECT_EQ(stopped.text, "");
  EXPECT_EQ(stopped.matched_stop_string, "<STOP>");
  // A shorter stop string wholly within the held text does not count.
  SamplingParams nested = StopParams({"b", "abc"});
  nested.min_tokens = 1;
  StopChecker n(nested, eos);
  EXPECT_EQ(n.OnToken(5, "xab").text, "x");
  auto after = n.OnToken(6, "z");
  EXPECT_EQ(after.finish, FinishReason::kNone);
  EXPECT_EQ(after.text, "abz");
  // ... however many tokens it stays held: "\n" within min_tokens is text,
  // though "\nObs" then "\nObscure" keep it held as a start of the other.
  SamplingParams held = StopParams({"\n", "\nObservation:"});
  held.min_tokens = 1;
  StopChecker h(held, eos);
  EXPECT_EQ(h.OnToken(5, "a\n").text, "a");
  EXPECT_EQ(h.OnToken(6, "Obs").finish, FinishReason::kNone);
  auto later = h.OnToken(7, "cure");
  EXPECT_EQ(later.finish, FinishReason::kNone);
  EXPECT_EQ(later.text, "\nObscure");
  auto next = h.OnToken(8, "x\ny");
  EXPECT_EQ(next.finish, FinishReason::kStop);
  EXPECT_EQ(next.text, "x");
  StopChecker eos_third(p, eos);
  eos_third.OnToken(5, "a");
  eos_third.OnToken(5, "a");
  EXPECT_EQ(eos_third.OnToken(2, "").finish, FinishReason::kStop);
  // max_tokens still ends it, min_tokens equal to it included.
  SamplingParams all = StopParams({"zz"}, 2);
  all.min_tokens = 2;
  StopChecker full(all, eos);
  EXPECT_EQ(full.OnToken(5, "a").finish, FinishReason::kNone);
  EXPECT_TRUE(full.EndsAt(5));
  const auto last = full.OnToken(5, "zz");
  EXPECT_EQ(last.finish, FinishReason::kLength);
  EXPECT_EQ(last.text, "zz");
}

TEST(StopCheckerTest, MaxTokensReleasesEverything) {
  StopChecker c(StopParams({"abc"}, 2), {});
  EXPECT_EQ(c.OnToken(1, "xa").text, "x");
  auto s = c.OnToken(2, "b");
  EXPECT_EQ(s.finish, FinishReason::kLength);
  EXPECT_EQ(s.text, "ab");
  EXPECT_STREQ(FinishReasonName(s.finish), "length");
  EXPECT_STREQ(FinishReasonName(FinishReason::kStop), "stop");
}

// include_stop_str_in_output (vLLM's): the text ends after the stop
// string, what followed it in the same token still left out; Flush too.
TEST(StopCheckerTest, IncludeStopStrInOutputEndsAfterIt) {
  SamplingParams p = StopParams({"lo W"});
  p.include_stop_str_in_output = true;
  StopChecker c(p, {});
  EXPECT_TRUE(c.KeepsStopText());
  EXPECT_EQ(c.OnToken(1, "Hel").text, "He");
  auto s = c.OnToken(2, "lo World");
  EXPECT_EQ(s.finish, FinishReason::kStop);
  EXPECT_EQ(s.text, "llo W");
  StopChecker f(p, {});
  EXPECT_EQ(f.OnToken(1, "x").text, "x");
  EXPECT_EQ(f.Flush("alo Wyz"), "alo W");
  EXPECT_FALSE(StopChecker(StopParams({"a"}), {}).KeepsStopText());
}

TEST(StopCheckerTest, FlushReleasesHeldBackText) {
  StopChecker c(StopParams({"END"}), {});
  EXPECT_EQ(c.OnToken(1, "the E").text, "the ");
  EXPECT_EQ(c.Flush(), "E");
}

TEST(StopCheckerTest, RandomTextsAgreeWithBruteForce) {
  // Small alphabet so that stop strings and their partial prefixes occur.
  std::mt19937_64 rng(17);
  auto rand_str = [&](size_t lo, size_t hi) {
    std::string s(std::uniform_int_distribution<size_t>(lo, hi)(rng), 'a');
    for (auto& ch : s) ch = "abc"[rng() % 3];
    return s;
  };
  int stopped = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    // Every other trial with include_stop_str_in_output: the text then ends
    // after the stop string.
    const bool include = trial % 2 == 1;
    std::vector<std::string> stops;
    for (size_t n = 1 + rng() % 3; n > 0; --n) stops.push_back(rand_str(1, 5));
    std::vector<std::string> pieces;
    std::string full;
    for (size_t n = 1 + rng() % 12; n > 0; --n) {
      pieces.push_back(rand_str(0, 4));
      full += pieces.back();
    }
    // Brute force: generation stops at the first token after which the
    // text contains a stop string; the text ends at the earliest occurrence.
    std::string expected = full;
    bool expect_stop = false;
    std::string so_far;
    for (size_t i = 0; i < pieces.size() && !expect_stop; ++i) {
      so_far += pieces[i];
      size_t best = std::string::npos, length = 0;
      for (const auto& s : stops) {
        if (const size_t at = so_far.find(s); at < best) {
          best = at;
          length = s.size();
        }
      }
      if (best != std::string::npos) {
        expected = so_far.substr(0, best + (include ? length : 0));
        expect_stop = true;
      }
    }
    SamplingParams params = StopParams(stops, static_cast<int>(pieces.size()) + 1);
    params.include_stop_str_in_output = include;
    StopChecker c(params, {});
    std::string got;
    FinishReason finish = FinishReason::kNone;
    for (size_t i = 0; i < pieces.size() && finish == FinishReason::kNone; ++i) {
      auto step = c.OnToken(1, pieces[i]);
      got += step.text;
      finish = step.finish;
      // What was released never needs taking back.
      ASSERT_EQ(expected.compare(0, got.size(), got), 0) << "released too much";
    }
    if (finish == FinishReason::kNone) got += c.Flush();
    EXPECT_EQ(got, expected);
    EXPECT_EQ(finish == FinishReason::kStop, expect_stop);
    stopped += expect_stop;
  }
  EXPECT_GT(stopped, 500);
  EXPECT_LT(stopped, 1900);
}

// vLLM's bad_words rule: a one-token word always; a longer word's last
// token only right after its other tokens, which must all be output (a
// prompt's tokens do not count); bans already there stay, sorted, once.
TEST(BadWordsTest, TheLastTokenGoesWhereTheOutputEndsWithTheRest) {
  const std::vector<std::vector<TokenId>> words = {{7}, {1, 2}, {3, 1, 4}, {9, 9}};
  auto bans = [&](std::vector<TokenId> output, std::vector<TokenId> already = {}) {
    AppendBadWordBans(words, output, &already);
    return already;
  };
  EXPECT_EQ(bans({}), (std::vector<TokenId>{7}));
  EXPECT_EQ(bans({5, 1}), (std::vector<TokenId>{2, 7}));
  EXPECT_EQ(bans({1, 5}), (std::vector<TokenId>{7}));
  EXPECT_EQ(bans({3, 1}), (std::vector<TokenId>{2, 4, 7}));
  EXPECT_EQ(bans({1}), (std::vector<TokenId>{2, 7}));  // {3, 1, 4} needs 3 before
  EXPECT_EQ(bans({9}, {9, 0}), (std::vector<TokenId>{0, 7, 9}));
}

}  // namespace
}  // namespace pdserve
