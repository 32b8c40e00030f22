// The router's KV-aware routing and failure handling with real workers:
// prefix groups stay on warm workers (and round robin, the contrast, loses
// those hits), the router's predicted hits match what the workers report,
// cache_salt keeps tenants apart, a frozen worker is detected and its request
// retried elsewhere, and a restarted router rebuilds its index from the
// workers' resync.
#include <signal.h>

#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// A prompt of `group`'s shared prefix (about 150 tokens) and a unique tail.
std::string GroupPrompt(int group, int request) {
  std::string s = "group " + std::to_string(group) + ":";
  for (int i = 0; i < 60; ++i) s += " w" + std::to_string((group * 31 + i * 7) % 97);
  s += " | request " + std::to_string(request) + ":";
  for (int i = 0; i < 8; ++i) s += " t" + std::to_string((request * 13 + i) % 89);
  return s;
}

struct Totals {
  int64_t prompt = 0, cached = 0;
  double share() const { return prompt ? static_cast<double>(cached) / prompt : 0; }
};

// Six prefix groups, three requests each, one at a time, interleaved so that
// consecutive requests rarely share a group.
Totals RunGroups(LocalStack& stack) {
  Totals t;
  for (int round = 0; round < 3; ++round) {
    for (int g = 0; g < 6; ++g) {
      const int group = (g * 5 + round) % 6;
      auto [status, body] = stack.Post(
          "/v1/completions",
          {{"prompt", GroupPrompt(group, round)}, {"max_tokens", 2}, {"temperature", 0}});
      EXPECT_EQ(status, 200) << body.dump() << "\n" << stack.router().Log();
      if (status != 200) continue;
      t.prompt += body["usage"]["prompt_tokens"].get<int64_t>();
      t.cached += body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
    }
  }
  return t;
}

TEST(RoutingTest, KvPolicyKeepsPrefixGroupsWarmAndPredictsItsHits) {
  Totals kv, round_robin;
  double predicted = 0, prompt_counter = 0;
  {
    LocalStack stack("routing-kv");
    stack.StartRouter({"--policy", "kv", "--policy-temperature", "0"});
    stack.StartWorker("both");
    stack.StartWorker("both");
    ASSERT_TRUE(stack.WaitReady());
    kv = RunGroups(stack);
    predicted = LocalStack::Metric(stack.http_port(), "pdserve_router_predicted_hit_tokens_total");
    prompt_counter = LocalStack::Metric(stack.http_port(), "pdserve_router_prompt_tokens_total");
  }
  {
    LocalStack stack("routing-rr");
    stack.StartRouter({"--policy", "round_robin"});
    stack.StartWorker("both");
    stack.StartWorker("both");
    ASSERT_TRUE(stack.WaitReady());
    round_robin = RunGroups(stack);
  }
  // 18 requests, 6 of them the first of their group: with every group on
  // one worker, 12 find their ~150-token prefix cached.
  EXPECT_GT(kv.share(), 0.55) << kv.cached << "/" << kv.prompt;
  EXPECT_LT(round_robin.share(), kv.share() - 0.15)
      << "round robin " << round_robin.share() << ", kv " << kv.share();
  // The router's prediction is what the workers then found, block for block.
  EXPECT_EQ(prompt_counter, static_cast<double>(kv.prompt));
  EXPECT_EQ(predicted, static_cast<double>(kv.cached));
}

TEST(RoutingTest, CacheSaltKeepsTenantsApart) {
  LocalStack stack("routing-salt");
  stack.StartRouter();
  stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  auto cached = [&](const std::string& salt) {
    nlohmann::json req = {{"prompt", GroupPrompt(1, 1)}, {"max_tokens", 1}, {"temperature", 0}};
    if (!salt.empty()) req["cache_salt"] = salt;
    auto [status, body] = stack.Post("/v1/completions", req);
    EXPECT_EQ(status, 200) << body.dump();
    return status == 200 ? body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>()
                         : -1;
  };
  EXPECT_EQ(cached("tenant-a"), 0);
  EXPECT_GT(cached("tenant-a"), 100);  // same tenant: the prefix is reused
  EXPECT_EQ(cached("tenant-b"), 0);    // another tenant never sees it
  EXPECT_EQ(cached(""), 0);            // nor does unsalted traffic
  EXPECT_GT(cached(""), 100);
}

// True once /proc says the process is stopped (state T).
bool WaitUntilStopped(pid_t pid) {
  for (int i = 0; i < 400; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    // "pid (comm) S ...": the state follows the last ')'.
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T')
      return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

TEST(RoutingTest, FrozenWorkerIsDetectedAndItsRequestRetriedElsewhere) {
  LocalStack stack("routing-frozen");
  stack.StartRouter({"--policy", "kv", "--policy-temperature", "0"});
  stack.StartWorker("both");
  stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  const nlohmann::json req = {
      {"prompt", GroupPrompt(2, 0)}, {"max_tokens", 8}, {"temperature", 0}, {"ignore_eos", true}};
  HttpResult first = HttpRequest(stack.http_port(), "POST", "/v1/completions", req.dump(),
                                 {{"x-request-id", "warm"}});
  ASSERT_EQ(first.status, 200) << first.body;
  auto served_by =
      stack.router().WaitForLog(std::regex(R"(request warm ok: .*decode (both\d))"), 10s);
  ASSERT_TRUE(served_by) << stack.router().Log();

  // The warm worker stops answering (SIGSTOP: no TCP reset, only silence);
  // the same prompt is routed to it for its cache, and the router must find
  // out by heartbeat and send the request to the other worker.
  WorkerProc* warm = nullptr;
  for (auto& w : stack.workers())
    if (w->id == *served_by) warm = w.get();
  ASSERT_NE(warm, nullptr);
  warm->proc.Signal(SIGSTOP);
  // kill() returns before the process has stopped: wait until it has.
  ASSERT_TRUE(WaitUntilStopped(warm->proc.pid()));
  HttpResult again = HttpRequest(stack.http_port(), "POST", "/v1/completions", req.dump(),
                                 {{"x-request-id", "retried"}}, 60s);
  warm->proc.Signal(SIGCONT);
  ASSERT_EQ(again.status, 200) << again.body;
  auto a = nlohmann::json::parse(first.body), b = nlohmann::json::parse(again.body);
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);  // greedy: same answer
  // The request's log line is written after its response went out: wait for it.
  EXPECT_TRUE(stack.router().WaitForLog(std::regex(R"(request retried ok: .*attempts 2)"), 10s))
      << stack.router().Log();
  const std::string log = stack.router().Log();
  EXPECT_TRUE(std::regex_search(log, std::regex("worker " + *served_by + " disconnected"))) << log;
  EXPECT_TRUE(
      std::regex_search(log, std::regex(R"(request retried: .*before the first token; retrying)")))
      << log;
  // Resumed, the worker reconnects and syncs a second time.
  const std::string synced = "worker " + *served_by + " synced";
  auto count_synced = [&] {
    const std::string now = stack.router().Log();
    int n = 0;
    for (size_t at = now.find(synced); at != std::string::npos; at = now.find(synced, at + 1)) ++n;
    return n;
  };
  for (int i = 0; i < 600 && count_synced() < 2; ++i) std::this_thread::sleep_for(50ms);
  EXPECT_EQ(count_synced(), 2) << stack.router().Log() << "\n--- worker:\n" << warm->proc.Log();
}

// The router's indexed block count, once its periodic gauge update has seen
// the worker's events (0 if that never happens).
double IndexedBlocks(int port) {
  for (int i = 0; i < 100; ++i) {
    const double n = LocalStack::Metric(port, "pdserve_router_index_blocks");
    if (n > 0) return n;
    std::this_thread::sleep_for(50ms);
  }
  return 0;
}

TEST(RoutingTest, RestartedRouterRebuildsItsIndexFromWorkerResync) {
  LocalStack stack("routing-restart");
  stack.StartRouter({"--policy", "kv", "--policy-temperature", "0"});
  stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  const nlohmann::json req = {{"prompt", GroupPrompt(3, 0)}, {"max_tokens", 2}, {"temperature", 0}};
  auto [status, body] = stack.Post("/v1/completions", req);
  ASSERT_EQ(status, 200) << body.dump();
  const double indexed_before = IndexedBlocks(stack.http_port());
  ASSERT_GT(indexed_before, 0);

  stack.RestartRouter({"--policy", "kv", "--policy-temperature", "0"});
  // The worker reconnects on its own and reports the blocks it still holds.
  auto synced =
      stack.router().WaitForLog(std::regex(R"(worker both0 synced: (\d+) cached blocks)"), 60s);
  ASSERT_TRUE(synced) << stack.router().Log();
  EXPECT_GE(std::stoi(*synced), 9) << "the ~150-token prompt fills 9+ blocks";
  ASSERT_TRUE(stack.WaitReady());
  // The rebuilt index is the one the old router had.
  EXPECT_EQ(std::stoi(*synced), indexed_before);
  EXPECT_EQ(IndexedBlocks(stack.http_port()), indexed_before);

  auto [status2, body2] = stack.Post("/v1/completions", req);
  ASSERT_EQ(status2, 200) << body2.dump();
  const int64_t cached = body2["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  EXPECT_GE(cached, 144);
  // A fresh router knows of these hits only through the resync.
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_predicted_hit_tokens_total"),
            static_cast<double>(cached));
}

TEST(RoutingTest, ExplicitModelIdKeepsRouterAndWorkerHashesInStep) {
  // Block hashes are seeded with the served model id: a renamed model must be
  // hashed with the new name on both sides, or the index never matches.
  LocalStack stack("routing-model-id");
  stack.StartRouter({"--model-id", "team/renamed-model"});
  stack.StartWorker("both", {"--model-id", "team/renamed-model"});
  ASSERT_TRUE(stack.WaitReady());
  const nlohmann::json req = {{"model", "team/renamed-model"},
                              {"prompt", GroupPrompt(4, 0)},
                              {"max_tokens", 1},
                              {"temperature", 0}};
  ASSERT_EQ(stack.Post("/v1/completions", req).first, 200);
  // A fresh router: its index holds only what the worker reports (no
  // pending entries of its own routing), so a seed mismatch would show.
  stack.RestartRouter({"--model-id", "team/renamed-model"});
  ASSERT_TRUE(stack.router().WaitForLog(std::regex(R"(worker both0 synced)"), 60s));
  ASSERT_TRUE(stack.WaitReady());
  auto [status, body] = stack.Post("/v1/completions", req);
  ASSERT_EQ(status, 200) << body.dump();
  const int64_t cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
  EXPECT_GE(cached, 144);
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_predicted_hit_tokens_total"),
            static_cast<double>(cached));
}

TEST(RoutingTest, NoDecodeWorkerIsCountedAsUnavailableNotAsAnError) {
  LocalStack stack("routing-unavailable");
  stack.StartRouter();
  HttpResult r = HttpRequest(stack.http_port(), "POST", "/v1/completions",
                             R"({"prompt": "anyone there?", "max_tokens": 2})");
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_EQ(r.headers["retry-after"], "1");
  EXPECT_NE(r.body.find("no decode worker"), std::string::npos) << r.body;
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_requests_total",
                               "status=\"unavailable\""),
            1);
  EXPECT_EQ(
      LocalStack::Metric(stack.http_port(), "pdserve_router_requests_total", "status=\"error\""),
      0);
}

}  // namespace
}  // namespace pdserve::testing
