// Prometheus helpers shared by every pdserve process (docs/architecture.md section 8).
//
// Metric names carry the `pdserve_` prefix and base units; counters end in
// `_total`. Histogram buckets follow vLLM's where a counterpart exists, so
// dashboards and habits carry over.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "common/http/http_server.h"

namespace pdserve::metrics {

// Bucket boundaries in seconds.
const std::vector<double>& TimeToFirstTokenBuckets();
const std::vector<double>& InterTokenLatencyBuckets();
const std::vector<double>& RequestLatencyBuckets();
const std::vector<double>& KvTransferBuckets();
const std::vector<double>& RouteDecisionBuckets();

// Registration in one call. The unlabelled forms return the single series;
// the Family forms leave adding labelled series to the caller. References
// stay valid as long as the registry lives.
prometheus::Counter& AddCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help);
prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help);
prometheus::Histogram& AddHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help, const std::vector<double>& buckets);
prometheus::Family<prometheus::Counter>& AddCounterFamily(prometheus::Registry& registry,
                                                          const std::string& name,
                                                          const std::string& help);
prometheus::Family<prometheus::Gauge>& AddGaugeFamily(prometheus::Registry& registry,
                                                      const std::string& name,
                                                      const std::string& help);
// Series of a histogram family take their buckets when added.
prometheus::Family<prometheus::Histogram>& AddHistogramFamily(prometheus::Registry& registry,
                                                              const std::string& name,
                                                              const std::string& help);

// Prometheus text exposition format (version 0.0.4) of everything in `registry`.
std::string Serialize(const prometheus::Registry& registry);

// What the probes report. /health: `healthy` (the process can serve now:
// readiness) → 200, otherwise 503. /live: `live` (the process itself works;
// a liveness probe that fails restarts it) → 200, otherwise 503. A worker
// without a router is live but not healthy: restarting it would not bring
// the router back. `detail` goes in both bodies.
struct Health {
  bool healthy = true;
  std::string detail;
  bool live = true;
};

// Answers GET /metrics, /health and /live; returns false (and does nothing)
// for any other path, so callers chain their own routes after it. With
// `metrics_keys` (--metrics-key-file), /metrics answers only requests with
// "Authorization: Bearer <one of them>" (http/bearer_auth.h); the probes stay
// open.
bool ServeStandardEndpoints(const http::Request& request, http::Exchange& exchange,
                            const prometheus::Registry& registry,
                            const std::function<Health()>& health,
                            const std::vector<std::string>& metrics_keys = {});

}  // namespace pdserve::metrics
