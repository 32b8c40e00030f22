// A worker whose engine step hangs (a stuck device, a deadlock) still
// answers the router's heartbeats from its network thread; its /health,
// which the liveness probe reads, fails while one step has run past
// --engine-stall-timeout, and passes again once the step ends. The hang is
// the one fault made up here (PDSERVE_TEST_STEP_DELAY_MS stretches every
// step); the request under it still completes.
#include <gtest/gtest.h>

#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

TEST(EngineStallTest, HealthFailsWhileAStepRunsPastTheTimeoutAndRecovers) {
  LocalStack stack("engine-stall");
  stack.StartRouter();
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "4000"}});
  WorkerProc& worker = stack.StartWorker("both", {"--engine-stall-timeout", "1"});
  ASSERT_TRUE(stack.WaitReady());
  EXPECT_EQ(HttpRequest(worker.metrics_port, "GET", "/health").status, 200);

  int status = 0;
  std::thread client([&] {
    status = stack.Post("/v1/completions", {{"prompt", "a hung step"}, {"max_tokens", 1}}).first;
  });
  HttpResult unhealthy;
  for (int i = 0; i < 100 && unhealthy.status != 503; ++i) {
    std::this_thread::sleep_for(50ms);
    unhealthy = HttpRequest(worker.metrics_port, "GET", "/health");
  }
  EXPECT_EQ(unhealthy.status, 503);
  EXPECT_NE(unhealthy.body.find("an engine step has run for"), std::string::npos) << unhealthy.body;
  // What the liveness probe reads fails too (the step is still running: the
  // timeout is 1 s, the step 4 s).
  EXPECT_EQ(HttpRequest(worker.metrics_port, "GET", "/live").status, 503);
  client.join();
  EXPECT_EQ(status, 200);
  EXPECT_EQ(HttpRequest(worker.metrics_port, "GET", "/health").status, 200);
  EXPECT_EQ(HttpRequest(worker.metrics_port, "GET", "/live").status, 200);
}

}  // namespace
}  // namespace pdserve::testing
