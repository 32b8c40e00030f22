// `pdserve up` as a user runs it: the printed curl line works, every printed
// metrics address answers, SIGTERM stops every child, and a child that dies
// at start or later takes the stack down with its last log lines.
#include <signal.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "tests/support/http_client.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {
namespace {

using namespace std::chrono_literals;

const std::string kPdserve = PDSERVE_BIN_PATH;

// Any free ports, one thread per worker: tests run side by side.
std::vector<std::string> UpArgs(const std::string& dir, std::vector<std::string> extra = {}) {
  std::vector<std::string> argv = {kPdserve,
                                   "up",
                                   "--dir",
                                   dir,
                                   "--port",
                                   "0",
                                   "--control-port",
                                   "0",
                                   "--prefill-metrics-port",
                                   "0",
                                   "--decode-metrics-port",
                                   "0",
                                   "--threads",
                                   "1",
                                   "--kv-cache-bytes",
                                   "8MiB",
                                   "--stop-timeout",
                                   "20"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

std::vector<pid_t> ChildPids(const std::string& log) {
  std::vector<pid_t> pids;
  static const std::regex started(R"(started \S+ \(pid (\d+))");
  for (std::sregex_iterator it(log.begin(), log.end(), started), end; it != end; ++it)
    pids.push_back(std::stoi((*it)[1].str()));
  return pids;
}

bool Alive(pid_t pid) { return ::kill(pid, 0) == 0; }

TEST(UpTest, ServesThePrintedCurlLineAndStopsEveryChildOnSigterm) {
  const std::string dir = NewTempDir("up-serve");
  // Every prompt prefilled remotely: the decode workers hold connections to
  // the prefill worker when they are stopped.
  // With KV tiers: each worker gets its own disk tier folder.
  ChildProcess up = ChildProcess::Start(
      UpArgs(dir, {"--prefill", "1", "--decode", "2", "--max-local-prefill", "0",
                   "--kv-host-cache-bytes", "2MiB", "--kv-disk-cache-dir", dir + "/kv",
                   "--kv-disk-cache-bytes", "4MiB", "--kv-disk-write", "through",
                   "--kv-disk-write-bytes-per-second", "64MiB"}),
      dir + "/up.log");
  ASSERT_TRUE(up.WaitForLog(std::regex("Ctrl-C stops the stack"), 120s)) << up.Log();
  const std::string log = up.Log();
  EXPECT_NE(log.find("1 prefill, 2 decode workers, model pdserve-tiny"), std::string::npos) << log;

  // The curl example, run as printed.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(log, m, std::regex(R"(try:\s+(curl .*))"))) << log;
  CommandResult curl = RunCommand({"/bin/bash", "-c", m[1].str()});
  ASSERT_EQ(curl.exit_code, 0) << curl.err;
  auto answer = nlohmann::json::parse(curl.out, nullptr, false);
  ASSERT_FALSE(answer.is_discarded()) << curl.out;
  EXPECT_EQ(answer["object"], "chat.completion");
  EXPECT_GT(answer["usage"]["completion_tokens"].get<int>(), 0);

  // Every printed metrics address serves pdserve metrics: router + 3 workers.
  std::set<int> ports;
  static const std::regex metrics(R"(http://127\.0\.0\.1:(\d+)/metrics)");
  for (std::sregex_iterator it(log.begin(), log.end(), metrics), end; it != end; ++it)
    ports.insert(std::stoi((*it)[1].str()));
  ASSERT_EQ(ports.size(), 4u) << log;
  for (int port : ports) {
    HttpResult r = HttpRequest(port, "GET", "/metrics");
    EXPECT_EQ(r.status, 200) << port;
    EXPECT_NE(r.body.find("pdserve_"), std::string::npos) << port;
    if (r.body.find("pdserve_router_") == std::string::npos) {
      EXPECT_TRUE(std::regex_search(
          r.body, std::regex(R"(pdserve_kv_tier_capacity_blocks\{[^}]*tier="disk"[^}]*\} [1-9])")))
          << r.body;
    }
  }
  for (const char* name : {"prefill-0", "decode-0", "decode-1"}) {
    bool slab = false;
    for (const auto& e : std::filesystem::directory_iterator(dir + "/kv/" + name)) {
      slab |= e.path().extension() == ".slab";
    }
    EXPECT_TRUE(slab) << name;
  }
  // The Prometheus hint names the same addresses.
  EXPECT_TRUE(std::regex_search(log, std::regex(R"(prometheus\.sh --router 127\.0\.0\.1:\d+ )"
                                                R"(--prefill '127\.0\.0\.1:\d+' )"
                                                R"(--decode '127\.0\.0\.1:\d+,127\.0\.0\.1:\d+')")))
      << log;

  std::string decode_logs;
  for (const char* name : {"decode-0", "decode-1"}) {
    std::ifstream in(dir + "/logs/" + name + ".log");
    decode_logs += std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::ifstream router_log(dir + "/logs/router.log");
  EXPECT_NE(decode_logs.find("remote prefill"), std::string::npos)
      << decode_logs << std::string(std::istreambuf_iterator<char>(router_log), {});

  const std::vector<pid_t> pids = ChildPids(log);
  ASSERT_EQ(pids.size(), 4u) << log;
  up.Signal(SIGTERM);
  auto code = up.Wait(60s);
  ASSERT_TRUE(code) << "pdserve up did not stop\n" << up.Log();
  EXPECT_EQ(*code, 0) << up.Log();
  EXPECT_NE(up.Log().find("pdserve up: stopped"), std::string::npos);
  EXPECT_EQ(up.Log().find("killing it"), std::string::npos) << "a child ignored SIGTERM\n"
                                                            << up.Log();
  for (pid_t pid : pids) EXPECT_FALSE(Alive(pid)) << "child " << pid << " outlived pdserve up";
  // Each child logged to its own file under DIR/logs.
  for (const char* name : {"router", "prefill-0", "decode-0", "decode-1"}) {
    std::ifstream in(dir + "/logs/" + name + ".log");
    EXPECT_TRUE(in.good()) << name;
  }
}

TEST(UpTest, ChildDyingAtStartFailsWithItsLastLogLines) {
  // A model folder whose config.json is not JSON: the router refuses it.
  const std::string dir = NewTempDir("up-bad-model");
  const std::string model = dir + "/model";
  CommandResult made = RunCommand({kPdserve, "make-model", "--preset", "tiny", "--out", model});
  ASSERT_EQ(made.exit_code, 0) << made.err;
  std::ofstream(model + "/config.json") << "{ this is not json";

  ChildProcess up = ChildProcess::Start(UpArgs(dir, {"--model", model}), dir + "/up.log");
  auto code = up.Wait(60s);
  ASSERT_TRUE(code) << up.Log();
  EXPECT_EQ(*code, 1) << up.Log();
  const std::string log = up.Log();
  EXPECT_NE(log.find("router exited at start (exit code"), std::string::npos) << log;
  EXPECT_NE(log.find("last lines of"), std::string::npos) << log;
  EXPECT_NE(log.find("  | pdserve router: "), std::string::npos) << log;
  EXPECT_NE(log.find("config.json"), std::string::npos) << log;
  EXPECT_EQ(log.find("ready at"), std::string::npos) << log;
}

TEST(UpTest, WorkerKilledLaterTakesTheStackDown) {
  const std::string dir = NewTempDir("up-worker-dies");
  ChildProcess up = ChildProcess::Start(UpArgs(dir, {"--prefill", "0"}), dir + "/up.log");
  ASSERT_TRUE(up.WaitForLog(std::regex("Ctrl-C stops the stack"), 120s)) << up.Log();
  const std::vector<pid_t> pids = ChildPids(up.Log());
  ASSERT_EQ(pids.size(), 2u) << up.Log();
  ::kill(pids[1], SIGKILL);  // the decode worker
  auto code = up.Wait(60s);
  ASSERT_TRUE(code) << up.Log();
  EXPECT_EQ(*code, 1);
  EXPECT_NE(up.Log().find("decode-0 exited (killed by signal 9)"), std::string::npos) << up.Log();
  EXPECT_FALSE(Alive(pids[0])) << "the router outlived pdserve up";
}

// The token eviction flags reach the workers: with attention sinks a long
// request releases the blocks between its sinks and its window on the
// worker that decodes it.
// Every worker of two CPU ranks, every prompt prefilled remotely: the
// prefill worker hands each rank's KV shard to the decode worker's same rank.
TEST(UpTest, TensorParallelWorkersHandKvOff) {
  const std::string dir = NewTempDir("up-tp");
  ChildProcess up =
      ChildProcess::Start(UpArgs(dir, {"--prefill", "1", "--decode", "1", "--max-local-prefill",
                                       "0", "--tensor-parallel", "2"}),
                          dir + "/up.log");
  ASSERT_TRUE(up.WaitForLog(std::regex("Ctrl-C stops the stack"), 120s)) << up.Log();
  const std::string log = up.Log();
  std::smatch port;
  ASSERT_TRUE(std::regex_search(log, port, std::regex(R"(http://127\.0\.0\.1:(\d+)/v1)"))) << log;
  const nlohmann::json req = {{"prompt", "once upon a time there was a little girl"},
                              {"max_tokens", 8}};
  HttpResult r =
      HttpRequest(std::stoi(port[1].str()), "POST", "/v1/completions", req.dump(), {}, 60s);
  ASSERT_EQ(r.status, 200) << r.body;
  // The worker logs a request just after its last token went out.
  std::string decode;
  for (int i = 0; i < 100 && decode.find("remote prefill") == std::string::npos; ++i) {
    if (i > 0) std::this_thread::sleep_for(100ms);
    std::ifstream decode_log(dir + "/logs/decode-0.log");
    decode.assign(std::istreambuf_iterator<char>(decode_log), {});
  }
  EXPECT_NE(decode.find("remote prefill"), std::string::npos) << decode;
  EXPECT_NE(decode.find("tensor_parallel=2"), std::string::npos) << decode;
  up.Signal(SIGTERM);
  auto code = up.Wait(60s);
  ASSERT_TRUE(code) << up.Log();
  EXPECT_EQ(*code, 0) << up.Log();
}

// (On a model without a chat template, whose printed example is then a
// completion: chat would answer 400.)
TEST(UpTest, EvictionFlagsReachTheWorkers) {
  const std::string dir = NewTempDir("up-eviction");
  const std::string model = dir + "/plain";
  ASSERT_EQ(RunCommand({kPdserve, "make-model", "--preset", "tiny", "--out", model}).exit_code, 0);
  {
    std::ifstream in(model + "/tokenizer_config.json");
    nlohmann::json config = nlohmann::json::parse(in);
    config.erase("chat_template");
    std::ofstream(model + "/tokenizer_config.json") << config.dump();
  }
  ChildProcess up = ChildProcess::Start(
      UpArgs(dir, {"--model", model, "--prefill", "0", "--decode", "1", "--kv-eviction",
                   "streaming", "--kv-sink-tokens", "4", "--kv-window-tokens", "32"}),
      dir + "/up.log");
  ASSERT_TRUE(up.WaitForLog(std::regex("Ctrl-C stops the stack"), 120s)) << up.Log();
  const std::string log = up.Log();
  std::smatch example;
  ASSERT_TRUE(std::regex_search(log, example, std::regex(R"(try:\s+(curl .*))"))) << log;
  EXPECT_NE(example[1].str().find("/v1/completions"), std::string::npos) << log;
  CommandResult curl = RunCommand({"/bin/bash", "-c", example[1].str()});
  ASSERT_EQ(curl.exit_code, 0) << curl.err;
  EXPECT_EQ(nlohmann::json::parse(curl.out, nullptr, false).value("object", ""), "text_completion")
      << curl.out;
  std::smatch port;
  ASSERT_TRUE(std::regex_search(log, port, std::regex(R"(http://127\.0\.0\.1:(\d+)/v1)"))) << log;
  const nlohmann::json req = {
      {"prompt", "once upon a time"}, {"max_tokens", 120}, {"ignore_eos", true}};
  HttpResult r =
      HttpRequest(std::stoi(port[1].str()), "POST", "/v1/completions", req.dump(), {}, 60s);
  ASSERT_EQ(r.status, 200) << r.body;
  // Workers publish the counter with their load reports: poll for it.
  static const std::regex metrics(R"(http://127\.0\.0\.1:(\d+)/metrics)");
  static const std::regex streaming(
      R"(pdserve_kv_evicted_tokens_total\{[^}]*mode="streaming"[^}]*\} ([0-9.e+]+))");
  double evicted = 0;
  for (int i = 0; i < 50 && evicted == 0; ++i) {
    for (std::sregex_iterator it(log.begin(), log.end(), metrics), end; it != end; ++it) {
      HttpResult m = HttpRequest(std::stoi((*it)[1].str()), "GET", "/metrics");
      std::smatch v;
      if (std::regex_search(m.body, v, streaming)) evicted += std::stod(v[1].str());
    }
    if (evicted == 0) std::this_thread::sleep_for(200ms);
  }
  std::ifstream decode_log(dir + "/logs/decode-0.log");
  EXPECT_GT(evicted, 0) << std::string(std::istreambuf_iterator<char>(decode_log), {});
  up.Signal(SIGTERM);
  EXPECT_TRUE(up.Wait(60s)) << up.Log();
}

// SnapKV with a prefill and a decode worker: a prompt over the budget is
// compressed by the prefill worker, which counts the tokens it released.
TEST(UpTest, SnapKvFlagsReachTheWorkers) {
  const std::string dir = NewTempDir("up-snapkv");
  ChildProcess up = ChildProcess::Start(
      UpArgs(dir, {"--prefill", "1", "--decode", "1", "--max-local-prefill", "0", "--kv-eviction",
                   "snapkv", "--kv-budget-tokens", "16", "--kv-observation-window", "4"}),
      dir + "/up.log");
  ASSERT_TRUE(up.WaitForLog(std::regex("Ctrl-C stops the stack"), 120s)) << up.Log();
  const std::string log = up.Log();
  std::smatch port;
  ASSERT_TRUE(std::regex_search(log, port, std::regex(R"(http://127\.0\.0\.1:(\d+)/v1)"))) << log;
  std::string prompt;
  for (int i = 0; i < 8; ++i) prompt += "once upon a time there was a cat. ";
  const nlohmann::json req = {{"prompt", prompt}, {"max_tokens", 20}, {"ignore_eos", true}};
  HttpResult r =
      HttpRequest(std::stoi(port[1].str()), "POST", "/v1/completions", req.dump(), {}, 60s);
  ASSERT_EQ(r.status, 200) << r.body;
  static const std::regex metrics(R"(http://127\.0\.0\.1:(\d+)/metrics)");
  static const std::regex snapkv(
      R"(pdserve_kv_evicted_tokens_total\{[^}]*mode="snapkv"[^}]*\} ([0-9.e+]+))");
  double evicted = 0;
  for (int i = 0; i < 50 && evicted == 0; ++i) {
    for (std::sregex_iterator it(log.begin(), log.end(), metrics), end; it != end; ++it) {
      HttpResult m = HttpRequest(std::stoi((*it)[1].str()), "GET", "/metrics");
      std::smatch v;
      if (std::regex_search(m.body, v, snapkv)) evicted += std::stod(v[1].str());
    }
    if (evicted == 0) std::this_thread::sleep_for(200ms);
  }
  std::ifstream decode_log(dir + "/logs/decode-0.log");
  const std::string decode(std::istreambuf_iterator<char>(decode_log), {});
  EXPECT_NE(decode.find(", remote prefill,"), std::string::npos) << decode;
  EXPECT_GT(evicted, 0) << decode;
  up.Signal(SIGTERM);
  EXPECT_TRUE(up.Wait(60s)) << up.Log();
}

TEST(UpTest, BadFlagsAreUsageErrors) {
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"--decode", "0"},
           {"--prefill", "-1"},
           {"--port", "70000"},
           {"--model", "/nonexistent/model"},
           {"--log-level", "loud"},
           {"--kv-disk-cache-dir", "kv"},
           {"--kv-host-cache-bytes", "-1"},
           {"--kv-disk-write", "back"},
           {"--kv-disk-cache-dir", "kv", "--kv-disk-cache-bytes", "4MiB", "--kv-disk-write", "up"},
           {"--kv-disk-cache-dir", "kv", "--kv-disk-cache-bytes", "4MiB", "--kv-disk-write-queue",
            "0"},
           {"--kv-eviction", "sinks"},
           {"--kv-window-tokens", "32"},
           {"--kv-eviction", "snapkv", "--kv-budget-tokens", "16", "--kv-observation-window", "32"},
           // What only the children checked before: refused here, before
           // any child starts (one line, not a child's last lines).
           {"--device", "tpu"},
           {"--policy", "bogus"},
           {"--load-format", "gguf"},
           {"--tool-call-parser", "foo"},
           {"--reasoning-parser", "foo"},
           {"--scheduling-policy", "lifo"},
           {"--allowed-origins", "app.example.com"},
           {"--chat-template", "/nonexistent/template.jinja"},
           {"--host", "999.1.1.1"},
           {"--host", "localhost"},
           {"--replication-copy-cost", "inf"},
           {"--dir", ""},  // would write its logs and secret at the root
           {"--start-timeout", "9223372036854775807"},
       }) {
    std::vector<std::string> argv = {kPdserve, "up"};
    argv.insert(argv.end(), args.begin(), args.end());
    CommandResult r = RunCommand(argv);
    EXPECT_EQ(r.exit_code, 2) << args[0];
    EXPECT_NE(r.err.find("pdserve up: "), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace pdserve::testing
