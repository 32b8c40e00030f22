#include "common/metrics/metrics.h"

#include <prometheus/text_serializer.h>

#include <nlohmann/json.hpp>

#include "common/http/bearer_auth.h"

namespace pdserve::metrics {

const std::vector<double>& TimeToFirstTokenBuckets() {
  static const std::vector<double> b = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                        0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                        20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
  return b;
}

const std::vector<double>& InterTokenLatencyBuckets() {
  static const std::vector<double> b = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                        0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
  return b;
}

const std::vector<double>& RequestLatencyBuckets() {
  static const std::vector<double> b = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                        5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                        60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
  return b;
}

const std::vector<double>& KvTransferBuckets() {
  // Up to a minute: a hand-off may take its whole --prefill-timeout-ms (30 s).
  static const std::vector<double> b = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                        0.5,    1.0,   2.5,    5.0,   10.0, 20.0,  30.0, 60.0};
  return b;
}

const std::vector<double>& RouteDecisionBuckets() {
  // Up to a quarter second: a decision includes tokenizing and hashing the
  // prompt, 12 ms for 32k tokens.
  static const std::vector<double> b = {1e-6, 2.5e-6, 5e-6, 1e-5, 2e-5,   5e-5, 1e-4, 2.5e-4,
                                        5e-4, 1e-3,   5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,  0.25};
  return b;
}

prometheus::Counter& AddCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help) {
  return AddCounterFamily(registry, name, help).Add({});
}

prometheus::Gauge& AddGauge(prometheus::Registry& registry, const std::string& name,
                            const std::string& help) {
  return AddGaugeFamily(registry, name, help).Add({});
}

prometheus::Histogram& AddHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help, const std::vector<double>& buckets) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add({}, buckets);
}

prometheus::Family<prometheus::Histogram>& AddHistogramFamily(prometheus::Registry& registry,
                                                              const std::string& name,
                                                              const std::string& help) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry);
}

prometheus::Family<prometheus::Counter>& AddCounterFamily(prometheus::Registry& registry,
                                                          const std::string& name,
                                                          const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry);
}

prometheus::Family<prometheus::Gauge>& AddGaugeFamily(prometheus::Registry& registry,
                                                      const std::string& name,
                                                      const std::string& help) {
  return prometheus::BuildGauge().Name(name).Help(help).Register(registry);
}

std::string Serialize(const prometheus::Registry& registry) {
  prometheus::TextSerializer serializer;
  return serializer.Serialize(registry.Collect());
}

bool ServeStandardEndpoints(const http::Request& request, http::Exchange& exchange,
                            const prometheus::Registry& registry,
                            const std::function<Health()>& health,
                            const std::vector<std::string>& metrics_keys) {
  if (request.path == "/metrics") {
    if (!metrics_keys.empty()) {
      const http::BearerCheck auth = http::CheckBearer(request, metrics_keys);
      if (!auth.accepted()) {
        exchange.Reply(http::BearerRefusal(auth));
        return true;
      }
    }
    if (request.method != "GET") {
      exchange.Reply(http::ErrorResponse(405, "use GET for /metrics"));
      return true;
    }
    http::Response r;
    r.content_type = "text/plain; version=0.0.4; charset=utf-8";
    r.body = Serialize(registry);
    exchange.Reply(std::move(r));
    return true;
  }
  if (request.path == "/health" || request.path == "/live") {
    const Health h = health ? health() : Health{};
    const bool ok = request.path == "/health" ? h.healthy : h.live;
    http::Response r;
    r.status = ok ? 200 : 503;
    r.body = nlohmann::json{{"status", ok ? "ok" : "unhealthy"}, {"detail", h.detail}}.dump(
        -1, ' ', false, nlohmann::json::error_handler_t::replace);
    exchange.Reply(std::move(r));
    return true;
  }
  return false;
}

}  // namespace pdserve::metrics
