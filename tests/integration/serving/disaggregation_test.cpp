// End to end on loopback with real processes: router + prefill + decode
// workers, KV handed off over real UCX (tcp). Output must equal the offline
// engine (`pdserve generate`) token for token; failures must not leak blocks.
#include <signal.h>

#include <gtest/gtest.h>

#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

std::string Words(int n) {
  static const char* kWords[] = {"alpha", "bravo",   "charlie", "delta",
                                 "echo",  "foxtrot", "golf",    "hotel"};
  std::string s;
  for (int i = 0; i < n; ++i)
    s += std::string(i ? " " : "") + kWords[(i * 7 + 3) % 8] + std::to_string(i % 13);
  return s;
}

// Greedy completion through the router, compared with the offline engine.
void ExpectSameAsGenerate(LocalStack& stack, const std::string& prompt, int max_tokens) {
  nlohmann::json want = Generate(prompt, max_tokens);
  ASSERT_TRUE(want.is_object());
  auto [status, got] = stack.Post(
      "/v1/completions",
      {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(status, 200) << got.dump();
  EXPECT_EQ(got["choices"][0]["text"], want["text"])
      << "prompt tokens " << want["prompt_token_ids"].size();
  EXPECT_EQ(got["usage"]["prompt_tokens"], want["prompt_token_ids"].size());
  EXPECT_EQ(got["usage"]["completion_tokens"], want["token_ids"].size());
}

class DisaggregationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    stack_.StartRouter({"--max-local-prefill", "32"});
    for (int i = 0; i < 2; ++i) stack_.StartWorker("prefill", {"--max-local-prefill", "32"});
    for (int i = 0; i < 2; ++i) stack_.StartWorker("decode", {"--max-local-prefill", "32"});
    ASSERT_TRUE(stack_.WaitReady());
  }

  double Sum(const std::string& role, const std::string& metric, const std::string& labels = "") {
    double s = 0;
    for (auto& w : stack_.workers()) {
      if (w->role == role && w->proc.running())
        s += LocalStack::Metric(w->metrics_port, metric, labels);
    }
    return s;
  }

  // Waits until no decode worker holds a block (idle pools).
  bool DecodePoolsIdle() {
    for (int i = 0; i < 200; ++i) {
      if (Sum("decode", "pdserve_kv_cache_usage_ratio") == 0 &&
          Sum("decode", "pdserve_requests_running") == 0) {
        return true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

  LocalStack stack_{"disagg"};
};

TEST_F(DisaggregationTest, GreedyOutputEqualsOfflineEngine) {
  for (int words : {0, 1, 4, 12, 40, 120, 250}) {
    ExpectSameAsGenerate(stack_, words == 0 ? "a" : Words(words), 12);
  }
  // Long prompts really went through prefill workers.
  EXPECT_GT(Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\""), 0);
  EXPECT_GT(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "remote_prefill"),
      0);
  EXPECT_GT(
      LocalStack::Metric(stack_.http_port(), "pdserve_router_decisions_total", "local_prefill"), 0);
  EXPECT_TRUE(DecodePoolsIdle());
}

TEST_F(DisaggregationTest, SharedPrefixIsComputedAndSentOnce) {
  const std::string prefix = Words(150);
  ExpectSameAsGenerate(stack_, prefix + " first " + Words(30), 4);
  const double hits_before = Sum("prefill", "pdserve_prefix_cache_hits_tokens_total");
  const double bytes_first = Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
  ASSERT_GT(bytes_first, 0) << "the first prompt was not prefilled remotely";
  // A different tail, long enough (> --max-local-prefill) to be prefilled remotely.
  ExpectSameAsGenerate(stack_, prefix + " second " + Words(40), 4);
  const double hits = Sum("prefill", "pdserve_prefix_cache_hits_tokens_total") - hits_before;
  const double bytes =
      Sum("prefill", "pdserve_kv_transfer_bytes_total", "direction=\"out\"") - bytes_first;
  // The router sent the prompt to the prefill worker holding the prefix, which
  // reused it; the decode worker, which kept the first prompt's blocks cached,
  // received only the blocks after the shared prefix.
  EXPECT_GE(hits, 16 * 20) << "the prefill worker recomputed the shared prefix";
  EXPECT_GT(bytes, 0);
  EXPECT_LT(bytes, bytes_first / 2) << "shared blocks crossed the wire again";
  EXPECT_TRUE(DecodePoolsIdle());
}

TEST_F(DisaggregationTest, PrefillWorkerKilledMidTransferFallsBackToLocal) {
  // Several long prompts in flight, then the prefill workers die.
  std::vector<std::thread> clients;
  std::vector<std::pair<int, nlohmann::json>> results(6);
  std::vector<nlohmann::json> expected(6);
  std::vector<std::string> prompts;
  for (int i = 0; i < 6; ++i) prompts.push_back(Words(200 + i * 7));
  for (int i = 0; i < 6; ++i) expected[i] = Generate(prompts[i], 8);
  for (int i = 0; i < 6; ++i) {
    clients.emplace_back([&, i] {
      results[i] = stack_.Post(
          "/v1/completions",
          {{"prompt", prompts[i]}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}});
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (auto& w : stack_.workers()) {
    if (w->role == "prefill") w->proc.Signal(SIGKILL);
  }
  for (auto& t : clients) t.join();
  for (int i = 0; i < 6; ++i) {
    ASSERT_EQ(results[i].first, 200) << results[i].second.dump();
    EXPECT_EQ(results[i].second["choices"][0]["text"], expected[i]["text"]) << i;
  }
  EXPECT_TRUE(DecodePoolsIdle()) << "blocks leaked on a decode worker";
  // New long requests still work, prefilled locally.
  ExpectSameAsGenerate(stack_, Words(90), 4);
}

TEST_F(DisaggregationTest, ClientDisconnectMidDecodeFreesEverything) {
  int chunks = 0;
  HttpResult r = HttpStream(stack_.http_port(), "/v1/completions",
                            nlohmann::json{{"prompt", Words(60)},
                                           {"max_tokens", 2000},
                                           {"temperature", 0},
                                           {"ignore_eos", true},
                                           {"stream", true}}
                                .dump(),
                            [&](const std::string& data) {
                              return (chunks += data.find("data:") != std::string::npos) < 3;
                            });
  EXPECT_EQ(r.status, 200);
  EXPECT_GE(chunks, 3);
  EXPECT_TRUE(DecodePoolsIdle()) << "a cancelled request kept its blocks";
  EXPECT_TRUE(stack_.router().WaitForLog(std::regex("cancelled: client disconnected"),
                                         std::chrono::seconds(10)));
}

}  // namespace
}  // namespace pdserve::testing
