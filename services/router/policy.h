// Routing policies: which of several candidate workers gets a request.
//
// A policy sees, per candidate, how much of the prompt it already holds and
// how busy it is, and returns the index of its choice. RouterCore calls one
// policy instance for decode workers and another for prefill workers, under
// its own lock (policies are not thread-safe; they keep counters and an RNG).
//
//   kv            minimise  cost = uncached_tokens + load_weight * queued_work,
//                 queued_work = queued_prefill_tokens + decode_weight * decode_tokens:
//                 the prefill the worker must do for this request plus the
//                 work ahead of it. temperature > 0 samples with
//                 p ~ exp(-(cost - min) / (temperature * (max - min)))
//                 instead of taking the minimum.
//   round_robin   next candidate in turn, ignoring cache and load.
//   least_loaded  minimum queued_work, ignoring cache.
//   random        uniform.
// Ties go to the candidates in rotation, so equal workers share the load.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "services/router/prefix_index.h"

namespace pdserve::router {

struct Candidate {
  WorkerId worker = 0;
  int64_t overlap_blocks = 0;         // leading prompt blocks it holds
  int64_t uncached_tokens = 0;        // prompt tokens it would still compute
  int64_t queued_prefill_tokens = 0;  // prefill work already waiting there
  int64_t decode_tokens = 0;          // tokens of KV in use by running requests
};

struct PolicyOptions {
  // kv: weight of queued work against uncached tokens. 1 would minimise this
  // request's own TTFT; below 1 also counts what recomputing a prefix costs
  // the requests queued behind it. In the simulator (bench/results) TTFT moves
  // by under 2% between 0.1 and 1 while the hit rate falls from 98% to 90% of
  // the oracle; 0.25 keeps load imbalance near 1.1.
  double load_weight = 0.25;
  double decode_weight = 0.05;  // kv, least_loaded: decode tokens' share of queued work
  double temperature = 0.0;     // kv: 0 = argmin
  uint64_t seed = 1;            // random, kv with temperature
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
// InvalidArgument naming the valid choices for an unknown name.
StatusOr<std::unique_ptr<RoutingPolicy>> MakePolicy(std::string_view name,
                                                    const PolicyOptions& options);

// queued_work as the kv and least_loaded policies see it.
double QueuedWork(const Candidate& c, const PolicyOptions& options);
// The kv policy's cost.
double KvCost(const Candidate& c, const PolicyOptions& options);

}  // namespace pdserve::router
