// A worker whose engine hangs in a step while its connection stays up (its
// heartbeats come from another thread) stops sending load reports, which
// its engine loop sends between steps: past --worker-stall-timeout the
// router sends new requests elsewhere, shows it as "stalled" in
// pdserve_router_workers, and takes it back once it reports again. The
// hang is the workers' test hook stretching every step.
#include <gtest/gtest.h>

#include <chrono>
#include <regex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/integration/serving/stack.h"
#include "tests/support/http_client.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

TEST(WorkerStallTest, AHungEngineGetsNoNewRequestsUntilItReportsAgain) {
  LocalStack stack("worker-stall");
  stack.StartRouter({"--worker-stall-timeout", "2"});
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "12000"}});
  const WorkerProc& slow = stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());

  // The only worker takes the first request, and its one step hangs 12 s.
  const nlohmann::json body = {{"prompt", "a slow step"}, {"max_tokens", 1}};
  HttpResult first;
  std::thread client([&] {
    first = HttpRequest(stack.http_port(), "POST", "/v1/completions", body.dump(),
                        {{"x-request-id", "on-the-hung-one"}});
  });
  ASSERT_TRUE(stack.router().WaitForLog(
      std::regex("worker " + slow.id + " sent no load report for 2 s"), 10s))
      << stack.router().Log();
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_workers", "state=\"stalled\""),
            1.0);

  // A second worker: new requests go to it, not to the hung one.
  stack.SetWorkerEnv({});
  const WorkerProc& fast = stack.StartWorker("both");
  const HttpResult second =
      HttpRequest(stack.http_port(), "POST", "/v1/completions",
                  nlohmann::json{{"prompt", "a slow step"}, {"max_tokens", 1}}.dump(),
                  {{"x-request-id", "elsewhere"}});
  EXPECT_EQ(second.status, 200) << second.body;
  EXPECT_TRUE(
      stack.router().WaitForLog(std::regex("request elsewhere ok: .*decode " + fast.id), 10s))
      << stack.router().Log();

  // The hung step ends: its request completes, and the worker is back.
  client.join();
  EXPECT_EQ(first.status, 200) << first.body;
  EXPECT_TRUE(stack.router().WaitForLog(std::regex("worker " + slow.id + " reports again"), 10s))
      << stack.router().Log();
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_workers", "state=\"stalled\""),
            0.0);
}

}  // namespace
}  // namespace pdserve::testing
