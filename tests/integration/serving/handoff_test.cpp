// Worker hand-off edge cases with real processes: a prefill worker whose KV
// layout differs from the decode worker's is refused with a clear error and
// the request is still answered correctly (local prefill); SIGTERM drains a
// decode worker: its running stream completes, new requests go elsewhere, it
// exits 0.
#include <signal.h>

#include <gtest/gtest.h>

#include <regex>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// Two KV dtypes that must never pair: fp16 against fp32, and nvfp4 against
// fp8 (a prefix cached in one type is never served to a worker of another:
// the hand-off is refused before a byte moves), also between workers of
// different tensor-parallel sizes, whose shards otherwise move head range by
// head range (fp8 included: tensor_parallel_serving_test).
struct Mismatch {
  const char* name;
  const char* prefill_dtype;
  const char* decode_dtype;
  const char* prefill_tp = "1";
  const char* decode_tp = "1";
};

class HandoffLayoutTest : public ::testing::TestWithParam<Mismatch> {};

TEST_P(HandoffLayoutTest, MismatchIsRefusedClearlyAndServedCorrectlyByLocalPrefill) {
  const Mismatch m = GetParam();
  LocalStack stack(std::string("handoff-layout-") + m.name);
  stack.StartRouter({"--max-local-prefill", "0"});
  WorkerProc& prefill = stack.StartWorker(
      "prefill", {"--kv-dtype", m.prefill_dtype, "--tensor-parallel", m.prefill_tp});
  // A short transfer deadline bounds how long the decode worker may hold
  // blocks for a peer whose report is late (a loaded machine); a block held
  // past it would be a leak.
  WorkerProc& decode =
      stack.StartWorker("decode", {"--kv-dtype", m.decode_dtype, "--tensor-parallel", m.decode_tp,
                                   "--prefill-timeout-ms", "5000"});
  ASSERT_TRUE(stack.WaitReady());

  const std::string prompt = "the layouts of these two workers do not agree";
  nlohmann::json want = Generate(prompt, 6, LocalStack::Model(), {"--kv-dtype", m.decode_dtype});
  ASSERT_TRUE(want.is_object());
  auto [status, got] =
      stack.Post("/v1/completions",
                 {{"prompt", prompt}, {"max_tokens", 6}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(status, 200) << got.dump();
  EXPECT_EQ(got["choices"][0]["text"], want["text"]);  // the decode worker's own KV type

  const std::regex refused(std::string("KV layout mismatch: kv_dtype: ") + m.prefill_dtype +
                           " here, " + m.decode_dtype + " on peer");
  EXPECT_TRUE(prefill.proc.WaitForLog(refused, 10s)) << prefill.proc.Log();
  EXPECT_TRUE(decode.proc.WaitForLog(refused, 10s)) << decode.proc.Log();
  EXPECT_TRUE(
      decode.proc.WaitForLog(std::regex(R"(request [0-9a-f]{32} done: .*local prefill)"), 10s))
      << decode.proc.Log();
  // Nothing was written into the decode pool by the refused peer.
  EXPECT_EQ(LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total"), 0);
  EXPECT_EQ(LocalStack::Metric(prefill.metrics_port, "pdserve_kv_transfer_bytes_total"), 0);
  // The local prefill after the failed remote attempt is the decode worker's
  // own prefill computation: every prompt token was looked up.
  EXPECT_EQ(LocalStack::Metric(decode.metrics_port, "pdserve_prefix_cache_queries_tokens_total"),
            want["prompt_token_ids"].size());
  // No block stays reserved for the refused peer: released when its report
  // comes, at the latest at the transfer deadline.
  double held = -1;
  for (int i = 0; i < 400 && held != 0; ++i) {
    held = LocalStack::Metric(decode.metrics_port, "pdserve_kv_blocks_held_for_peers");
    if (held != 0) std::this_thread::sleep_for(100ms);
  }
  EXPECT_EQ(held, 0);
}

INSTANTIATE_TEST_SUITE_P(KvDtypes, HandoffLayoutTest,
                         ::testing::Values(Mismatch{"fp16_fp32", "fp16", "fp32"},
                                           Mismatch{"nvfp4_fp8", "nvfp4", "fp8"},
                                           Mismatch{"fp16_tp2_fp32_tp1", "fp16", "fp32", "2", "1"},
                                           Mismatch{"nvfp4_tp2_fp8_tp1", "nvfp4", "fp8", "2", "1"}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(HandoffTest, SigtermDrainsTheRunningStreamAndExitsZero) {
  LocalStack stack("handoff-drain");
  stack.StartRouter();
  WorkerProc& first = stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());

  // A long stream on the only worker; a second worker joins, then the first
  // is told to stop while its stream is running.
  const int max_tokens = 3000;
  const nlohmann::json req = {{"prompt", "drain me gently"},
                              {"max_tokens", max_tokens},
                              {"temperature", 0},
                              {"ignore_eos", true},
                              {"stream", true},
                              {"stream_options", {{"include_usage", true}}}};
  bool signalled = false;
  std::string events;
  HttpResult r =
      HttpStream(stack.http_port(), "/v1/completions", req.dump(), [&](const std::string& data) {
        events += data;
        if (!signalled) {
          stack.StartWorker("both");
          first.proc.Signal(SIGTERM);
          signalled = true;
        }
        return true;
      });
  ASSERT_EQ(r.status, 200);
  ASSERT_TRUE(signalled);
  EXPECT_NE(events.find("\"completion_tokens\":" + std::to_string(max_tokens)), std::string::npos)
      << events.substr(events.size() > 2000 ? events.size() - 2000 : 0);
  EXPECT_NE(events.find("data: [DONE]"), std::string::npos);

  auto code = first.proc.Wait(60s);
  ASSERT_TRUE(code) << first.proc.Log();
  EXPECT_EQ(*code, 0) << first.proc.Log();
  EXPECT_TRUE(std::regex_search(first.proc.Log(), std::regex("signal 15, draining")));
  EXPECT_TRUE(std::regex_search(stack.router().Log(), std::regex("worker both0 is draining")))
      << stack.router().Log();

  // New work lands on the remaining worker.
  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", "after the drain"}, {"max_tokens", 4}});
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_TRUE(stack.router().WaitForLog(std::regex(R"(ok: .*decode both1)"), 10s))
      << stack.router().Log();
}

TEST(HandoffTest, DecodeWorkerKilledMidStreamEndsTheStreamWithAnErrorEvent) {
  LocalStack stack("handoff-killed-mid-stream");
  stack.StartRouter();
  WorkerProc& worker = stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  const nlohmann::json req = {{"prompt", "this stream will be cut"},
                              {"max_tokens", 3000},
                              {"temperature", 0},
                              {"ignore_eos", true},
                              {"stream", true}};
  bool killed = false;
  std::string events;
  HttpResult r =
      HttpStream(stack.http_port(), "/v1/completions", req.dump(), [&](const std::string& data) {
        events += data;
        if (!killed) {
          worker.proc.Signal(SIGKILL);
          (void)worker.proc.Wait(std::chrono::seconds(10));  // really gone before reading on
          killed = true;
        }
        return true;
      });
  // Tokens were already sent: no retry, but an error event and a clean end.
  ASSERT_EQ(r.status, 200);
  EXPECT_NE(events.find("\"text\""), std::string::npos) << events;
  EXPECT_NE(events.find("data: {\"error\":"), std::string::npos) << events;
  EXPECT_NE(events.find("during generation"), std::string::npos) << events;
  EXPECT_EQ(events.rfind("data: [DONE]\n\n"), events.size() - 14) << events;
  // Counted as an error once the router has finished its bookkeeping, which
  // may trail the last bytes the client read.
  double errors = 0;
  for (int i = 0; i < 200 && errors < 1; ++i) {
    errors =
        LocalStack::Metric(stack.http_port(), "pdserve_router_requests_total", "status=\"error\"");
    if (errors < 1) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  EXPECT_EQ(errors, 1);
  // The router keeps serving: a new worker takes new requests.
  stack.StartWorker("both");
  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", "still here"}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << body.dump();
}

TEST(HandoffTest, WorkerHealthFollowsItsRouterLink) {
  LocalStack stack("handoff-health");
  stack.StartRouter();
  WorkerProc& worker = stack.StartWorker("both");
  ASSERT_TRUE(WaitForHttpStatus(worker.metrics_port, "/health", 200, std::chrono::seconds(10)));
  // No router: the worker is alive but not serving; its probe says so.
  const int control_port = stack.control_port();
  stack.router().Signal(SIGKILL);
  ASSERT_TRUE(stack.router().Wait(std::chrono::seconds(10)));
  ASSERT_TRUE(WaitForHttpStatus(worker.metrics_port, "/health", 503, std::chrono::seconds(30)));
  EXPECT_NE(HttpRequest(worker.metrics_port, "GET", "/health").body.find("no router connection"),
            std::string::npos);
  // Live all the while: a liveness probe must not restart every worker
  // because their router went away.
  EXPECT_EQ(HttpRequest(worker.metrics_port, "GET", "/live").status, 200);
  // A router on the same address again: the worker reconnects and is healthy.
  stack.StartRouter({}, control_port);
  EXPECT_TRUE(WaitForHttpStatus(worker.metrics_port, "/health", 200, std::chrono::seconds(30)));
}

}  // namespace
}  // namespace pdserve::testing
