// `pdserve bench serve` against a real stack: the numbers it prints agree
// with what the router counted, a random workload stays cold while a
// shared-prefix one is served mostly from the prefix cache, failures are
// reported (not hidden), and bad flags are one-line usage errors.
#include <gtest/gtest.h>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

nlohmann::json BenchServe(int port, std::vector<std::string> args, int* exit_code = nullptr,
                          std::string* err = nullptr) {
  std::vector<std::string> argv = {kPdserve, "bench", "serve",
                                   "--json", "--url", "http://127.0.0.1:" + std::to_string(port)};
  argv.insert(argv.end(), args.begin(), args.end());
  CommandResult r = RunCommand(argv);
  if (exit_code) *exit_code = r.exit_code;
  if (err) *err = r.err;
  return nlohmann::json::parse(r.out, nullptr, false);
}

TEST(BenchServeTest, RandomIsColdSharedPrefixIsWarmAndCountsMatchTheRouter) {
  LocalStack stack("bench-serve");
  stack.StartRouter();
  stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());

  int code = -1;
  std::string err;
  nlohmann::json cold =
      BenchServe(stack.http_port(),
                 {"--workload", "random", "--requests", "12", "--concurrency", "3", "--min-words",
                  "40", "--max-words", "80", "--max-tokens", "5"},
                 &code, &err);
  ASSERT_EQ(code, 0) << err;
  ASSERT_TRUE(cold.is_object()) << err;
  EXPECT_EQ(cold["ok"], 12);
  EXPECT_EQ(cold["failed"], 0);
  EXPECT_EQ(cold["completion_tokens"], 12 * 5);  // ignore_eos: every token asked for
  EXPECT_LT(cold["cached_fraction"].get<double>(), 0.1) << cold.dump();
  EXPECT_GT(cold["ttft_ms"]["p50"].get<double>(), 0);
  EXPECT_LE(cold["ttft_ms"]["p50"].get<double>(), cold["e2e_ms"]["p99"].get<double>());
  EXPECT_EQ(cold["settings"]["model"], "pdserve-tiny");
  EXPECT_TRUE(cold["machine"].contains("cores"));

  nlohmann::json warm = BenchServe(
      stack.http_port(),
      {"--workload", "shared-prefix", "--requests", "20", "--concurrency", "2", "--groups", "2",
       "--prefix-words", "120", "--suffix-words", "8", "--max-tokens", "3"},
      &code, &err);
  ASSERT_EQ(code, 0) << err;
  EXPECT_EQ(warm["ok"], 20);
  EXPECT_GT(warm["cached_fraction"].get<double>(), 0.6) << warm.dump();

  // Plain completions, for models without a chat template.
  nlohmann::json plain = BenchServe(
      stack.http_port(),
      {"--api", "completions", "--requests", "4", "--concurrency", "2", "--max-tokens", "3"}, &code,
      &err);
  ASSERT_EQ(code, 0) << err;
  EXPECT_EQ(plain["ok"], 4);
  EXPECT_EQ(plain["completion_tokens"], 4 * 3);
  EXPECT_EQ(plain["settings"]["api"], "completions");

  // What the tool saw is what the router counted.
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_requests_total", "status=\"ok\""),
            36);
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_prompt_tokens_total"),
            cold["prompt_tokens"].get<double>() + warm["prompt_tokens"].get<double>() +
                plain["prompt_tokens"].get<double>());
}

TEST(BenchServeTest, FailedRequestsAreReportedAndFailTheRun) {
  LocalStack stack("bench-serve-fail");
  stack.StartRouter();  // no worker: every request is refused with 503
  int code = -1;
  std::string err;
  nlohmann::json r =
      BenchServe(stack.http_port(), {"--requests", "4", "--concurrency", "2"}, &code, &err);
  EXPECT_EQ(code, 1);
  ASSERT_TRUE(r.is_object()) << err;
  EXPECT_EQ(r["ok"], 0);
  EXPECT_EQ(r["failed"], 4);
  EXPECT_NE(err.find("4 failed: HTTP 503"), std::string::npos) << err;
}

TEST(BenchServeTest, BadFlagsAreOneLineUsageErrors) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--workload", "bursty"},
           {"--workload", "trace"},
           {"--url", "ftp://x:1"},
           {"--url", "http://127.0.0.1:8000/v1"},
           {"--concurrency", "0"},
           {"--api", "soap"},
           {"--workload", "random", "--min-words", "10", "--max-words", "5"},
       }) {
    std::vector<std::string> argv = {kPdserve, "bench", "serve"};
    argv.insert(argv.end(), args.begin(), args.end());
    CommandResult r = RunCommand(argv);
    EXPECT_EQ(r.exit_code, 2) << args[0] << " " << args[1];
    EXPECT_EQ(r.err.rfind("pdserve bench serve: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace pdserve::testing
