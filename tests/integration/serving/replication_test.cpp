// Hot-prefix replication on the real stack: router + 3 workers with
// --replication-copy-cost, of role both and of role decode (decode-only
// workers write KV for prefix copies alone). A burst on one prefix keeps its
// holder busy, so the router has the holder write the prefix's blocks to
// other workers (a remote prefill by the holder, marked as a copy) and the
// burst spreads; greedy output stays that of the offline engine and every
// block comes back.
#include <gtest/gtest.h>

#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

std::string Words(int n, int salt) {
  static const char* kWords[] = {"alpha", "bravo",   "charlie", "delta",
                                 "echo",  "foxtrot", "golf",    "hotel"};
  std::string s;
  for (int i = 0; i < n; ++i) {
    s += std::string(i ? " " : "") + kWords[(i * 7 + 3 + salt) % 8] + std::to_string(i % 13);
  }
  return s;
}

class ReplicationTest : public ::testing::TestWithParam<const char*> {
 protected:
  double Sum(const std::string& metric, const std::string& labels = "") {
    double s = 0;
    for (auto& w : stack_.workers()) s += LocalStack::Metric(w->metrics_port, metric, labels);
    return s;
  }
  double RouterMetric(const std::string& name, const std::string& labels = "") {
    return LocalStack::Metric(stack_.http_port(), name, labels);
  }
  // Waits until no worker holds a block for a request (idle).
  bool PoolsIdle() {
    for (int i = 0; i < 200; ++i) {
      if (Sum("pdserve_kv_cache_usage_ratio") == 0 && Sum("pdserve_requests_running") == 0) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  LocalStack stack_{"replication"};
};

TEST_P(ReplicationTest, BurstOnOnePrefixIsCopiedAndSpread) {
  stack_.StartRouter({"--replication-copy-cost", "0.05", "--max-local-prefill", "100000"});
  for (int i = 0; i < 3; ++i) stack_.StartWorker(GetParam());
  ASSERT_TRUE(stack_.WaitReady());

  const std::string prefix = Words(200, 0);
  // One request makes one worker the prefix's only holder.
  ExpectSameAsGenerate(stack_, prefix + " warm " + Words(10, 1), 4);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its KV events reach the router
  std::vector<double> before;
  for (auto& w : stack_.workers()) {
    before.push_back(LocalStack::Metric(w->metrics_port, "pdserve_requests_total", "decode"));
  }

  constexpr int kBurst = 9;
  std::vector<std::string> prompts;
  std::vector<nlohmann::json> expected;
  for (int i = 0; i < kBurst; ++i) {
    prompts.push_back(prefix + " request " + std::to_string(i) + " " + Words(12, i + 2));
    expected.push_back(Generate(prompts.back(), 16));
  }
  const auto results = stack_.CompleteTogether(prompts, 16);
  for (int i = 0; i < kBurst; ++i) {
    ASSERT_EQ(results[i].first, 200) << results[i].second.dump() << "\n" << stack_.router().Log();
    EXPECT_EQ(results[i].second["choices"][0]["text"], expected[i]["text"]) << i;
  }

  // The router asked the holder for copies, and they completed.
  EXPECT_GE(RouterMetric("pdserve_router_replications_total", "started"), 1)
      << stack_.router().Log();
  EXPECT_GE(RouterMetric("pdserve_router_replications_total", "finished"), 1);
  EXPECT_GE(RouterMetric("pdserve_router_replicated_blocks_total"), 12);
  EXPECT_GT(Sum("pdserve_kv_transfer_bytes_total", "direction=\"out\""), 0);
  // The burst landed on more than one worker.
  int served = 0;
  for (size_t k = 0; k < stack_.workers().size(); ++k) {
    const double n =
        LocalStack::Metric(stack_.workers()[k]->metrics_port, "pdserve_requests_total", "decode") -
        before[k];
    served += n > 0;
  }
  EXPECT_GE(served, 2) << stack_.router().Log();
  EXPECT_TRUE(PoolsIdle()) << "blocks leaked on a worker";
  // Every copy ended once: by copy (the decode worker's first token says the
  // prompt's KV came from the holder) or failed (it prefilled locally).
  EXPECT_EQ(RouterMetric("pdserve_router_replications_total", "started"),
            RouterMetric("pdserve_router_replications_total", "finished") +
                RouterMetric("pdserve_router_replications_total", "failed"));
}

TEST_P(ReplicationTest, OffByDefault) {
  stack_.StartRouter({"--max-local-prefill", "100000"});
  for (int i = 0; i < 2; ++i) stack_.StartWorker(GetParam());
  ASSERT_TRUE(stack_.WaitReady());
  const std::string prefix = Words(200, 0);
  ExpectSameAsGenerate(stack_, prefix + " warm", 2);
  std::vector<std::thread> clients;
  for (int i = 0; i < 4; ++i) {
    clients.emplace_back([&, i] {
      (void)stack_.Post(
          "/v1/completions",
          {{"prompt", prefix + " " + Words(12, i)}, {"max_tokens", 8}, {"temperature", 0}});
    });
  }
  for (auto& t : clients) t.join();
  EXPECT_EQ(RouterMetric("pdserve_router_replications_total"), 0);
  EXPECT_EQ(Sum("pdserve_kv_transfer_bytes_total"), 0);  // both workers prefill locally
  EXPECT_TRUE(PoolsIdle());
}

INSTANTIATE_TEST_SUITE_P(Roles, ReplicationTest, ::testing::Values("both", "decode"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace pdserve::testing
