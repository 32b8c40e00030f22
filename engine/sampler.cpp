#include "engine/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

namespace pdserve {
namespace {

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Uniform in [0, 1) for output position `position` of the request seeded
// with `seed`: a counter-based draw, so no generator state is carried around.
double UniformDraw(uint64_t seed, uint64_t position) {
  uint64_t bits = SplitMix64(SplitMix64(seed) ^ SplitMix64(position + 0x632be59bd9b4e019ULL));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// Argmax over float logits; NaN never wins, lowest id on ties, 0 if all are
// NaN or -inf.
TokenId Argmax(std::span<const float> logits) {
  size_t best = 0;
  float best_v = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] > best_v) {
      best_v = logits[i];
      best = i;
    }
  }
  return static_cast<TokenId>(best);
}

// Per-thread buffers, reused across calls: the engine samples every sequence
// of every step, and vocabularies reach 150k entries.
struct Scratch {
  std::vector<float> weight;  // by token id: exp((logit - max) / T), in [0, 1]
  std::vector<TokenId> ids;   // kept tokens
  std::vector<TokenId> crossing;
  std::vector<double> bin_mass;
  std::vector<uint32_t> bin_count;
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// For positive floats the IEEE bit pattern orders like the value, so its top
// bits (exponent + 3 mantissa bits) bucket weights into 1024 ordered bins.
constexpr int kBinShift = 20;
constexpr size_t kNumBins = (0x3F800000u >> kBinShift) + 1;  // weights <= 1.0f
size_t Bin(float w) { return std::bit_cast<uint32_t>(w) >> kBinShift; }

// Temperature, top-k, top-p, min-p (see the header for the order), leaving
// the kept tokens in scratch.ids and returning their total weight. Requires
// temperature > 0.
double Filter(std::span<const float> logits, const SamplingParams& p, Scratch& s) {
  const size_t vocab = logits.size();
  s.weight.resize(vocab);
  s.ids.clear();
  const float inv_t = 1.0f / p.temperature;
  const float max_l = logits[Argmax(logits)];
  if (!(max_l > -std::numeric_limits<float>::infinity())) {
    s.ids.push_back(0);  // nothing is possible: fall back to the lowest id
    s.weight[0] = 1;
    return 1;
  }
  const bool inf_max = std::isinf(max_l);  // +inf logits share all the mass
  for (size_t i = 0; i < vocab; ++i) {
    const float l = logits[i];
    float w;
    if (inf_max) {
      w = l == max_l ? 1.0f : 0.0f;
    } else {
      w = l == max_l ? 1.0f : std::exp((l - max_l) * inv_t);  // NaN stays NaN: dropped below
    }
    s.weight[i] = w;
    if (w > 0) s.ids.push_back(static_cast<TokenId>(i));
  }
  const auto& w = s.weight;
  auto more_likely = [&w](TokenId a, TokenId b) { return w[a] != w[b] ? w[a] > w[b] : a < b; };
  // Keeps in s.ids the tokens of bins above `cross` (in order) and moves
  // those of bin `cross` to s.crossing, to be ranked exactly.
  auto split_at = [&](size_t cross) {
    s.crossing.clear();
    size_t out = 0;
    for (TokenId id : s.ids) {
      const size_t b = Bin(w[id]);
      if (b > cross) s.ids[out++] = id;
      if (b == cross) s.crossing.push_back(id);
    }
    s.ids.resize(out);
  };

  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < s.ids.size()) {
    // The k most likely: bins above the one where the count reaches k are
    // kept whole; only the crossing bin is partitioned. O(vocab).
    const size_t k = static_cast<size_t>(p.top_k);
    s.bin_count.assign(kNumBins, 0);
    for (TokenId id : s.ids) ++s.bin_count[Bin(w[id])];
    size_t above = 0;
    size_t cross = 0;
    for (size_t b = kNumBins; b-- > 0;) {
      if (above + s.bin_count[b] >= k) {
        cross = b;
        break;
      }
      above += s.bin_count[b];
    }
    split_at(cross);
    const size_t take = k - above;
    std::nth_element(s.crossing.begin(), s.crossing.begin() + static_cast<std::ptrdiff_t>(take - 1),
                     s.crossing.end(), more_likely);
    s.ids.insert(s.ids.end(), s.crossing.begin(),
                 s.crossing.begin() + static_cast<std::ptrdiff_t>(take));
  }

  if (p.top_p < 1.0f) {
    // Keep token t (most likely first) while the mass before it is below
    // top_p of the mass top-k kept. Bins above the crossing bin are kept
    // whole; only the crossing bin is sorted. O(vocab).
    s.bin_mass.assign(kNumBins, 0.0);
    double mass = 0;
    for (TokenId id : s.ids) {
      s.bin_mass[Bin(w[id])] += w[id];
      mass += w[id];
    }
    const double target = static_cast<double>(p.top_p) * mass;
    double before = 0;
    size_t cross = 0;
    bool found = false;
    for (size_t b = kNumBins; b-- > 0;) {
      if (before + s.bin_mass[b] >= target) {
        cross = b;
        found = true;
        break;
      }
      before += s.bin_mass[b];
    }
    if (found) {  // (not found: rounding left the target unreachable; keep all)
      split_at(cross);
      std::sort(s.crossing.begin(), s.crossing.end(), more_likely);
      for (TokenId id : s.crossing) {
        if (before >= target) break;
        s.ids.push_back(id);
        before += w[id];
      }
    }
  }

  if (p.min_p > 0.0f) {
    // The most likely token survives top-k/top-p and has weight 1, so the
    // threshold min_p * p_max is min_p in weight units.
    const float threshold = p.min_p;
    std::erase_if(s.ids, [&w, threshold](TokenId id) { return w[id] < threshold; });
  }

  double total = 0;
  for (TokenId id : s.ids) total += w[id];
  return total;
}

}  // namespace

std::vector<TokenProb> SamplingDistribution(std::span<const float> logits,
                                            const SamplingParams& params) {
  if (params.temperature == 0) return {{Argmax(logits), 1.0}};
  Scratch& s = ThreadScratch();
  const double total = Filter(logits, params, s);
  std::vector<TokenProb> out;
  out.reserve(s.ids.size());
  for (TokenId id : s.ids) out.push_back({id, s.weight[id] / total});
  std::sort(out.begin(), out.end(), [](const TokenProb& a, const TokenProb& b) {
    return a.prob != b.prob ? a.prob > b.prob : a.token < b.token;
  });
  return out;
}

SampledToken SampleToken(std::span<const float> logits, const SamplingParams& params, uint64_t seed,
                         uint64_t position) {
  SampledToken out;
  if (params.temperature == 0) {
    out.token = Argmax(logits);
  } else {
    Scratch& s = ThreadScratch();
    const double total = Filter(logits, params, s);
    // Inverse CDF over the kept tokens in the order Filter left them (a
    // function of the logits alone), so the draw is deterministic.
    const double target = UniformDraw(seed, position) * total;
    double cum = 0;
    out.token = s.ids.back();
    for (TokenId id : s.ids) {
      cum += s.weight[id];
      if (cum > target) {
        out.token = id;
        break;
      }
    }
  }

  if (params.logprobs.has_value()) {
    // log_softmax of the raw logits; NaN counts as -inf.
    const float max_l = logits[Argmax(logits)];
    double lse = max_l;
    if (std::isfinite(max_l)) {
      double sum = 0;
      for (float v : logits) {
        if (v > -std::numeric_limits<float>::infinity()) sum += std::exp(v - max_l);
      }
      lse = max_l + std::log(sum);
    }
    auto logprob = [&](TokenId id) {
      const float l = logits[id];
      if (std::isnan(l) || !std::isfinite(lse)) return -std::numeric_limits<float>::infinity();
      return static_cast<float>(static_cast<double>(l) - lse);
    };
    out.logprob = logprob(out.token);
    const size_t n = std::min(static_cast<size_t>(*params.logprobs), logits.size());
    if (n > 0) {
      // The n best by a bounded insertion: n <= 20, one pass over the vocabulary.
      auto better = [&](TokenId a, TokenId b) {
        const float la =
            std::isnan(logits[a]) ? -std::numeric_limits<float>::infinity() : logits[a];
        const float lb =
            std::isnan(logits[b]) ? -std::numeric_limits<float>::infinity() : logits[b];
        return la != lb ? la > lb : a < b;
      };
      std::vector<TokenId> best;
      best.reserve(n + 1);
      for (size_t i = 0; i < logits.size(); ++i) {
        const TokenId id = static_cast<TokenId>(i);
        if (best.size() == n && !better(id, best.back())) continue;
        best.insert(std::upper_bound(best.begin(), best.end(), id, better), id);
        if (best.size() > n) best.pop_back();
      }
      out.top_logprobs.reserve(n);
      for (TokenId id : best) out.top_logprobs.push_back({id, logprob(id)});
    }
  }
  return out;
}

void ApplyTokenBitmask(std::span<float> logits, std::span<const uint64_t> allowed) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const size_t n = logits.size();
  for (size_t w = 0; w * 64 < n; ++w) {
    const uint64_t bits = w < allowed.size() ? allowed[w] : 0;
    if (bits == ~uint64_t{0}) continue;
    const size_t end = std::min(n, w * 64 + 64);
    for (size_t t = w * 64; t < end; ++t) {
      if (!((bits >> (t - w * 64)) & 1)) logits[t] = kNegInf;
    }
  }
}

const char* FinishReasonName(FinishReason reason) {
  switch (reason) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kNone:
      break;
  }
  return "";
}

StopChecker::StopChecker(const SamplingParams& params, std::span<const TokenId> eos_token_ids)
    : stop_ids_(params.stop_token_ids),
      stop_strings_(params.stop),
      max_tokens_(static_cast<size_t>(std::max(params.max_tokens, 1))) {
  if (!params.ignore_eos)
    stop_ids_.insert(stop_ids_.end(), eos_token_ids.begin(), eos_token_ids.end());
}

size_t StopChecker::HeldBackLength() const {
  // Longest suffix of pending_ that is a proper prefix of some stop string.
  size_t held = 0;
  for (const std::string& s : stop_strings_) {
    for (size_t len = std::min(pending_.size(), s.size() - 1); len > held; --len) {
      if (pending_.compare(pending_.size() - len, len, s, 0, len) == 0) {
        held = len;
        break;
      }
    }
  }
  return held;
}

StopChecker::Step StopChecker::OnToken(TokenId token, std::string_view text) {
  Step step;
  if (finish_ != FinishReason::kNone) {
    step.finish = finish_;
    return step;
  }
  ++num_tokens_;
  if (IsStopToken(token)) {
    // What is held back cannot contain a whole stop string (it would have
    // matched already), so it is all released; the stop token's text is not.
    finish_ = step.finish = FinishReason::kStop;
    step.matched_stop_token = token;
    step.text = std::exchange(pending_, {});
    return step;
  }
  pending_.append(text);
  // The earliest occurrence of any stop string ends the text.
  size_t best = std::string::npos;
  for (const std::string& s : stop_strings_) {
    size_t pos = pending_.find(s);
    if (pos < best) {
      best = pos;
      step.matched_stop_string = s;
    }
  }
  if (best != std::string::npos) {
    finish_ = step.finish = FinishReason::kStop;
    step.text = pending_.substr(0, best);
    pending_.clear();
    return step;
  }
  if (num_tokens_ >= max_tokens_) {
    finish_ = step.finish = FinishReason::kLength;
    step.text = std::exchange(pending_, {});
    return step;
  }
  const size_t held = HeldBackLength();
  step.text = pending_.substr(0, pending_.size() - held);
  pending_.erase(0, pending_.size() - held);
  return step;
}

std::string StopChecker::Flush() { return std::exchange(pending_, {}); }

bool StopChecker::IsStopToken(TokenId token) const {
  return std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end();
}

}  // namespace pdserve
