// Scale-down that keeps the cache warm: SIGTERM to one of three workers
// (role both, or decode: a decode-only worker writes its pushes as prefix
// copies) in the middle of a load. No request fails, and with the
// router's --drain-push-blocks the leaving worker's hot prompt is a cache
// hit on a survivor afterwards; without it, that prompt is computed again.
#include <signal.h>

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <regex>
#include <thread>

#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

std::string Words(int n, int salt) {
  static const char* kWords[] = {"alpha", "bravo",   "charlie", "delta",
                                 "echo",  "foxtrot", "golf",    "hotel"};
  std::string s;
  for (int i = 0; i < n; ++i) {
    s += std::string(i ? " " : "") + kWords[(i * 5 + salt) % 8] + std::to_string((i + salt) % 11);
  }
  return s;
}

// Runs the scenario; returns the cached tokens of the hot prompt's next
// request after its holder left, and its prefix's token count.
std::pair<int64_t, int64_t> DrainOneOfThree(const std::vector<std::string>& router_flags,
                                            const std::string& role = "both") {
  LocalStack stack("drain");
  stack.StartRouter(router_flags);
  for (int i = 0; i < 3; ++i) stack.StartWorker(role);
  EXPECT_TRUE(stack.WaitReady());

  // The hot prompt, used three times: its worker is the one to leave.
  const std::string hot = Words(150, 1);
  auto decode_requests = [&](size_t k) {
    return LocalStack::Metric(stack.workers()[k]->metrics_port, "pdserve_requests_total", "decode");
  };
  std::vector<double> before;
  for (size_t k = 0; k < 3; ++k) before.push_back(decode_requests(k));
  int64_t prefix_tokens = 0;
  for (int i = 0; i < 3; ++i) {
    auto [status, body] = stack.Post(
        "/v1/completions",
        {{"prompt", hot + " turn " + Words(4, i)}, {"max_tokens", 2}, {"temperature", 0}});
    EXPECT_EQ(status, 200) << body.dump();
    if (i > 0) prefix_tokens = body["usage"]["prompt_tokens_details"]["cached_tokens"];
  }
  // A worker counts a request just after it answered: wait for all three.
  auto served = [&] {
    double n = 0;
    for (size_t k = 0; k < 3; ++k) n += decode_requests(k) - before[k];
    return n;
  };
  for (int i = 0; i < 100 && served() < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  size_t holder = 0;
  for (size_t k = 0; k < 3; ++k) {
    if (decode_requests(k) - before[k] == 3) holder = k;
  }
  EXPECT_EQ(decode_requests(holder) - before[holder], 3) << "the hot prompt moved between workers";
  EXPECT_GT(prefix_tokens, 100);

  // Load: 9 requests in flight, three of them on the holder (the hot
  // prompt), then SIGTERM to the holder.
  std::vector<std::pair<int, nlohmann::json>> results(9);
  std::vector<std::thread> clients;
  for (int i = 0; i < 9; ++i) {
    clients.emplace_back([&, i] {
      const std::string prompt =
          i % 3 == 0 ? hot + " load " + Words(4, i) : Words(60, 10 + i) + " cold";
      results[i] = stack.Post(
          "/v1/completions",
          {{"prompt", prompt}, {"max_tokens", 24}, {"temperature", 0}, {"ignore_eos", true}});
    });
  }
  // SIGTERM once the hot prompt's three requests run on the holder (so that
  // no survivor computes it meanwhile, which would warm it without a push).
  WorkerProc& leaving = *stack.workers()[holder];
  for (int i = 0; i < 300; ++i) {
    if (LocalStack::Metric(leaving.metrics_port, "pdserve_requests_running") >= 3) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  leaving.proc.Signal(SIGTERM);
  for (auto& t : clients) t.join();
  for (int i = 0; i < 9; ++i) {
    EXPECT_EQ(results[i].first, 200) << i << ": " << results[i].second.dump() << "\n"
                                     << stack.router().Log();
  }
  EXPECT_TRUE(leaving.proc.Wait(std::chrono::seconds(30))) << leaving.proc.Log();
  EXPECT_TRUE(stack.router().WaitForLog(std::regex("worker " + leaving.id + " disconnected"),
                                        std::chrono::seconds(10)));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // survivors' KV events

  // The hot prompt again, now on a survivor.
  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", hot + " after " + Words(4, 7)}, {"max_tokens", 2}});
  EXPECT_EQ(status, 200) << body.dump();
  const int64_t cached = body["usage"]["prompt_tokens_details"]["cached_tokens"];
  // No survivor keeps a block for a finished request.
  for (int i = 0; i < 200; ++i) {
    double usage = 0;
    for (size_t k = 0; k < 3; ++k) {
      if (k != holder) {
        usage +=
            LocalStack::Metric(stack.workers()[k]->metrics_port, "pdserve_kv_cache_usage_ratio");
      }
    }
    if (usage == 0) break;
    EXPECT_LT(i, 199) << "blocks leaked on a survivor";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (std::find(router_flags.begin(), router_flags.end(), "--drain-push-blocks") !=
      router_flags.end()) {
    EXPECT_GE(LocalStack::Metric(stack.http_port(), "pdserve_router_replications_total", "started"),
              1)
        << stack.router().Log();
    EXPECT_TRUE(std::regex_search(stack.router().Log(),
                                  std::regex("worker " + leaving.id + " drains: [1-9]")))
        << stack.router().Log();
    // The survivors received the blocks over the transfer path (a copy, not
    // a recompute).
    double received = 0;
    for (size_t k = 0; k < 3; ++k) {
      if (k != holder) {
        received += LocalStack::Metric(stack.workers()[k]->metrics_port,
                                       "pdserve_kv_transfer_bytes_total", "direction=\"in\"");
      }
    }
    EXPECT_GT(received, 0);
  }
  return {cached, prefix_tokens};
}

TEST(DrainTest, SigtermMidLoadFailsNothingAndTheHotPromptStaysWarm) {
  const auto [cached, prefix] = DrainOneOfThree({"--drain-push-blocks", "1000"});
  // The earlier turns shared " turn" too: up to one block more than this one can.
  EXPECT_GE(cached, prefix - 16) << "the hot prompt was not pushed to the survivor it went to";
}

TEST(DrainTest, ADecodeOnlyWorkerPushesItsHotPromptToo) {
  const auto [cached, prefix] = DrainOneOfThree({"--drain-push-blocks", "1000"}, "decode");
  EXPECT_GE(cached, prefix - 16) << "the hot prompt was not pushed to the survivor it went to";
}

TEST(DrainTest, WithoutPushTheHotPromptIsComputedAgain) {
  const auto [cached, prefix] = DrainOneOfThree({});
  EXPECT_LT(cached, prefix / 2);
}

// The operator's call: POST /admin/drain stops routing to a worker and
// pushes its hot prompt, while the worker keeps running.
TEST(DrainTest, AdminDrainPushesTheHotPromptAndStopsRoutingThere) {
  const std::string key_file = ::testing::TempDir() + "drain_admin_keys";
  std::ofstream(key_file) << "admin-secret-key\n";
  LocalStack stack("drain-admin");
  stack.StartRouter({"--drain-push-blocks", "1000", "--admin-key-file", key_file});
  for (int i = 0; i < 3; ++i) stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  const std::string hot = Words(150, 1);
  auto decode_requests = [&](size_t k) {
    return LocalStack::Metric(stack.workers()[k]->metrics_port, "pdserve_requests_total", "decode");
  };
  int64_t prefix = 0;
  for (int i = 0; i < 3; ++i) {
    auto [status, body] = stack.Post(
        "/v1/completions",
        {{"prompt", hot + " turn " + Words(4, i)}, {"max_tokens", 2}, {"temperature", 0}});
    ASSERT_EQ(status, 200) << body.dump();
    if (i > 0) prefix = body["usage"]["prompt_tokens_details"]["cached_tokens"];
  }
  size_t holder = 3;
  for (int i = 0; i < 100 && holder == 3; ++i) {
    for (size_t k = 0; k < 3; ++k) {
      if (decode_requests(k) == 3) holder = k;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_LT(holder, 3u) << "the hot prompt moved between workers";
  const std::string name = stack.workers()[holder]->id;
  const std::string drain = nlohmann::json{{"worker", name}}.dump();
  const std::map<std::string, std::string> auth = {{"Authorization", "Bearer admin-secret-key"}};
  EXPECT_EQ(HttpRequest(stack.http_port(), "POST", "/admin/drain", drain).status, 401);
  EXPECT_EQ(HttpRequest(stack.http_port(), "POST", "/admin/drain",
                        nlohmann::json{{"worker", "nobody"}}.dump(), auth)
                .status,
            404);
  EXPECT_EQ(HttpRequest(stack.http_port(), "POST", "/admin/drain", "{", auth).status, 400);
  const HttpResult r = HttpRequest(stack.http_port(), "POST", "/admin/drain", drain, auth);
  ASSERT_EQ(r.status, 200) << r.body;
  const auto answer = nlohmann::json::parse(r.body);
  EXPECT_GE(answer["pushed_prompts"].get<int64_t>(), 1) << r.body;
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // pushes land, events arrive

  auto [status, body] =
      stack.Post("/v1/completions", {{"prompt", hot + " after " + Words(4, 7)}, {"max_tokens", 2}});
  ASSERT_EQ(status, 200) << body.dump();
  EXPECT_GE(body["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>(), prefix - 16);
  EXPECT_EQ(decode_requests(holder), 3) << "a drained worker got a new request";
  EXPECT_TRUE(stack.workers()[holder]->proc.running());
  // Shown as draining, not as a worker whose index is syncing.
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_workers", "state=\"draining\""),
            1);
  EXPECT_EQ(LocalStack::Metric(stack.http_port(), "pdserve_router_workers", "state=\"syncing\""),
            0);
}

// POST /admin/undrain puts a drained worker back without a restart; a
// worker that is shutting down itself cannot be put back.
TEST(DrainTest, AdminUndrainPutsADrainedWorkerBack) {
  const std::string key_file = ::testing::TempDir() + "undrain_admin_keys";
  std::ofstream(key_file) << "admin-secret-key\n";
  LocalStack stack("undrain-admin");
  stack.StartRouter({"--admin-key-file", key_file});
  WorkerProc& a = stack.StartWorker("both");
  WorkerProc& b = stack.StartWorker("both");
  ASSERT_TRUE(stack.WaitReady());
  const std::map<std::string, std::string> auth = {{"Authorization", "Bearer admin-secret-key"}};
  auto admin = [&](const std::string& path, const std::string& worker,
                   const std::map<std::string, std::string>& headers) {
    return HttpRequest(stack.http_port(), "POST", path, nlohmann::json{{"worker", worker}}.dump(),
                       headers);
  };
  auto served = [&](WorkerProc& w) {
    return LocalStack::Metric(w.metrics_port, "pdserve_requests_total", "decode");
  };
  // Waits until `w` counted `n` decode requests (it counts just after answering).
  auto wait_served = [&](WorkerProc& w, double n) {
    for (int i = 0; i < 200 && served(w) < n; ++i) std::this_thread::sleep_for(20ms);
    return served(w);
  };
  auto complete = [&](const std::string& prompt) {
    auto [status, body] = stack.Post("/v1/completions", {{"prompt", prompt}, {"max_tokens", 2}});
    EXPECT_EQ(status, 200) << body.dump();
  };

  EXPECT_EQ(admin("/admin/undrain", a.id, {}).status, 401);
  EXPECT_EQ(admin("/admin/undrain", "nobody", auth).status, 404);
  EXPECT_EQ(HttpRequest(stack.http_port(), "POST", "/admin/undrain", "[]", auth).status, 400);

  // Drained, `a` gets nothing; undrained, it serves again once `b` is drained.
  ASSERT_EQ(admin("/admin/drain", a.id, auth).status, 200);
  for (int i = 0; i < 4; ++i) complete("while a is drained " + std::to_string(i));
  EXPECT_EQ(wait_served(b, 4), 4);
  EXPECT_EQ(served(a), 0);
  const HttpResult undrained = admin("/admin/undrain", a.id, auth);
  ASSERT_EQ(undrained.status, 200) << undrained.body;
  EXPECT_EQ(nlohmann::json::parse(undrained.body)["draining"], false) << undrained.body;
  // Its index is rebuilt from a fresh snapshot: a second "synced" line.
  EXPECT_TRUE(stack.router().WaitForLog(
      std::regex("worker " + a.id + " synced[^\\n]*\\n[\\s\\S]*worker " + a.id + " synced"), 10s))
      << stack.router().Log();
  ASSERT_EQ(admin("/admin/drain", b.id, auth).status, 200);
  complete("after a came back");
  EXPECT_EQ(wait_served(a, 1), 1);
  EXPECT_EQ(served(b), 4);
  // Every worker drained: the router takes nothing, and is not ready.
  EXPECT_EQ(HttpRequest(stack.http_port(), "GET", "/ready").status, 200);
  ASSERT_EQ(admin("/admin/drain", a.id, auth).status, 200);
  const HttpResult unready = HttpRequest(stack.http_port(), "GET", "/ready");
  EXPECT_EQ(unready.status, 503) << unready.body;
  EXPECT_EQ(nlohmann::json::parse(unready.body)["decode_workers"], 0) << unready.body;
  ASSERT_EQ(admin("/admin/undrain", a.id, auth).status, 200);
  EXPECT_TRUE(stack.WaitReady());
  // Undraining a worker that is not drained changes nothing.
  EXPECT_EQ(admin("/admin/undrain", a.id, auth).status, 200);

  // `a` shuts down (SIGTERM) while a stream runs on it: it stays connected
  // while it drains, and cannot be put back.
  bool checked = false;
  HttpStream(
      stack.http_port(), "/v1/completions",
      nlohmann::json{
          {"prompt", "a long stream"}, {"max_tokens", 3000}, {"ignore_eos", true}, {"stream", true}}
          .dump(),
      [&](const std::string&) {
        if (checked) return false;
        a.proc.Signal(SIGTERM);
        EXPECT_TRUE(stack.router().WaitForLog(std::regex("worker " + a.id + " is draining"), 10s));
        const HttpResult r = admin("/admin/undrain", a.id, auth);
        EXPECT_EQ(r.status, 409) << r.body;
        checked = true;
        return false;  // hang up: the worker then leaves
      });
  EXPECT_TRUE(checked);
  EXPECT_TRUE(a.proc.Wait(30s)) << a.proc.Log();
}

}  // namespace
}  // namespace pdserve::testing
