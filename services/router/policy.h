// Routing policies: which of several candidate workers gets a request.
//
// A policy sees, per candidate, how much of the prompt it already holds and
// how busy it is, and returns the index of its choice. RouterCore calls one
// policy instance for decode workers and another for prefill workers, under
// its own lock (policies are not thread-safe; they keep counters and an RNG).
//
//   kv            minimise  cost = uncached_tokens * (1 + load_weight * waiting_requests)
//                                  + load_weight * queued_work,
//                 queued_work = queued_prefill_tokens + decode_weight * decode_tokens:
//                 at load_weight 1 the predicted prefill delay in tokens, this
//                 request's (the work ahead of it plus its own prefill) and
//                 the one its prefill adds to the requests that will queue
//                 behind it (as many as wait there now, by Little's law);
//                 below 1 a computed token also costs what it takes from the
//                 cache's future hits. temperature > 0 samples with
//                 p ~ exp(-(cost - min) / (temperature * (max - min)))
//                 instead of taking the minimum.
//   round_robin   next candidate in turn, ignoring cache and load.
//   least_loaded  minimum queued_work, ignoring cache.
//   random        uniform.
// Ties go to the candidates in rotation, so equal workers share the load.
//
// The anchors' default KV-aware policies, modelled from their code and docs
// (docs/routing.md cites the file each default comes from). Each sees the
// same Candidate view as kv (this router's index and load accounting), so a
// comparison isolates the decision rule:
//   dynamo            minimise overlap_score_weight (1) * prefill blocks + decode
//                     blocks, prefill blocks = (queued prefill tokens + this
//                     request's uncached tokens) / block, decode blocks = blocks
//                     of running requests + this request's; temperature 0; ties
//                     to the smaller cache (tree size), then rotation.
//   llm-d             maximise 2 * queue score + 2 * (1 - KV usage) + 3 * prefix
//                     score (the inference pool's default scorer weights), queue
//                     score = min-max normalised waiting requests (1 when all
//                     equal), prefix score = leading cached blocks / prompt blocks.
//   sglang            cache_aware: if max - min in-flight requests > 64 and
//                     max > 1.5 * min, the least loaded worker; else if the
//                     longest cached prefix covers more than 30% of the prompt,
//                     the worker holding it (least loaded among equals); else
//                     the least loaded worker.
//   production-stack  kvaware: the worker holding the longest cached prefix
//                     when the prompt tokens it lacks are at most 2000; else
//                     the worker that received the fewest requests over the
//                     last 60 s (lowest QPS).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "services/router/prefix_index.h"

namespace pdserve::router {

struct Candidate {
  WorkerId worker = 0;
  int64_t prompt_tokens = 0;   // of this request (equal for every candidate)
  int64_t overlap_blocks = 0;  // leading prompt blocks it holds (device pool)
  // The blocks after those it holds in its lower tiers (copied back rather
  // than computed, at a cost: PolicyOptions host/disk_tier_weight).
  int64_t host_blocks = 0;
  int64_t disk_blocks = 0;
  int64_t uncached_tokens = 0;        // prompt tokens it would still compute
  int64_t queued_prefill_tokens = 0;  // prefill work already waiting there
  int64_t decode_tokens = 0;          // tokens of KV in use by running requests
  int64_t inflight_requests = 0;      // routed there and not finished
  int64_t waiting_requests = 0;       // of those, not yet past their prefill
  double kv_usage = 0;                // share of its KV blocks in use, 0..1
  int64_t recent_requests = 0;        // routed there within PolicyOptions::qps_window_s
  int64_t cached_blocks = 0;          // blocks the index says it holds
};

struct PolicyOptions {
  // kv: weight of queued work (and of the requests waiting behind a
  // prefill) against uncached tokens. 1 minimises the predicted prefill
  // delay of this request and of those it delays; below 1 a recomputed
  // prefix also costs the hits it would have given. Unset: WithKvWeights
  // picks it.
  std::optional<double> load_weight;
  // kv, least_loaded: decode tokens' share of queued work (decode costs a
  // request's prefill far less per token than queued prefill does). Unset:
  // WithKvWeights picks it.
  std::optional<double> decode_weight;
  // kv, dynamo: what a prompt token found in a lower tier is worth against
  // one in the device pool (1) and one to compute (0): copying it back costs
  // time too. Dynamo's KVBM defaults (its router credits host blocks at 0.75
  // and disk blocks at 0.25 of a device hit).
  double host_tier_weight = 0.75;
  double disk_tier_weight = 0.25;
  double temperature = 0.0;   // kv: 0 = argmin
  uint64_t seed = 1;          // random, kv with temperature
  int64_t block_tokens = 16;  // dynamo, llm-d: tokens per block (RouterCore sets it)

  // The anchors' shipped defaults (docs/routing.md).
  double dynamo_overlap_score_weight = 1.0;
  double llmd_queue_weight = 2.0;
  double llmd_kv_usage_weight = 2.0;
  double llmd_prefix_weight = 3.0;
  double sglang_cache_threshold = 0.3;
  int64_t sglang_balance_abs_threshold = 64;
  double sglang_balance_rel_threshold = 1.5;
  int64_t production_stack_kv_aware_threshold = 2000;  // uncached tokens
  double qps_window_s = 60.0;                          // production-stack's --request-stats-window
};

class RoutingPolicy {
 public:
  virtual ~RoutingPolicy() = default;
  virtual std::string_view name() const = 0;
  // Index into `candidates` (non-empty).
  virtual size_t Pick(std::span<const Candidate> candidates) = 0;
};

// The policy names accepted by --policy, in the order --help lists them.
const std::vector<std::string>& PolicyNames();
// The same, joined by '|' (for --help and errors).
std::string PolicyChoices();
// The kv weights (load_weight, decode_weight) left unset. A recomputed
// prefix costs the cache hits it would have given, so most decisions weigh
// the predicted delay at 1/6 against uncached tokens, decode at 0.01
// (affinity). A hot prefix with fewer holders than its traffic earns needs
// relief for its holders, a second holder more than its cache hits: such a
// decision weighs the predicted delay alone, 1 / 0.1 (relief; skew at time
// scale 0.5 without copies: p99 0.77 s against 1.60 s before the
// waiting-request term), copies on or off (a copy starts instead only where
// it predicts no more delay than relief: RouterCore). RouterCore applies
// this per decision (router and simulator alike); MakePolicy alone treats
// unset as affinity. Weights the caller set are kept either way.
PolicyOptions WithKvWeights(PolicyOptions options, bool relief);
// least_loaded's decode_weight when unset.
inline constexpr double kLeastLoadedDecodeWeight = 0.05;

// InvalidArgument naming the valid choices for an unknown name.
StatusOr<std::unique_ptr<RoutingPolicy>> MakePolicy(std::string_view name,
                                                    const PolicyOptions& options);

// queued_work as the kv and least_loaded policies see it.
double QueuedWork(const Candidate& c, const PolicyOptions& options);
// The prompt tokens a candidate does not hold in its device pool, with those
// in its lower tiers counted at (1 - their tier's weight): what the kv and
// dynamo policies weigh as uncached.
double TieredUncachedTokens(const Candidate& c, const PolicyOptions& options);
// The kv policy's cost.
double KvCost(const Candidate& c, const PolicyOptions& options);
// The dynamo policy's cost (its "logit"; lower is better).
double DynamoCost(const Candidate& c, const PolicyOptions& options);
// The llm-d policy's score (higher is better); min/max_waiting over the candidates.
double LlmdScore(const Candidate& c, int64_t min_waiting, int64_t max_waiting,
                 const PolicyOptions& options);

}  // namespace pdserve::router
