// Small helpers the engine tests share: random prompts and a float64
// log-softmax to compare the engine's logits with the references'.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace pdserve::testing {

// `n` token ids drawn uniformly from [0, vocab), the same for the same seed.
inline std::vector<int32_t> RandomTokens(int n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

inline std::vector<double> LogSoftmax(const std::vector<double>& logits) {
  const double max = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (double x : logits) sum += std::exp(x - max);
  std::vector<double> out(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - max - std::log(sum);
  return out;
}

}  // namespace pdserve::testing
