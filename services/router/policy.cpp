#include "services/router/policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

namespace pdserve::router {
namespace {

// Picks among the candidates whose score is within a hair of the minimum,
// rotating through them from one decision to the next.
class MinScorePicker {
 public:
  template <typename Score>
  size_t Pick(std::span<const Candidate> candidates, Score score) {
    scores_.resize(candidates.size());
    double best = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < candidates.size(); ++i) {
      scores_[i] = score(candidates[i]);
      best = std::min(best, scores_[i]);
    }
    const double tolerance = 1e-9 * std::max(1.0, std::abs(best));
    ties_.clear();
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (scores_[i] <= best + tolerance) ties_.push_back(i);
    }
    return ties_[rotation_++ % ties_.size()];
  }
  const std::vector<double>& scores() const { return scores_; }

 private:
  std::vector<double> scores_;
  std::vector<size_t> ties_;
  uint64_t rotation_ = 0;
};

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

}  // namespace

const std::vector<std::string>& PolicyNames() {
  static const std::vector<std::string> names = {"kv", "round_robin", "least_loaded", "random"};
  return names;
}

StatusOr<std::unique_ptr<RoutingPolicy>> MakePolicy(std::string_view name,
                                                    const PolicyOptions& options) {
  if (options.load_weight < 0 || options.decode_weight < 0 || options.temperature < 0 ||
      !std::isfinite(options.load_weight) || !std::isfinite(options.decode_weight) ||
      !std::isfinite(options.temperature)) {
    return Status::InvalidArgument(
        "policy weights and temperature must be finite and non-negative");
  }
  std::unique_ptr<RoutingPolicy> p;
  if (name == "kv") p = std::make_unique<KvPolicy>(options);
  if (name == "round_robin") p = std::make_unique<RoundRobinPolicy>();
  if (name == "least_loaded") p = std::make_unique<LeastLoadedPolicy>(options);
  if (name == "random") p = std::make_unique<RandomPolicy>(options);
  if (p) return p;
  std::string valid;
  for (const auto& n : PolicyNames()) valid += (valid.empty() ? "" : "|") + n;
  return Status::InvalidArgument("unknown routing policy '" + std::string(name) +
                                 "' (valid: " + valid + ")");
}

double QueuedWork(const Candidate& c, const PolicyOptions& options) {
  return static_cast<double>(c.queued_prefill_tokens) +
         options.decode_weight * static_cast<double>(c.decode_tokens);
}

double KvCost(const Candidate& c, const PolicyOptions& options) {
  return static_cast<double>(c.uncached_tokens) + options.load_weight * QueuedWork(c, options);
}

}  // namespace pdserve::router
