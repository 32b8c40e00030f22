// One info line per request on every process it touches, each carrying the
// client's x-request-id: the router's line, the decode worker's (one for n
// sequences, their tokens summed) and the prefill worker's, so that an
// operator finds a request's lines on every process from one id.
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

size_t Count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(RequestLogTest, EveryProcessLogsARequestOnceUnderTheClientsId) {
  LocalStack stack("request-log");
  stack.StartRouter({"--max-local-prefill", "0"});  // every prompt prefills remotely
  WorkerProc& prefill = stack.StartWorker("prefill");
  WorkerProc& decode = stack.StartWorker("decode");
  ASSERT_TRUE(stack.WaitReady());

  std::string prompt = "the trace";
  for (int i = 0; i < 20; ++i) prompt += " of request " + std::to_string(i);
  const nlohmann::json body = {{"prompt", prompt},   {"max_tokens", 4}, {"ignore_eos", true},
                               {"temperature", 1.0}, {"seed", 7},       {"n", 3}};
  const HttpResult r = HttpRequest(stack.http_port(), "POST", "/v1/completions", body.dump(),
                                   {{"x-request-id", "trace-42"}});
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(nlohmann::json::parse(r.body)["choices"].size(), 3u);

  // The lines are written once the answer is sent: wait for the last.
  ASSERT_TRUE(prefill.proc.WaitForLog(std::regex("prefill trace-42 done"), 10s))
      << prefill.proc.Log();
  ASSERT_TRUE(decode.proc.WaitForLog(std::regex("request trace-42 done"), 10s))
      << decode.proc.Log();
  ASSERT_TRUE(stack.router().WaitForLog(std::regex("request trace-42 ok"), 10s))
      << stack.router().Log();
  std::this_thread::sleep_for(200ms);  // a second line, were there one, would be out by now

  const std::string router_log = stack.router().Log();
  const std::string decode_log = decode.proc.Log();
  const std::string prefill_log = prefill.proc.Log();
  EXPECT_EQ(Count(router_log, "request trace-42 "), 1u) << router_log;
  EXPECT_EQ(Count(prefill_log, "prefill trace-42 "), 1u) << prefill_log;
  EXPECT_EQ(Count(decode_log, "request trace-42 "), 1u) << decode_log;
  // The decode worker's line sums the three sequences: 3 x 4 tokens.
  EXPECT_NE(decode_log.find("request trace-42 done: n 3, prompt "), std::string::npos)
      << decode_log;
  EXPECT_NE(decode_log.find("completion 12, remote prefill, 3 length, 0 stop"), std::string::npos)
      << decode_log;

  // Without an id from the client, the router's own goes to the workers:
  // the id the router logged is the one the decode worker logs.
  const HttpResult plain =
      HttpRequest(stack.http_port(), "POST", "/v1/completions",
                  nlohmann::json{{"prompt", prompt + " again"}, {"max_tokens", 2}}.dump());
  ASSERT_EQ(plain.status, 200) << plain.body;
  const std::string rid =
      plain.headers.count("x-request-id") ? plain.headers.at("x-request-id") : std::string();
  ASSERT_FALSE(rid.empty());
  EXPECT_TRUE(decode.proc.WaitForLog(std::regex("request " + rid + " done"), 10s))
      << decode.proc.Log();
}

// A client that hangs up cancels every sequence of its request: the decode
// worker logs that once, not once per sequence.
TEST(RequestLogTest, ACancelledGroupIsOneLine) {
  LocalStack stack("request-log-cancel");
  stack.StartRouter();
  stack.SetWorkerEnv({{"PDSERVE_TEST_STEP_DELAY_MS", "30"}});
  WorkerProc& decode = stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  const nlohmann::json body = {{"prompt", "hang up"},
                               {"max_tokens", 200},
                               {"ignore_eos", true},
                               {"temperature", 1.0},
                               {"n", 3},
                               {"stream", true}};
  const HttpResult r = HttpStream(stack.http_port(), "/v1/completions", body.dump(),
                                  [](const std::string&) { return false; });  // hang up at once
  EXPECT_EQ(r.status, 200);
  ASSERT_TRUE(decode.proc.WaitForLog(std::regex("request \\S+ cancelled: "), 10s))
      << decode.proc.Log();
  std::this_thread::sleep_for(300ms);
  const std::string log = decode.proc.Log();
  EXPECT_EQ(Count(log, " cancelled: "), 1u) << log;
  EXPECT_NE(log.find("(n 3, 3 sequences running)"), std::string::npos) << log;
}

}  // namespace
}  // namespace pdserve::testing
