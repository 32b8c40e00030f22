#include "services/router/policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace pdserve::router {
namespace {

// The kv weights (policy.h: WithKvWeights).
constexpr double kLoadWeight = 1.0 / 6;
constexpr double kDecodeWeight = 0.01;
constexpr double kLoadWeightRelief = 1.0;
constexpr double kDecodeWeightRelief = 0.1;

// Picks among the candidates whose score is within a hair of the minimum,
// then (optionally) those with the smallest tie-break key, rotating through
// the remaining ones from one decision to the next.
class MinScorePicker {
 public:
  template <typename Score>
  size_t Pick(std::span<const Candidate> candidates, Score score) {
    return Pick(candidates, score, [](const Candidate&) { return 0.0; });
  }
  template <typename Score, typename TieBreak>
  size_t Pick(std::span<const Candidate> candidates, Score score, TieBreak tie_break) {
    scores_.resize(candidates.size());
    double best = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < candidates.size(); ++i) {
      scores_[i] = score(candidates[i]);
      best = std::min(best, scores_[i]);
    }
    const double tolerance = 1e-9 * std::max(1.0, std::abs(best));
    double best_tie = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (scores_[i] <= best + tolerance) best_tie = std::min(best_tie, tie_break(candidates[i]));
    }
    ties_.clear();
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (scores_[i] <= best + tolerance && tie_break(candidates[i]) <= best_tie) {
        ties_.push_back(i);
      }
    }
    return ties_[rotation_++ % ties_.size()];
  }
  const std::vector<double>& scores() const { return scores_; }

 private:
  std::vector<double> scores_;
  std::vector<size_t> ties_;
  uint64_t rotation_ = 0;
};

double CeilDiv(int64_t tokens, int64_t block_tokens) {
  return std::ceil(static_cast<double>(tokens) / static_cast<double>(block_tokens));
}

class KvPolicy final : public RoutingPolicy {
 public:
  explicit KvPolicy(const PolicyOptions& options) : options_(options), rng_(options.seed) {}
  std::string_view name() const override { return "kv"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    const size_t argmin =
        picker_.Pick(candidates, [&](const Candidate& c) { return KvCost(c, options_); });
    if (options_.temperature <= 0 || candidates.size() == 1) return argmin;
    const auto& costs = picker_.scores();
    const auto [lo, hi] = std::minmax_element(costs.begin(), costs.end());
    const double range = *hi - *lo;
    if (range <= 0) return argmin;
    weights_.resize(costs.size());
    for (size_t i = 0; i < costs.size(); ++i) {
      weights_[i] = std::exp(-(costs[i] - *lo) / (options_.temperature * range));
    }
    std::discrete_distribution<size_t> dist(weights_.begin(), weights_.end());
    return dist(rng_);
  }

 private:
  PolicyOptions options_;
  MinScorePicker picker_;
  std::mt19937_64 rng_;
  std::vector<double> weights_;
};

class RoundRobinPolicy final : public RoutingPolicy {
 public:
  std::string_view name() const override { return "round_robin"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    return next_++ % candidates.size();
  }

 private:
  uint64_t next_ = 0;
};

class LeastLoadedPolicy final : public RoutingPolicy {
 public:
  explicit LeastLoadedPolicy(const PolicyOptions& options) : options_(options) {}
  std::string_view name() const override { return "least_loaded"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    return picker_.Pick(candidates, [&](const Candidate& c) { return QueuedWork(c, options_); });
  }

 private:
  PolicyOptions options_;
  MinScorePicker picker_;
};

class RandomPolicy final : public RoutingPolicy {
 public:
  explicit RandomPolicy(const PolicyOptions& options) : rng_(options.seed) {}
  std::string_view name() const override { return "random"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    return std::uniform_int_distribution<size_t>(0, candidates.size() - 1)(rng_);
  }

 private:
  std::mt19937_64 rng_;
};

// Dynamo's KV router (DefaultWorkerSelector): cost in blocks, prefill work
// weighted by overlap_score_weight, plus the decode blocks the worker would
// hold; among equal costs the worker with the smaller radix tree.
class DynamoPolicy final : public RoutingPolicy {
 public:
  explicit DynamoPolicy(const PolicyOptions& options) : options_(options) {}
  std::string_view name() const override { return "dynamo"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    return picker_.Pick(
        candidates, [&](const Candidate& c) { return DynamoCost(c, options_); },
        [](const Candidate& c) { return static_cast<double>(c.cached_blocks); });
  }

 private:
  PolicyOptions options_;
  MinScorePicker picker_;
};

// llm-d / Gateway API inference extension: weighted sum of scorers, each in
// [0, 1], highest total wins (max-score-picker).
class LlmdPolicy final : public RoutingPolicy {
 public:
  explicit LlmdPolicy(const PolicyOptions& options) : options_(options) {}
  std::string_view name() const override { return "llm-d"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    int64_t min_queue = std::numeric_limits<int64_t>::max();
    int64_t max_queue = std::numeric_limits<int64_t>::min();
    for (const Candidate& c : candidates) {
      min_queue = std::min(min_queue, c.waiting_requests);
      max_queue = std::max(max_queue, c.waiting_requests);
    }
    return picker_.Pick(candidates, [&](const Candidate& c) {
      return -LlmdScore(c, min_queue, max_queue, options_);
    });
  }

 private:
  PolicyOptions options_;
  MinScorePicker picker_;
};

// SGLang's router, cache_aware: load balancing overrides cache affinity when
// the in-flight request counts are imbalanced by both thresholds.
class SglangPolicy final : public RoutingPolicy {
 public:
  explicit SglangPolicy(const PolicyOptions& options) : options_(options) {}
  std::string_view name() const override { return "sglang"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    int64_t min_load = std::numeric_limits<int64_t>::max();
    int64_t max_load = std::numeric_limits<int64_t>::min();
    int64_t best_overlap = 0;
    int64_t best_cached_tokens = 0;
    for (const Candidate& c : candidates) {
      min_load = std::min(min_load, c.inflight_requests);
      max_load = std::max(max_load, c.inflight_requests);
      if (c.overlap_blocks > best_overlap) {
        best_overlap = c.overlap_blocks;
        best_cached_tokens = c.prompt_tokens - c.uncached_tokens;
      }
    }
    auto load = [](const Candidate& c) { return static_cast<double>(c.inflight_requests); };
    const bool imbalanced =
        max_load - min_load > options_.sglang_balance_abs_threshold &&
        static_cast<double>(max_load) >
            static_cast<double>(min_load) * options_.sglang_balance_rel_threshold;
    const double match_rate = candidates[0].prompt_tokens > 0
                                  ? static_cast<double>(best_cached_tokens) /
                                        static_cast<double>(candidates[0].prompt_tokens)
                                  : 0.0;
    if (imbalanced || !(match_rate > options_.sglang_cache_threshold)) {
      return picker_.Pick(candidates, load);
    }
    return picker_.Pick(
        candidates,
        [&](const Candidate& c) { return c.overlap_blocks == best_overlap ? 0.0 : 1.0; }, load);
  }

 private:
  PolicyOptions options_;
  MinScorePicker picker_;
};

// vLLM production-stack, kvaware: the longest cached prefix when it leaves at
// most kv_aware_threshold tokens to compute, else the lowest recent QPS.
class ProductionStackPolicy final : public RoutingPolicy {
 public:
  explicit ProductionStackPolicy(const PolicyOptions& options) : options_(options) {}
  std::string_view name() const override { return "production-stack"; }
  size_t Pick(std::span<const Candidate> candidates) override {
    int64_t best_overlap = 0;
    int64_t best_uncached = 0;
    for (const Candidate& c : candidates) {
      if (c.overlap_blocks > best_overlap) {
        best_overlap = c.overlap_blocks;
        best_uncached = c.uncached_tokens;
      }
    }
    if (best_overlap > 0 && best_uncached <= options_.production_stack_kv_aware_threshold) {
      return picker_.Pick(candidates, [&](const Candidate& c) {
        return c.overlap_blocks == best_overlap ? 0.0 : 1.0;
      });
    }
    return picker_.Pick(candidates,
                        [](const Candidate& c) { return static_cast<double>(c.recent_requests); });
  }

 private:
  PolicyOptions options_;
  MinScorePicker picker_;
};

}  // namespace

const std::vector<std::string>& PolicyNames() {
  static const std::vector<std::string> names = {
      "kv",          "dynamo",       "llm-d", "sglang", "production-stack",
      "round_robin", "least_loaded", "random"};
  return names;
}

PolicyOptions WithKvWeights(PolicyOptions options, bool relief) {
  if (!options.load_weight) options.load_weight = relief ? kLoadWeightRelief : kLoadWeight;
  if (!options.decode_weight) options.decode_weight = relief ? kDecodeWeightRelief : kDecodeWeight;
  return options;
}

StatusOr<std::unique_ptr<RoutingPolicy>> MakePolicy(std::string_view name,
                                                    const PolicyOptions& options) {
  const PolicyOptions w = WithKvWeights(options, false);
  if (*w.load_weight < 0 || *w.decode_weight < 0 || options.temperature < 0 ||
      !std::isfinite(*w.load_weight) || !std::isfinite(*w.decode_weight) ||
      !std::isfinite(options.temperature)) {
    return Status::InvalidArgument(
        "policy weights and temperature must be finite and non-negative");
  }
  if (options.block_tokens <= 0) return Status::InvalidArgument("block_tokens must be positive");
  if (!(options.host_tier_weight >= 0 && options.host_tier_weight <= 1) ||
      !(options.disk_tier_weight >= 0 && options.disk_tier_weight <= 1)) {
    return Status::InvalidArgument("host and disk tier weights must be in [0, 1]");
  }
  for (double v : {options.dynamo_overlap_score_weight, options.llmd_queue_weight,
                   options.llmd_kv_usage_weight, options.llmd_prefix_weight,
                   options.sglang_cache_threshold, options.sglang_balance_rel_threshold}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return Status::InvalidArgument("anchor policy weights must be finite and non-negative");
    }
  }
  if (options.sglang_balance_abs_threshold < 0 || options.production_stack_kv_aware_threshold < 0 ||
      !(options.qps_window_s > 0) || !std::isfinite(options.qps_window_s)) {
    return Status::InvalidArgument(
        "anchor policy thresholds must be non-negative and the QPS window positive");
  }
  std::unique_ptr<RoutingPolicy> p;
  if (name == "kv") p = std::make_unique<KvPolicy>(options);
  if (name == "round_robin") p = std::make_unique<RoundRobinPolicy>();
  if (name == "least_loaded") p = std::make_unique<LeastLoadedPolicy>(options);
  if (name == "random") p = std::make_unique<RandomPolicy>(options);
  if (name == "dynamo") p = std::make_unique<DynamoPolicy>(options);
  if (name == "llm-d") p = std::make_unique<LlmdPolicy>(options);
  if (name == "sglang") p = std::make_unique<SglangPolicy>(options);
  if (name == "production-stack") p = std::make_unique<ProductionStackPolicy>(options);
  if (p) return p;
  return Status::InvalidArgument("unknown routing policy '" + std::string(name) +
                                 "' (valid: " + PolicyChoices() + ")");
}

std::string PolicyChoices() {
  std::string joined;
  for (const auto& n : PolicyNames()) joined += (joined.empty() ? "" : "|") + n;
  return joined;
}

double QueuedWork(const Candidate& c, const PolicyOptions& options) {
  return static_cast<double>(c.queued_prefill_tokens) +
         options.decode_weight.value_or(kDecodeWeight) * static_cast<double>(c.decode_tokens);
}

double TieredUncachedTokens(const Candidate& c, const PolicyOptions& options) {
  const double b = static_cast<double>(options.block_tokens);
  return static_cast<double>(c.uncached_tokens) +
         (1.0 - options.host_tier_weight) * static_cast<double>(c.host_blocks) * b +
         (1.0 - options.disk_tier_weight) * static_cast<double>(c.disk_blocks) * b;
}

double KvCost(const Candidate& c, const PolicyOptions& options) {
  // Each waiting request stands for one that will queue behind this prefill
  // (Little's law: as many arrive while the queue drains as wait in it now),
  // so this request's uncached tokens delay that many others too.
  const double load_weight = options.load_weight.value_or(kLoadWeight);
  return TieredUncachedTokens(c, options) *
             (1.0 + load_weight * static_cast<double>(c.waiting_requests)) +
         load_weight * QueuedWork(c, options);
}

double DynamoCost(const Candidate& c, const PolicyOptions& options) {
  const double prefill_blocks =
      (static_cast<double>(c.queued_prefill_tokens) + TieredUncachedTokens(c, options)) /
      static_cast<double>(options.block_tokens);
  const double decode_blocks = CeilDiv(c.decode_tokens, options.block_tokens) +
                               CeilDiv(c.prompt_tokens, options.block_tokens);
  return options.dynamo_overlap_score_weight * prefill_blocks + decode_blocks;
}

double LlmdScore(const Candidate& c, int64_t min_waiting, int64_t max_waiting,
                 const PolicyOptions& options) {
  const double queue = max_waiting == min_waiting
                           ? 1.0
                           : static_cast<double>(max_waiting - c.waiting_requests) /
                                 static_cast<double>(max_waiting - min_waiting);
  const double kv = 1.0 - std::clamp(c.kv_usage, 0.0, 1.0);
  const double blocks = CeilDiv(c.prompt_tokens, options.block_tokens);
  const double prefix = blocks > 0 ? static_cast<double>(c.overlap_blocks) / blocks : 0.0;
  return options.llmd_queue_weight * queue + options.llmd_kv_usage_weight * kv +
         options.llmd_prefix_weight * prefix;
}

}  // namespace pdserve::router
