// Chaos under load, with real processes: a router, one prefill and two decode
// workers on loopback (the prefill worker in a network namespace of its own
// where the network is cut), the router with a low
// --max-local-prefill so that long prompts are prefilled remotely. Four
// clients send greedy completions, every other one streamed, over prompts
// that share long prefixes (remote prefill and prefix hits both happen), a
// third of them with a fresh cache_salt (nothing cached: prefilled whole).
// Each case injects one fault while requests are in flight: SIGKILL of each
// role (the router then restarted on the same control port), SIGSTOP of each
// role for longer than the control plane's peer timeout, a 20 s partition of
// the prefill worker, and (where the kernel has sch_netem) a delayed link;
// one more case kills a request's prefill worker, then its decode worker.
// Then, for every case:
//   - every request ended within kBound: a whole answer, an OpenAI-style error
//     body or an SSE error event; never a hang, never a malformed answer; a
//     lost connection only from a router that was itself killed;
//   - every whole answer equals `pdserve generate` for its prompt;
//   - the stack serves again under load once the fault is over, with all
//     surviving workers registered and synced;
//   - every surviving worker's KV usage returns to 0 once the load stops;
//   - the router's index predicts hits again (a repeated prompt is predicted
//     and found cached), and the answers equal `pdserve generate`.
#include <signal.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/chaos/load.h"
#include "tests/chaos/network_namespace.h"
#include "tests/integration/serving/stack.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

// Generous: a request ends well within this unless something hangs.
constexpr auto kBound = 60s;
// The control plane closes a connection silent for 5 s (ConnectionOptions).
constexpr auto kFreeze = 8s;
constexpr auto kPartition = 20s;
constexpr int kMaxTokens = 24;
constexpr int kClients = 4;

// A ~150-token prefix shared by `group`, then a tail: 4 words (a warm decode
// worker prefills it itself) or 24 words (over --max-local-prefill: remote
// prefill, with a prefix hit on the prefill worker).
std::string Prompt(int group, int request, int tail_words) {
  std::string s = "chaos group " + std::to_string(group) + ":";
  for (int i = 0; i < 60; ++i) s += " w" + std::to_string((group * 31 + i * 7) % 97);
  s += " | request " + std::to_string(request) + ":";
  for (int i = 0; i < tail_words; ++i) s += " t" + std::to_string((request * 13 + i) % 89);
  return s;
}

std::vector<std::string> LoadPrompts() {
  std::vector<std::string> p;
  for (int group = 0; group < 2; ++group) {
    for (int request = 0; request < 4; ++request)
      p.push_back(Prompt(group, request, request % 2 ? 24 : 4));
  }
  return p;
}

std::string Tail(const std::string& text, size_t lines) {
  size_t at = text.size();
  for (size_t n = 0; n <= lines && at > 0; ++n) {
    at = text.rfind('\n', at - 1);
    if (at == std::string::npos) return text;
  }
  return text.substr(at + 1);
}

// True once /proc says the process is stopped (state T).
bool WaitUntilStopped(pid_t pid) {
  for (int i = 0; i < 400; ++i) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');
    if (paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'T')
      return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

class ChaosTest : public ::testing::Test {
 protected:
  ChaosTest() : load_(LoadPrompts(), kMaxTokens, kClients, kBound) {}

  ~ChaosTest() override {
    load_.Stop();
    if (HasFailure()) KeepLogs();
    // The processes go before the namespace they live in.
    stack_.reset();
  }

  // A failed case's logs, whole, under the build folder (the stack's own
  // folder is temporary).
  void KeepLogs() {
    if (!stack_) return;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    const std::filesystem::path dir =
        std::filesystem::path(PDSERVE_BINARY_DIR) / "chaos-logs" / info->name();
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    std::ofstream(dir / "router.log") << stack_->router().Log();
    for (auto& w : stack_->workers()) std::ofstream(dir / (w->id + ".log")) << w->proc.Log();
    std::cout << "chaos: the processes' logs are in " << dir.string() << std::endl;
  }

  // Router, one prefill and two decode workers; the prefill worker in ns_
  // when there is one (the router then listens on every address so that it
  // is reachable from there).
  void StartStack(const std::string& name) {
    NetworkNamespace* ns = ns_.get();
    for (const auto& p : load_.prompts()) {
      nlohmann::json want = Generate(p, kMaxTokens);
      ASSERT_TRUE(want.is_object());
      expected_.push_back(want["text"].get<std::string>());
    }
    stack_ = std::make_unique<LocalStack>(name);
    if (ns) stack_->UseEveryNetworkInterface();  // the decode workers are reached over the link
    stack_->StartRouter(RouterFlags());
    std::vector<std::string> prefill_flags;
    if (ns) {
      stack_->SetWorkerLauncher(ns->launcher());
      prefill_flags.insert(
          prefill_flags.end(),
          {"--router", ns->host_address() + ":" + std::to_string(stack_->control_port()), "--host",
           "0.0.0.0", "--advertise-host", ns->inside_address()});
    }
    stack_->StartWorker("prefill", prefill_flags);
    stack_->SetWorkerLauncher({});
    for (int i = 0; i < 2; ++i) stack_->StartWorker("decode");
    ASSERT_TRUE(stack_->WaitReady()) << Logs();
  }

  // The router listens on every address when a worker is in ns_.
  std::vector<std::string> RouterFlags() const {
    std::vector<std::string> f = {"--max-local-prefill", "32"};
    if (ns_) f.insert(f.end(), {"--host", "0.0.0.0"});
    return f;
  }

  WorkerProc& Worker(const std::string& role, int nth = 0) {
    for (auto& w : stack_->workers()) {
      if (w->role == role && nth-- == 0) return *w;
    }
    ADD_FAILURE() << "no " << role << " worker";
    return *stack_->workers().front();
  }

  // A worker's metric, read from inside its namespace where it has one.
  double WorkerMetric(WorkerProc& w, const std::string& name, const std::string& labels = "") {
    if (!ns_ || w.role != "prefill") return LocalStack::Metric(w.metrics_port, name, labels);
    double v = 0;
    EXPECT_TRUE(ns_->RunInside([&] { v = LocalStack::Metric(w.metrics_port, name, labels); }));
    return v;
  }

  // The decode worker that finished the most requests in the last 300 ms:
  // the one the router is sending work to now (gauges lag by a load period).
  WorkerProc& BusiestDecodeWorker() {
    double before[2], most = -1;
    for (int i = 0; i < 2; ++i)
      before[i] = WorkerMetric(Worker("decode", i), "pdserve_requests_total");
    std::this_thread::sleep_for(300ms);
    WorkerProc* best = &Worker("decode", 0);
    for (int i = 0; i < 2; ++i) {
      const double done = WorkerMetric(Worker("decode", i), "pdserve_requests_total") - before[i];
      if (done > most) most = done, best = &Worker("decode", i);
    }
    return *best;
  }

  std::string Logs() {
    if (!stack_) return "";
    std::string out = "\n--- router (last lines):\n" + Tail(stack_->router().Log(), 40);
    for (auto& w : stack_->workers())
      out += "\n--- " + w->id + " (last lines):\n" + Tail(w->proc.Log(), 40);
    return out;
  }

  // Workers the router lists as registered and synced, by role.
  std::pair<int, int> SyncedWorkers() {
    HttpResult r = HttpRequest(stack_->http_port(), "GET", "/ready", {}, {}, 5s);
    auto j = nlohmann::json::parse(r.body, nullptr, false);
    if (!j.is_object()) return {-1, -1};
    return {j.value("prefill_workers", -1), j.value("decode_workers", -1)};
  }

  // How many times the router's log says `worker_id` synced.
  int SyncCount(const std::string& worker_id) {
    const std::string log = stack_->router().Log(), line = "worker " + worker_id + " synced";
    int n = 0;
    for (size_t at = log.find(line); at != std::string::npos; at = log.find(line, at + 1)) ++n;
    return n;
  }

  // Until every worker still running is registered and synced, each of
  // `resynced` at least twice (it was given up, came back and resent its
  // cache).
  bool WaitForSurvivorsSynced(const std::vector<std::string>& resynced) {
    int prefill = 0, decode = 0;
    for (auto& w : stack_->workers()) {
      if (w->proc.running()) ++(w->role == "prefill" ? prefill : decode);
    }
    auto all_resynced = [&] {
      return std::all_of(resynced.begin(), resynced.end(),
                         [&](const std::string& id) { return SyncCount(id) >= 2; });
    };
    const auto end = Clock::now() + kBound;
    while (Clock::now() < end) {
      if (SyncedWorkers() == std::pair{prefill, decode} && all_resynced()) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }

  // Starts the load and returns once it runs, some prompts having been
  // prefilled remotely.
  void StartLoad() {
    WorkerProc& prefill = Worker("prefill");
    load_.Start(stack_->http_port());
    const auto warm_until = Clock::now() + kBound;
    while (Clock::now() < warm_until &&
           (load_.finished() < 8 ||
            WorkerMetric(prefill, "pdserve_kv_transfer_bytes_total", "direction=\"out\"") == 0)) {
      std::this_thread::sleep_for(50ms);
    }
    ASSERT_GT(WorkerMetric(prefill, "pdserve_kv_transfer_bytes_total", "direction=\"out\""), 0)
        << "no prompt was prefilled remotely before the fault" << Logs();
  }

  // Runs `fault` at a moment when at least two requests are in flight.
  void InjectFault(const std::function<void()>& fault) {
    const auto busy_until = Clock::now() + 10s;
    while (Clock::now() < busy_until && load_.in_flight() < 2) std::this_thread::sleep_for(1ms);
    fault_start_ = Clock::now();
    fault();
    fault_end_ = Clock::now();
  }

  // Waits until the workers still running are registered and synced (those
  // in `resynced` for a second time), keeps the load on until the stack has
  // served again, then stops it (every client's request ended).
  void RecoverAndStopLoad(const std::vector<std::string>& resynced = {}) {
    ASSERT_TRUE(WaitForSurvivorsSynced(resynced))
        << "workers did not register and sync again; the router lists " << SyncedWorkers().first
        << " prefill, " << SyncedWorkers().second << " decode" << Logs();
    recovered_ = Clock::now();
    // Served again under load: whole answers to requests sent after recovery.
    const auto serve_until = Clock::now() + kBound;
    auto served_since_recovery = [&] {
      int n = 0;
      for (const auto& r : load_.Records()) n += r.start >= recovered_ && r.ending == Ending::kOk;
      return n;
    };
    while (Clock::now() < serve_until && served_since_recovery() < 2 * kClients)
      std::this_thread::sleep_for(50ms);
    load_.Stop();
    EXPECT_GE(served_since_recovery(), 2 * kClients)
        << "the stack did not serve again after the fault" << Logs();
  }

  // Every request ended cleanly within kBound; whole answers equal generate.
  // A lost connection is accepted only from the router at `killed_router_port`.
  void ExpectEveryRequestEnded(int killed_router_port = 0) {
    const std::vector<RequestRecord> records = load_.Records();
    std::map<Ending, int> by_ending;
    int hit_by_fault = 0, during_fault = 0, salted = 0, mismatches = 0;
    double longest_after_fault = 0, longest = 0;
    for (const auto& r : records) {
      ++by_ending[r.ending];
      salted += r.salted;
      longest = std::max(longest, Seconds(r.end - r.start));
      if (r.start < fault_start_ && r.end > fault_start_) {
        ++hit_by_fault;
        longest_after_fault = std::max(longest_after_fault, Seconds(r.end - fault_start_));
      }
      during_fault += r.start >= fault_start_ && r.start < fault_end_;
      switch (r.ending) {
        case Ending::kOk:
          if (r.text != expected_[r.prompt]) {
            ++mismatches;
            ADD_FAILURE() << "greedy answer differs from pdserve generate, prompt " << r.prompt
                          << (r.stream ? " (streamed)" : "") << ":\n  got  " << r.text
                          << "\n  want " << expected_[r.prompt] << "\n  " << r.body;
          }
          break;
        case Ending::kCleanError:
          break;
        case Ending::kConnectionLost:
          EXPECT_EQ(r.port, killed_router_port)
              << "connection lost without a router dying: " << r.body;
          break;
        case Ending::kHang:
          ADD_FAILURE() << "request did not end within " << kBound.count() << " s (sent "
                        << Seconds(r.start - fault_start_) << " s after the fault began, "
                        << (r.stream ? "streamed" : "not streamed") << "): " << r.body;
          break;
        case Ending::kMalformed:
          ADD_FAILURE() << "malformed answer (status " << r.status << "): " << r.body;
          break;
      }
    }
    std::cout << "chaos: " << records.size() << " requests (" << salted
              << " with a fresh cache_salt): " << by_ending[Ending::kOk] << " ok, "
              << by_ending[Ending::kCleanError] << " clean errors, "
              << by_ending[Ending::kConnectionLost] << " lost with the killed router, "
              << by_ending[Ending::kHang] << " hung, " << by_ending[Ending::kMalformed]
              << " malformed; the longest took " << longest << " s; " << hit_by_fault
              << " in flight at the fault, the last of them ended " << longest_after_fault
              << " s after it; " << during_fault << " sent during the fault, which lasted "
              << Seconds(fault_end_ - fault_start_) << " s; workers synced again "
              << Seconds(recovered_ - fault_end_) << " s after it" << std::endl;
    EXPECT_GT(hit_by_fault, 0) << "the fault hit no request in flight";
    EXPECT_EQ(mismatches, 0);
    if (HasFailure()) std::cout << Logs() << std::endl;
  }

  // Every surviving worker's pool returns to idle: no block held by a
  // request (cached blocks no request holds count as free), nothing running.
  void ExpectSurvivorsIdle() {
    for (auto& w : stack_->workers()) {
      if (!w->proc.running()) continue;
      double usage = -1, running = -1, waiting = -1;
      // Blocks of hand-offs given up on stay held until their prefill
      // worker's transfer deadline (30 s) plus the peer timeout has passed:
      // a worker cut off or frozen may still write into them.
      const auto end = Clock::now() + kBound;
      while (Clock::now() < end) {
        usage = WorkerMetric(*w, "pdserve_kv_cache_usage_ratio");
        running = WorkerMetric(*w, "pdserve_requests_running");
        waiting = WorkerMetric(*w, "pdserve_requests_waiting");
        if (usage == 0 && running == 0 && waiting == 0) break;
        std::this_thread::sleep_for(100ms);
      }
      EXPECT_EQ(usage, 0) << w->id << " still holds KV blocks once idle ("
                          << WorkerMetric(*w, "pdserve_kv_blocks_held_for_peers")
                          << " held for prefill peers)" << Logs();
      EXPECT_EQ(running, 0) << w->id;
      EXPECT_EQ(waiting, 0) << w->id;
    }
  }

  // A fresh prompt sent twice: the second time the router predicts a hit and
  // the worker finds the prefix cached; both answers equal generate.
  void ExpectIndexPredictsHitsAndGreedyEqualsGenerate(int seed) {
    const std::string prompt = Prompt(100 + seed, seed, 24);
    const nlohmann::json want = Generate(prompt, kMaxTokens);
    ASSERT_TRUE(want.is_object());
    const nlohmann::json req = {
        {"prompt", prompt}, {"max_tokens", kMaxTokens}, {"temperature", 0}, {"ignore_eos", true}};
    auto [status, first] = stack_->Post("/v1/completions", req);
    ASSERT_EQ(status, 200) << first.dump() << Logs();
    EXPECT_EQ(first["choices"][0]["text"], want["text"]);
    // The workers' KV events may trail the answer: ask a few times.
    int64_t cached = 0;
    double predicted = 0;
    for (int attempt = 0; attempt < 20 && (cached == 0 || predicted == 0); ++attempt) {
      const double before =
          LocalStack::Metric(stack_->http_port(), "pdserve_router_predicted_hit_tokens_total");
      auto [again_status, again] = stack_->Post("/v1/completions", req);
      ASSERT_EQ(again_status, 200) << again.dump() << Logs();
      EXPECT_EQ(again["choices"][0]["text"], want["text"]);
      cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].get<int64_t>();
      predicted =
          LocalStack::Metric(stack_->http_port(), "pdserve_router_predicted_hit_tokens_total") -
          before;
      if (cached == 0 || predicted == 0) std::this_thread::sleep_for(100ms);
    }
    EXPECT_GT(cached, 0) << "the repeated prompt found nothing cached" << Logs();
    EXPECT_GT(predicted, 0) << "the router's index predicted no hit" << Logs();
  }

  // New long prompts (no shared prefix) are prefilled remotely again.
  void ExpectPrefillWorkerServesAgain() {
    WorkerProc& prefill = Worker("prefill");
    const double before =
        WorkerMetric(prefill, "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
    double after = before;
    const auto end = Clock::now() + 30s;
    for (int i = 0; Clock::now() < end && after == before; ++i) {
      auto [status, body] =
          stack_->Post("/v1/completions",
                       {{"prompt", Prompt(200 + i, i, 24)}, {"max_tokens", 2}, {"temperature", 0}});
      EXPECT_EQ(status, 200) << body.dump();
      after = WorkerMetric(prefill, "pdserve_kv_transfer_bytes_total", "direction=\"out\"");
      if (after == before) std::this_thread::sleep_for(200ms);
    }
    EXPECT_GT(after, before) << "the prefill worker is not used again" << Logs();
  }

  void ExpectStackHealed(int seed) {
    ExpectSurvivorsIdle();
    ExpectIndexPredictsHitsAndGreedyEqualsGenerate(seed);
  }

  LoadGenerator load_;
  std::unique_ptr<NetworkNamespace> ns_;  // outlives stack_, whose processes live in it
  std::unique_ptr<LocalStack> stack_;
  std::vector<std::string> expected_;  // generate's text for each load prompt
  Clock::time_point fault_start_, fault_end_, recovered_;
};

TEST_F(ChaosTest, PrefillWorkerKilled) {
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-kill-prefill"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  WorkerProc& prefill = Worker("prefill");
  InjectFault([&] {
    prefill.proc.Signal(SIGKILL);
    EXPECT_TRUE(prefill.proc.Wait(10s));
  });
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad());
  ExpectEveryRequestEnded();
  ExpectStackHealed(1);
}

TEST_F(ChaosTest, DecodeWorkerKilled) {
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-kill-decode"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  WorkerProc& decode = BusiestDecodeWorker();
  InjectFault([&] {
    decode.proc.Signal(SIGKILL);
    EXPECT_TRUE(decode.proc.Wait(10s));
  });
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad());
  ExpectEveryRequestEnded();
  ExpectStackHealed(2);
}

// Two faults in a row on one request: its prefill worker dies once the
// decode worker is streaming, then that decode worker dies too. The stream
// must end as it does when only the decode worker dies (an error event, then
// [DONE]), not wait for the request timeout. (The router once dropped a
// request from its in-flight table when its prefill worker's link closed,
// so the decode worker's death later failed nothing and the stream stalled.)
// The decode worker running the request is found at the first event and
// frozen (SIGSTOP) until it is killed: the CPU engine can generate the 3,000
// tokens in less time than the router needs to see the prefill worker go.
TEST_F(ChaosTest, DecodeWorkerKilledAfterItsPrefillWorker) {
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-kill-prefill-then-decode"));
  WorkerProc& prefill = Worker("prefill");
  const nlohmann::json req = {{"prompt", Prompt(300, 0, 24)}, {"cache_salt", "prefill-then-decode"},
                              {"max_tokens", 3000},           {"temperature", 0},
                              {"ignore_eos", true},           {"stream", true}};
  std::string events;
  WorkerProc* decode = nullptr;
  const auto start = Clock::now();
  HttpResult r = HttpStream(
      stack_->http_port(), "/v1/completions", req.dump(),
      [&](const std::string& data) {
        events += data;
        if (decode != nullptr) return true;
        // Streaming, so prefilled (remotely: nothing is cached, and the
        // prompt is over --max-local-prefill).
        // The decode worker that received the prompt's KV runs it (the
        // running gauge lags by a load period; the transfer counter does not).
        for (int i = 0; i < 2; ++i) {
          WorkerProc& w = Worker("decode", i);
          if (WorkerMetric(w, "pdserve_kv_transfer_bytes_total", "direction=\"in\"") > 0) {
            decode = &w;
          }
        }
        EXPECT_NE(decode, nullptr) << "no decode worker received the request's KV" << Logs();
        if (decode == nullptr) return false;
        decode->proc.Signal(SIGSTOP);
        prefill.proc.Signal(SIGKILL);
        EXPECT_TRUE(prefill.proc.Wait(10s));
        std::this_thread::sleep_for(500ms);  // the router has seen it go
        decode->proc.Signal(SIGKILL);
        EXPECT_TRUE(decode->proc.Wait(10s));
        return true;
      },
      kBound);
  const double took = Seconds(Clock::now() - start);
  ASSERT_NE(decode, nullptr);
  EXPECT_LT(took + 1, std::chrono::duration<double>(kBound).count())
      << "the stream did not end within " << kBound.count() << " s" << Logs();
  EXPECT_EQ(r.status, 200);
  EXPECT_NE(events.find("data: {\"error\":"), std::string::npos)
      << events.substr(events.size() > 600 ? events.size() - 600 : 0) << Logs();
  EXPECT_EQ(events.rfind("data: [DONE]\n\n"), events.size() - 14);
  ASSERT_TRUE(WaitForSurvivorsSynced({})) << Logs();
  ExpectStackHealed(9);
}

TEST_F(ChaosTest, RouterKilledAndRestarted) {
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-kill-router"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  const int killed_port = stack_->http_port();
  InjectFault([&] {
    // A new router on the same control port; the workers reconnect to it.
    stack_->RestartRouter(RouterFlags());
    load_.SetPort(stack_->http_port());
  });
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad());
  // Each worker resent its cache to the new router.
  const std::string log = stack_->router().Log();
  for (auto& w : stack_->workers()) {
    std::smatch m;
    EXPECT_TRUE(
        std::regex_search(log, m, std::regex("worker " + w->id + R"( synced: (\d+) cached)")) &&
        std::stoi(m[1].str()) > 0)
        << w->id << " did not resync its cache with the new router" << Logs();
  }
  ExpectEveryRequestEnded(killed_port);
  ExpectStackHealed(3);
  ExpectPrefillWorkerServesAgain();
}

// SIGSTOP for longer than the peer timeout: the peers give the process up;
// resumed, it finds its connections closed and reconnects.
void Freeze(ChildProcess& proc) {
  proc.Signal(SIGSTOP);
  EXPECT_TRUE(WaitUntilStopped(proc.pid()));
  std::this_thread::sleep_for(kFreeze);
  proc.Signal(SIGCONT);
}

TEST_F(ChaosTest, PrefillWorkerFrozen) {
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-stop-prefill"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  WorkerProc& prefill = Worker("prefill");
  InjectFault([&] { Freeze(prefill.proc); });
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad({prefill.id}));
  ExpectEveryRequestEnded();
  ExpectStackHealed(4);
  ExpectPrefillWorkerServesAgain();
}

TEST_F(ChaosTest, DecodeWorkerFrozen) {
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-stop-decode"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  WorkerProc& decode = BusiestDecodeWorker();
  InjectFault([&] { Freeze(decode.proc); });
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad({decode.id}));
  ExpectEveryRequestEnded();
  ExpectStackHealed(5);
}

TEST_F(ChaosTest, RouterFrozen) {
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-stop-router"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  InjectFault([&] { Freeze(stack_->router()); });
  std::vector<std::string> all;
  for (auto& w : stack_->workers()) all.push_back(w->id);
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad(all));
  ExpectEveryRequestEnded();
  ExpectStackHealed(6);
  ExpectPrefillWorkerServesAgain();
}

TEST_F(ChaosTest, PrefillWorkerPartitioned) {
  std::string why;
  ns_ = NetworkNamespace::Create(&why);
  if (!ns_) GTEST_SKIP() << "the partition needs a network namespace: " << why;
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-partition-prefill"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  InjectFault([&] {
    EXPECT_TRUE(ns_->Cut(&why)) << why;
    std::this_thread::sleep_for(kPartition);
    EXPECT_TRUE(ns_->Heal(&why)) << why;
  });
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad({Worker("prefill").id}));
  ExpectEveryRequestEnded();
  ExpectStackHealed(7);
  ExpectPrefillWorkerServesAgain();
}

// A network interface that the prefill worker's UCX listed at start goes
// away (a veth pair here; a container's or a VPN's in production). UCX 1.13
// then creates no worker ("No such device"), while each connection a writer
// opens wants one of its own: a decode worker that connects afterwards must
// still get its prompts prefilled remotely.
TEST_F(ChaosTest, AnInterfaceRemovedAfterStartBreaksNoConnection) {
  std::string why;
  ns_ = NetworkNamespace::Create(&why);
  if (!ns_) GTEST_SKIP() << "the interface comes from a network namespace's link: " << why;
  stack_ = std::make_unique<LocalStack>("chaos-interface-removed");
  stack_->UseEveryNetworkInterface();
  stack_->StartRouter({"--max-local-prefill", "32"});
  WorkerProc& prefill = stack_->StartWorker("prefill");
  ns_.reset();  // its link goes with it
  stack_->StartWorker("decode");
  ASSERT_TRUE(stack_->WaitReady()) << Logs();
  ExpectPrefillWorkerServesAgain();
  // The case happened: its connection could not have a worker of its own.
  EXPECT_NE(prefill.proc.Log().find("cannot have a worker of their own share the transfer's"),
            std::string::npos)
      << prefill.proc.Log();
}

// 200 ms each way on the prefill worker's link for 10 s: below the peer
// timeout, so nothing should be given up, only slowed down.
TEST_F(ChaosTest, PrefillWorkerLinkDelayed) {
  std::string why;
  ns_ = NetworkNamespace::Create(&why);
  if (!ns_) GTEST_SKIP() << "the delay needs a network namespace: " << why;
  if (!ns_->Delay(200ms, &why) || !ns_->Undelay(&why))
    GTEST_SKIP() << "no delay injection here (the kernel needs sch_netem): " << why;
  ASSERT_NO_FATAL_FAILURE(StartStack("chaos-delay-prefill"));
  ASSERT_NO_FATAL_FAILURE(StartLoad());
  InjectFault([&] {
    EXPECT_TRUE(ns_->Delay(200ms, &why)) << why;
    std::this_thread::sleep_for(10s);
    EXPECT_TRUE(ns_->Undelay(&why)) << why;
  });
  ASSERT_NO_FATAL_FAILURE(RecoverAndStopLoad());
  ExpectEveryRequestEnded();
  ExpectStackHealed(8);
  ExpectPrefillWorkerServesAgain();
}

}  // namespace
}  // namespace pdserve::testing
