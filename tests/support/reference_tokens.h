// The engine's greedy tokens checked against the float64 reference's logits
// for the same sequence, as the KV eviction and window engine tests do.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <span>
#include <vector>

#include "engine/sampler.h"
#include "tests/support/numerics.h"
#include "tests/support/reference_model.h"

namespace pdserve::testing {

// The prompt followed by the sampled tokens: the sequence to run the
// reference over.
inline std::vector<int32_t> WithSampled(const std::vector<int32_t>& prompt,
                                        std::span<const SampledToken> sampled) {
  std::vector<int32_t> all = prompt;
  for (const auto& s : sampled) all.push_back(s.token);
  return all;
}

// `logits`: the reference's for WithSampled(prompt, sampled). Each token is
// the reference's argmax (or within 1e-4 of it: a near tie either may take)
// and its logprob the reference's within `tolerance`.
inline void ExpectReferenceTokens(const std::vector<std::vector<double>>& logits,
                                  size_t prompt_size, std::span<const SampledToken> sampled,
                                  double tolerance = 1e-3) {
  for (size_t i = 0; i < sampled.size(); ++i) {
    const auto lp = LogSoftmax(logits[prompt_size - 1 + i]);
    const int32_t best = ArgMax(lp);
    const int32_t got = sampled[i].token;
    EXPECT_TRUE(got == best || lp[best] - lp[got] < 1e-4) << "step " << i;
    EXPECT_NEAR(sampled[i].logprob, lp[got], tolerance) << "step " << i;
  }
}

}  // namespace pdserve::testing
