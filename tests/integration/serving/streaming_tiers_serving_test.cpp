// A streaming worker (--kv-eviction streaming, 4 sinks + 32) with a host
// tier behind the real router: once a prompt's blocks went down to the
// host tier, the router's predicted hits for its next request (device and
// host tier) equal what the worker counts, and the text is `pdserve
// generate`'s in the same mode.
#include <gtest/gtest.h>

#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

const std::vector<std::string> kStreaming = {
    "--kv-eviction", "streaming", "--kv-sink-tokens", "4", "--kv-window-tokens", "32"};

std::string Words(int n, int salt) {
  static const char* kWords[] = {"amber", "birch", "cedar", "dune",
                                 "elm",   "fern",  "grove", "heath"};
  std::string s;
  for (int i = 0; i < n; ++i) {
    s += std::string(i ? " " : "") + kWords[(i * 3 + salt) % 8] + std::to_string((i + salt) % 17);
  }
  return s;
}

TEST(StreamingTiersServingTest, PredictedHitsEqualTheWorkersAfterBlocksWentToTheHostTier) {
  LocalStack stack("streaming-tiers");
  stack.StartRouter();
  std::vector<std::string> flags = {"--kv-cache-bytes", "192KiB", "--kv-host-cache-bytes", "1MiB"};
  flags.insert(flags.end(), kStreaming.begin(), kStreaming.end());
  WorkerProc& worker = stack.StartWorker("both", flags);
  ASSERT_TRUE(stack.WaitReady());
  auto worker_metric = [&](const std::string& name, const std::string& labels = "") {
    return LocalStack::Metric(worker.metrics_port, name, labels);
  };
  auto router_metric = [&](const std::string& name, const std::string& labels = "") {
    return LocalStack::Metric(stack.http_port(), name, labels);
  };

  // A prompt of about 13 blocks, then four others: the 24-block pool evicts
  // it to the host tier (whole or in part).
  const std::string hot = Words(40, 1);
  ExpectSameAsGenerate(stack, hot, 8, kStreaming);
  for (int i = 0; i < 4; ++i) ExpectSameAsGenerate(stack, Words(40, 10 + i), 2, kStreaming);
  std::this_thread::sleep_for(1s);  // the tier's KV events reach the router

  const double predicted_device = router_metric("pdserve_router_predicted_hit_tokens_total");
  const double predicted_host =
      router_metric("pdserve_router_predicted_tier_hit_tokens_total", "tier=\"host\"");
  const double device = worker_metric("pdserve_prefix_cache_hits_tokens_total");
  const double host = worker_metric("pdserve_kv_tier_hit_tokens_total", "tier=\"host\"");
  ExpectSameAsGenerate(stack, hot, 8, kStreaming);
  double host_hits = 0;
  for (int i = 0; i < 40 && host_hits == 0; ++i) {  // counted after the answer
    std::this_thread::sleep_for(50ms);
    host_hits = worker_metric("pdserve_kv_tier_hit_tokens_total", "tier=\"host\"") - host;
  }
  // At most the sink block and the window's blocks came back from the tier.
  EXPECT_GT(host_hits, 0) << worker.proc.Log();
  EXPECT_LE(host_hits, 4 * 16);
  EXPECT_EQ(router_metric("pdserve_router_predicted_tier_hit_tokens_total", "tier=\"host\"") -
                predicted_host,
            host_hits);
  EXPECT_EQ(router_metric("pdserve_router_predicted_hit_tokens_total") - predicted_device,
            worker_metric("pdserve_prefix_cache_hits_tokens_total") - device);
}

}  // namespace
}  // namespace pdserve::testing
