#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace pdserve {
namespace {

constexpr size_t kMaxStopStrings = 16;
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

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

double Logit(float v) { return std::isnan(v) ? kNegInf : static_cast<double>(v); }

TokenId Argmax(std::span<const float> logits) {
  size_t best = 0;
  double best_v = Logit(logits[0]);
  for (size_t i = 1; i < logits.size(); ++i) {
    double v = Logit(logits[i]);
    if (v > best_v) {
      best_v = v;
      best = i;
    }
  }
  return static_cast<TokenId>(best);
}

// The kept tokens and their unnormalised weights.
struct Candidates {
  std::vector<TokenId> ids;
  std::vector<double> weight;  // indexed by token id, all tokens
  bool sorted = false;         // ids most likely first (ties by id)
  double total = 0;            // sum of the kept weights
};

// Temperature, top-k, top-p, min-p: see the header for the order. Requires
// temperature > 0.
Candidates Filter(std::span<const float> logits, const SamplingParams& p) {
  const size_t vocab = logits.size();
  Candidates c;
  c.weight.resize(vocab);
  const double inv_t = 1.0 / static_cast<double>(p.temperature);
  double max_z = kNegInf;
  for (size_t i = 0; i < vocab; ++i) max_z = std::max(max_z, Logit(logits[i]) * inv_t);
  if (max_z == kNegInf) {  // nothing is possible: fall back to the lowest id
    c.ids = {0};
    c.weight[0] = 1;
    c.total = 1;
    c.sorted = true;
    return c;
  }
  const bool inf_max = std::isinf(max_z);  // +inf logits share all the mass
  for (size_t i = 0; i < vocab; ++i) {
    double z = Logit(logits[i]) * inv_t;
    c.weight[i] = inf_max ? (z == max_z ? 1.0 : 0.0) : std::exp(z - max_z);
  }
  c.ids.reserve(vocab);
  for (size_t i = 0; i < vocab; ++i) {
    if (c.weight[i] > 0) c.ids.push_back(static_cast<TokenId>(i));
  }
  auto more_likely = [&c](TokenId a, TokenId b) {
    return c.weight[a] != c.weight[b] ? c.weight[a] > c.weight[b] : a < b;
  };

  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < c.ids.size()) {
    std::nth_element(c.ids.begin(), c.ids.begin() + (p.top_k - 1), c.ids.end(), more_likely);
    c.ids.resize(static_cast<size_t>(p.top_k));
  }

  if (p.top_p < 1.0f) {
    double kept_mass = 0;
    for (TokenId id : c.ids) kept_mass += c.weight[id];
    const double target = static_cast<double>(p.top_p) * kept_mass;
    // Sort just enough of the head to cover `target`, growing geometrically:
    // with peaked distributions a few dozen tokens carry the mass.
    size_t m = std::min<size_t>(c.ids.size(), 64);
    for (;;) {
      std::partial_sort(c.ids.begin(), c.ids.begin() + m, c.ids.end(), more_likely);
      double cum = 0;
      size_t cut = 0;
      for (size_t j = 0; j < m; ++j) {
        cum += c.weight[c.ids[j]];
        if (cum >= target) {
          cut = j + 1;
          break;
        }
      }
      if (cut > 0) {
        c.ids.resize(cut);
        break;
      }
      if (m == c.ids.size()) break;  // rounding: keep everything
      m = std::min(c.ids.size(), m * 4);
    }
    c.sorted = true;
  }

  if (p.min_p > 0.0f) {
    // The most likely token is always kept by top-k/top-p, and its weight is 1
    // (or it shares the +inf mass), so the threshold is min_p * 1.
    const double threshold = static_cast<double>(p.min_p);
    std::erase_if(c.ids, [&c, threshold](TokenId id) { return c.weight[id] < threshold; });
  }

  for (TokenId id : c.ids) c.total += c.weight[id];
  return c;
}

}  // namespace

Status ValidateSamplingParams(const SamplingParams& p, size_t vocab_size) {
  if (!std::isfinite(p.temperature) || p.temperature < 0) {
    return Status::InvalidArgument("temperature must be a number >= 0, got " + Num(p.temperature));
  }
  if (p.top_k < -1) {
    return Status::InvalidArgument("top_k must be -1 or 0 (disabled) or at least 1, got " +
                                   std::to_string(p.top_k));
  }
  if (!(p.top_p > 0 && p.top_p <= 1)) {
    return Status::InvalidArgument("top_p must be in (0, 1], got " + Num(p.top_p));
  }
  if (!(p.min_p >= 0 && p.min_p <= 1)) {
    return Status::InvalidArgument("min_p must be in [0, 1], got " + Num(p.min_p));
  }
  if (p.max_tokens < 1) {
    return Status::InvalidArgument("max_tokens must be at least 1, got " +
                                   std::to_string(p.max_tokens));
  }
  for (TokenId id : p.stop_token_ids) {
    if (id < 0 || (vocab_size > 0 && static_cast<size_t>(id) >= vocab_size)) {
      return Status::InvalidArgument("stop_token_ids: " + std::to_string(id) +
                                     " is not a token id of this model (vocabulary size " +
                                     std::to_string(vocab_size) + ")");
    }
  }
  if (p.stop.size() > kMaxStopStrings) {
    return Status::InvalidArgument("stop: at most " + std::to_string(kMaxStopStrings) +
                                   " stop strings, got " + std::to_string(p.stop.size()));
  }
  for (const std::string& s : p.stop) {
    if (s.empty()) return Status::InvalidArgument("stop: stop strings must not be empty");
  }
  if (p.logprobs.has_value() && (*p.logprobs < 0 || *p.logprobs > kMaxLogprobs)) {
    return Status::InvalidArgument("logprobs must be in [0, " + std::to_string(kMaxLogprobs) +
                                   "], got " + std::to_string(*p.logprobs));
  }
  return Status::Ok();
}

uint64_t ResolveSeed(const SamplingParams& params) {
  if (params.seed.has_value()) return *params.seed;
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

std::vector<TokenProb> SamplingDistribution(std::span<const float> logits,
                                            const SamplingParams& params) {
  if (params.temperature == 0) return {{Argmax(logits), 1.0}};
  Candidates c = Filter(logits, params);
  std::vector<TokenProb> out;
  out.reserve(c.ids.size());
  for (TokenId id : c.ids) out.push_back({id, c.weight[id] / c.total});
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
    Candidates c = Filter(logits, params);
    // Inverse CDF over the kept tokens in a fixed order (id order, or most
    // likely first once top-p sorted them): deterministic for given logits.
    const double target = UniformDraw(seed, position) * c.total;
    double cum = 0;
    out.token = c.ids.back();
    for (TokenId id : c.ids) {
      cum += c.weight[id];
      if (cum > target) {
        out.token = id;
        break;
      }
    }
  }

  if (params.logprobs.has_value()) {
    double max_l = kNegInf;
    for (float v : logits) max_l = std::max(max_l, Logit(v));
    double lse = max_l;
    if (std::isfinite(max_l)) {
      double sum = 0;
      for (float v : logits) sum += std::exp(Logit(v) - max_l);
      lse = max_l + std::log(sum);
    }
    auto logprob = [&](TokenId id) {
      return static_cast<float>(std::isfinite(lse) ? Logit(logits[id]) - lse : kNegInf);
    };
    out.logprob = logprob(out.token);
    const size_t n = std::min(static_cast<size_t>(*params.logprobs), logits.size());
    std::vector<TokenId> ids(logits.size());
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<TokenId>(i);
    std::partial_sort(ids.begin(), ids.begin() + n, ids.end(), [&](TokenId a, TokenId b) {
      double la = Logit(logits[a]), lb = Logit(logits[b]);
      return la != lb ? la > lb : a < b;
    });
    out.top_logprobs.reserve(n);
    for (size_t i = 0; i < n; ++i) out.top_logprobs.push_back({ids[i], logprob(ids[i])});
  }
  return out;
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
  if (std::find(stop_ids_.begin(), stop_ids_.end(), token) != stop_ids_.end()) {
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

}  // namespace pdserve
