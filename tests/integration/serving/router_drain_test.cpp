// SIGTERM to the router (a rolling update, a node drain): requests in
// flight run to their end within --drain-timeout while new ones get 503 and
// /ready fails, so that the Service stops sending them; the router then
// exits 0. Each decode step is stretched (the workers' test hook) so that
// the streamed request is still running when the signal comes.
#include <gtest/gtest.h>

#include <signal.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/integration/serving/stack.h"
#include "tests/support/http_client.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

TEST(RouterDrainTest, SigtermLetsRunningRequestsFinishAndRefusesNewOnes) {
  LocalStack stack("router-drain");
  stack.StartRouter({"--drain-timeout", "60"});
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "30"}});
  stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());

  // 60 tokens at 30 ms or more a step: about 2 s.
  const nlohmann::json body = {{"prompt", "a long answer"},
                               {"max_tokens", 60},
                               {"ignore_eos", true},
                               {"temperature", 0},
                               {"stream", true}};
  std::atomic<int> chunks{0};
  std::string streamed;
  HttpResult result;
  std::thread client([&] {
    result =
        HttpStream(stack.http_port(), "/v1/completions", body.dump(), [&](const std::string& data) {
          streamed += data;
          chunks.fetch_add(1);
          return true;
        });
  });
  for (int i = 0; i < 200 && chunks.load() < 3; ++i) std::this_thread::sleep_for(10ms);
  ASSERT_GE(chunks.load(), 3) << "the stream never started";
  stack.router().Signal(SIGTERM);

  // While the stream runs: not ready, and a new request is refused.
  HttpResult ready;
  for (int i = 0; i < 100 && ready.status != 503; ++i) {
    ready = HttpRequest(stack.http_port(), "GET", "/ready");
    if (ready.status != 503) std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(ready.status, 503);
  const auto refused = stack.Post("/v1/completions", {{"prompt", "too late"}, {"max_tokens", 1}});
  EXPECT_EQ(refused.first, 503) << refused.second.dump();

  client.join();
  EXPECT_EQ(result.status, 200);
  // The stream ended as the request asked (60 tokens, "length"), not with an error.
  EXPECT_EQ(streamed.find("\"error\""), std::string::npos)
      << streamed.substr(streamed.size() - 300);
  EXPECT_NE(streamed.find("\"finish_reason\":\"length\""), std::string::npos);
  EXPECT_NE(streamed.find("data: [DONE]"), std::string::npos);
  const auto code = stack.router().Wait(30s);
  ASSERT_TRUE(code.has_value()) << "the router did not exit after its drain";
  EXPECT_EQ(*code, 0) << stack.router().Log();
}

}  // namespace
}  // namespace pdserve::testing
