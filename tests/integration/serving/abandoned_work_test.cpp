// Work nobody waits for stops, on real processes: a prompt batch whose
// answer is already an error, a prompt whose client left while a prefill
// worker computes it, and a prefill job past its deadline. Each used to run
// to its end (the last one also closed the prefill worker's link to its
// decode worker, failing every other hand-off on it). Slow engine steps come
// from the workers' test hook, PDSERVE_TEST_STEP_DELAY_MS.
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <regex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "tests/integration/serving/stack.h"
#include "tests/support/http_client.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// A prompt of about `words` tokens, each test its own.
std::string Prompt(const std::string& salt, int words) {
  std::string s = salt;
  for (int i = 0; i < words; ++i) s += " w" + std::to_string(i % 10);
  return s;
}

// Polls `port`'s metric until it equals `want` or `timeout` passes.
bool WaitForMetric(int port, const std::string& name, const std::string& labels, double want,
                   std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < until) {
    if (LocalStack::Metric(port, name, labels) == want) return true;
    std::this_thread::sleep_for(50ms);
  }
  return LocalStack::Metric(port, name, labels) == want;
}

// Every prompt prefilled remotely: a prefill worker run with `prefill_env`
// (a test hook) and a decode worker with `decode_flags`.
std::pair<WorkerProc*, WorkerProc*> StartHandOffPair(LocalStack& stack,
                                                     std::map<std::string, std::string> prefill_env,
                                                     const std::vector<std::string>& decode_flags) {
  stack.StartRouter({"--max-local-prefill", "0"});
  stack.SetWorkerEnv(std::move(prefill_env));
  WorkerProc* prefill = &stack.StartWorker("prefill");
  stack.SetWorkerEnv({});
  WorkerProc* decode = &stack.StartWorker("decode", decode_flags);
  return {prefill, decode};
}

// A greedy request the decode worker ends up prefilling itself: answered
// with `pdserve generate`'s text.
void ExpectAnsweredAsGenerate(LocalStack& stack, const std::string& salt) {
  const std::string prompt = Prompt(salt, 120);
  const nlohmann::json want = Generate(prompt, 3);
  auto [status, body] =
      stack.Post("/v1/completions",
                 {{"prompt", prompt}, {"max_tokens", 3}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_EQ(body["choices"][0]["text"], want["text"]);
}

// The decode worker's blocks held for peers, once its gauge shows any
// (within `tries` polls 50 ms apart), else 0.
double HeldForPeersSoon(const WorkerProc& decode, int tries) {
  double held = 0;
  for (int i = 0; i < tries && held == 0; ++i) {
    held = LocalStack::Metric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers");
    if (held == 0) std::this_thread::sleep_for(50ms);
  }
  return held;
}

// One prompt of a batch is refused: the client gets the 400 at once, and
// the prompt already running (200 tokens of 100 ms steps: 20 s) is cancelled
// at its next token instead of running for nobody.
TEST(AbandonedWorkTest, AFailedPromptBatchStopsItsOtherPrompts) {
  LocalStack stack("abandoned-batch");
  stack.StartRouter();
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "100"}});
  WorkerProc& worker = stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  auto [status, body] =
      stack.Post("/v1/completions",
                 {{"prompt", {{5, 6, 7}, {99999}}}, {"max_tokens", 200}, {"ignore_eos", true}});
  EXPECT_EQ(status, 400) << body.dump();
  EXPECT_TRUE(worker.proc.WaitForLog(std::regex("request \\S+ cancelled: "), 10s))
      << worker.proc.Log();
  EXPECT_TRUE(WaitForMetric(worker.metrics_port, "pdserve_requests_running", "", 0, 10s));
  EXPECT_EQ(worker.proc.Log().find("completion 200"), std::string::npos) << worker.proc.Log();
}

// The client leaves while a prefill worker computes its prompt (five chunks
// of one-second steps): the decode worker tells it to stop, it reports the
// job cancelled, and the decode worker's blocks for it are free.
TEST(AbandonedWorkTest, AClientWhoLeavesStopsTheRemotePrefill) {
  LocalStack stack("abandoned-prefill");
  stack.StartRouter({"--max-local-prefill", "32"});
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "1000"}});
  WorkerProc& prefill = stack.StartWorker("prefill", {"--max-num-batched-tokens", "64"});
  stack.SetWorkerEnv({});
  WorkerProc& decode = stack.StartWorker("decode");
  ASSERT_TRUE(stack.WaitReady());

  const nlohmann::json body = {{"prompt", Prompt("leave", 280)}, {"max_tokens", 4}};
  const HttpResult gone =
      HttpRequest(stack.http_port(), "POST", "/v1/completions", body.dump(), {}, 1500ms);
  EXPECT_EQ(gone.status, 0) << "answered before the client left: " << gone.body;

  ASSERT_TRUE(
      prefill.proc.WaitForLog(std::regex("prefill \\S+ cancelled by its decode worker"), 10s))
      << prefill.proc.Log();
  EXPECT_EQ(LocalStack::Metric(prefill.metrics_port, "pdserve_requests_total",
                               "kind=\"prefill\",outcome=\"cancelled\""),
            1);
  EXPECT_EQ(prefill.proc.Log().find("done:"), std::string::npos) << prefill.proc.Log();
  EXPECT_TRUE(WaitForMetric(decode.metrics_port, "pdserve_kv_cache_usage_ratio", "", 0, 10s));
  EXPECT_EQ(LocalStack::Metric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers"), 0);
}

// A job still computing at its deadline (the decode worker's
// --prefill-timeout-ms) is stopped and reported: the decode worker prefills
// it itself at once, and the link between the two stays up, so the next
// prompt is prefilled remotely as before.
TEST(AbandonedWorkTest, ALateJobFailsAloneAndTheLinkServesOn) {
  LocalStack stack("abandoned-late");
  stack.StartRouter({"--max-local-prefill", "32"});
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "1000"}});
  WorkerProc& prefill = stack.StartWorker("prefill", {"--max-num-batched-tokens", "64"});
  stack.SetWorkerEnv({});
  WorkerProc& decode = stack.StartWorker("decode", {"--prefill-timeout-ms", "2500"});
  ASSERT_TRUE(stack.WaitReady());

  // Five one-second chunks against a 2.5 s deadline.
  auto [late_status, late] =
      stack.Post("/v1/completions", {{"prompt", Prompt("late", 280)}, {"max_tokens", 2}});
  EXPECT_EQ(late_status, 200) << late.dump();
  EXPECT_EQ(late["usage"]["completion_tokens"], 2) << late.dump();
  ASSERT_TRUE(prefill.proc.WaitForLog(std::regex("its deadline passed"), 10s))
      << prefill.proc.Log();
  EXPECT_EQ(LocalStack::Metric(prefill.metrics_port, "pdserve_requests_total",
                               "kind=\"prefill\",outcome=\"failed\""),
            1);

  // One chunk: in time.
  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", Prompt("in time", 40)}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << body.dump();
  EXPECT_TRUE(prefill.proc.WaitForLog(std::regex("prefill \\S+ done: "), 10s))
      << prefill.proc.Log();
  ExpectKvMoved(prefill, decode);
  const std::string decode_log = decode.proc.Log();
  EXPECT_EQ(decode_log.find("prefill worker lost"), std::string::npos) << decode_log;
  EXPECT_NE(decode_log.find("remote prefill"), std::string::npos) << decode_log;
  EXPECT_EQ(prefill.proc.Log().find("closed locally"), std::string::npos) << prefill.proc.Log();
  EXPECT_TRUE(WaitForMetric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers", "", 0, 5s));
}

// A prefill worker whose write failed cannot say that none of its bytes
// land later (the kernel may still hold them): the decode worker prefills
// the request itself and keeps the blocks that write targeted out of use
// until its give-up time, instead of handing them to the next request when
// the failure report comes. The worker's test hook makes every write that
// landed report failure; a write that misses its deadline cannot be timed.
TEST(AbandonedWorkTest, BlocksAFailedWriteTargetedStayHeldUntilTheGiveUp) {
  LocalStack stack("abandoned-failed-write");
  auto [prefill, decode] = StartHandOffPair(stack, {{"PDSERVE_TEST_FAIL_KV_WRITES", "1"}},
                                            {"--prefill-timeout-ms", "5000"});
  ASSERT_TRUE(stack.WaitReady());
  ASSERT_NO_FATAL_FAILURE(ExpectAnsweredAsGenerate(stack, "failed write"));
  ASSERT_TRUE(prefill->proc.WaitForLog(std::regex("injected fault"), 10s)) << prefill->proc.Log();
  EXPECT_GT(HeldForPeersSoon(*decode, 100), 0) << decode->proc.Log();
  EXPECT_TRUE(decode->proc.WaitForLog(std::regex("its transfer deadline has passed"), 30s))
      << decode->proc.Log();
  EXPECT_TRUE(WaitForMetric(decode->metrics_port, "pdserve_kv_blocks_held_for_peers", "", 0, 5s));
}

// A Prefill delayed on a congested link past the decode worker's give-up
// (here by the prefill worker's test hook, which takes a decode worker's
// messages 14 s after they arrive) runs with a deadline from when it
// arrives, later than that give-up: its writes would land in blocks the
// decode worker had freed. The decode worker prefills the request itself
// at its give-up, as before, but keeps the blocks the peer was to write
// held until the peer's report comes, over the connection that stayed up.
TEST(AbandonedWorkTest, BlocksStayHeldUntilALatePrefillIsReported) {
  LocalStack stack("abandoned-late-arrival");
  // Given up on 3 s + the 7 s grace after it is sent; 3 s is the prefill
  // worker's time to compute it once it arrives.
  auto [prefill, decode] = StartHandOffPair(stack, {{"PDSERVE_TEST_DECODE_LINK_DELAY_MS", "14000"}},
                                            {"--prefill-timeout-ms", "3000"});
  ASSERT_TRUE(stack.WaitReady());
  ASSERT_NO_FATAL_FAILURE(ExpectAnsweredAsGenerate(stack, "late arrival"));
  // Answered after the give-up (about 10 s in), before the Prefill arrives
  // (14 s): the gauge shows the blocks held within its update period.
  EXPECT_GT(HeldForPeersSoon(*decode, 40), 0) << decode->proc.Log();
  EXPECT_EQ(prefill->proc.Log().find("done:"), std::string::npos) << prefill->proc.Log();
  ASSERT_TRUE(prefill->proc.WaitForLog(std::regex("prefill \\S+ done: [1-9]"), 20s))
      << prefill->proc.Log();
  EXPECT_TRUE(decode->proc.WaitForLog(std::regex("released: its prefill worker reported"), 10s))
      << decode->proc.Log();
  EXPECT_TRUE(WaitForMetric(decode->metrics_port, "pdserve_kv_blocks_held_for_peers", "", 0, 5s));
  EXPECT_EQ(decode->proc.Log().find("prefill worker lost"), std::string::npos)
      << decode->proc.Log();
}

// A peer that never reports a hand-off given up on (its link delays
// everything a minute) does not hold the blocks forever: a deadline and a
// grace after the give-up the decode worker closes its connection, which
// ends the peer's writes, and frees the blocks a grace later.
TEST(AbandonedWorkTest, APeerThatNeverReportsHasItsConnectionClosed) {
  LocalStack stack("abandoned-silent-peer");
  // Given up on at 8 s; the connection closed at 16 s; freed at 23 s.
  auto [prefill_ptr, decode_ptr] = StartHandOffPair(
      stack, {{"PDSERVE_TEST_DECODE_LINK_DELAY_MS", "60000"}}, {"--prefill-timeout-ms", "1000"});
  WorkerProc& prefill = *prefill_ptr;
  WorkerProc& decode = *decode_ptr;
  ASSERT_TRUE(stack.WaitReady());

  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", Prompt("silent", 120)}, {"max_tokens", 2}});
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex("never reported hand-offs given up on"), 15s))
      << decode.proc.Log();
  EXPECT_GT(LocalStack::Metric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers"), 0)
      << decode.proc.Log();
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex("released: its transfer deadline has passed"), 15s))
      << decode.proc.Log();
  EXPECT_TRUE(WaitForMetric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers", "", 0, 5s));
  EXPECT_EQ(prefill.proc.Log().find("done:"), std::string::npos) << prefill.proc.Log();
}

// A Prefill that waits past its deadline before the engine thread starts it
// (here behind a six-second step) is refused then, never started: its
// deadline runs from its arrival, as the decode worker's give-up does, so
// no write can reach blocks that worker has freed meanwhile.
TEST(AbandonedWorkTest, AJobWhoseDeadlinePassedBeforeItStartedIsRefused) {
  LocalStack stack("abandoned-unstarted");
  stack.StartRouter({"--max-local-prefill", "32"});
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "6000"}});
  WorkerProc& prefill = stack.StartWorker("prefill", {"--max-num-batched-tokens", "64"});
  stack.SetWorkerEnv({});
  stack.StartWorker("decode", {"--prefill-timeout-ms", "2000"});
  ASSERT_TRUE(stack.WaitReady());

  std::thread first([&] {
    auto [status, body] =
        stack.Post("/v1/completions", {{"prompt", Prompt("occupies", 120)}, {"max_tokens", 2}});
    EXPECT_EQ(status, 200) << body.dump();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", Prompt("waits", 60)}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << body.dump();
  first.join();
  EXPECT_TRUE(
      prefill.proc.WaitForLog(std::regex("refused: its deadline passed before it started"), 10s))
      << prefill.proc.Log();
}

}  // namespace
}  // namespace pdserve::testing
