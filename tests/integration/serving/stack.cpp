#include "tests/integration/serving/stack.h"

#include <signal.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include "tests/support/test_models.h"
#include "transport/control/handshake.h"

namespace pdserve::testing {

const std::string& LocalStack::Model() {
  static const std::string dir = [] {
    std::string d = NewTempDir("stack-model") + "/tiny";
    CommandResult r = RunCommand({kPdserve, "make-model", "--preset", "tiny", "--out", d});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return d;
  }();
  return dir;
}

const std::string& LocalStack::SecretFile() {
  if (dir_.empty()) dir_ = NewTempDir(name_);
  if (secret_file_.empty()) {
    secret_file_ = dir_ + "/cluster-secret";
    std::ofstream(secret_file_) << control::ClusterSecret::Generate() << "\n";
    std::filesystem::permissions(
        secret_file_, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  return secret_file_;
}

std::vector<std::string> LocalStack::WithSecurity(std::vector<std::string> argv,
                                                  const std::vector<std::string>& extra) {
  const bool chosen = std::any_of(extra.begin(), extra.end(), [](const std::string& a) {
    return a.rfind("--cluster-secret-file", 0) == 0 || a.rfind("--insecure-control-plane", 0) == 0;
  });
  if (!chosen) argv.insert(argv.end(), {"--cluster-secret-file", SecretFile()});
  argv.insert(argv.end(), extra.begin(), extra.end());
  return argv;
}

void LocalStack::StartRouter(const std::vector<std::string>& extra, int control_port) {
  if (dir_.empty()) dir_ = NewTempDir(name_);
  std::vector<std::string> argv = {
      kPdserve,    "router", "--model", model(),          "--host",
      "127.0.0.1", "--port", "0",       "--control-port", std::to_string(control_port)};
  argv = WithSecurity(std::move(argv), extra);
  router_ = ChildProcess::Start(argv, dir_ + "/router" + std::to_string(router_starts_++) + ".log");
  auto ports =
      router_.WaitForLog(std::regex(R"(on http :(\d+), control :\d+)"), std::chrono::seconds(60));
  ASSERT_TRUE(ports) << router_.Log();
  http_port_ = std::stoi(*ports);
  control_port_ =
      std::stoi(*router_.WaitForLog(std::regex(R"(control :(\d+))"), std::chrono::seconds(5)));
}

void LocalStack::RestartRouter(const std::vector<std::string>& extra) {
  router_.Signal(SIGKILL);
  ASSERT_TRUE(router_.Wait(std::chrono::seconds(10)));
  StartRouter(extra, control_port_);
}

WorkerProc& LocalStack::StartWorker(const std::string& role, const std::vector<std::string>& extra,
                                    bool expect_synced) {
  auto w = std::make_unique<WorkerProc>();
  w->id = role + std::to_string(workers_.size());
  w->role = role;
  std::vector<std::string> argv = {kPdserve,           "worker",
                                   "--role",           role,
                                   "--model",          model(),
                                   "--router",         "127.0.0.1:" + std::to_string(control_port_),
                                   "--host",           "127.0.0.1",
                                   "--port",           "0",
                                   "--metrics-port",   "0",
                                   "--worker-id",      w->id,
                                   "--threads",        "1",
                                   "--transfer-tls",   "tcp",
                                   "--kv-cache-bytes", "8MiB"};
  argv = WithSecurity(std::move(argv), extra);
  argv.insert(argv.begin(), worker_launcher_.begin(), worker_launcher_.end());
  std::map<std::string, std::string> env = worker_env_;
  env["UCX_NET_DEVICES"] = every_interface_ ? "all" : "lo";
  w->proc = ChildProcess::Start(argv, dir_ + "/" + w->id + ".log", env);
  auto port = w->proc.WaitForLog(std::regex(R"(metrics :(\d+))"), std::chrono::seconds(60));
  EXPECT_TRUE(port) << w->proc.Log();
  if (port) w->metrics_port = std::stoi(*port);
  // Registered and synced at the router.
  if (expect_synced) {
    EXPECT_TRUE(
        router_.WaitForLog(std::regex("worker " + w->id + " synced"), std::chrono::seconds(30)))
        << router_.Log() << w->proc.Log();
  }
  workers_.push_back(std::move(w));
  return *workers_.back();
}

bool LocalStack::WaitReady(std::chrono::milliseconds timeout) {
  return WaitForHttpStatus(http_port_, "/ready", 200, timeout);
}

std::pair<int, nlohmann::json> LocalStack::Post(const std::string& path,
                                                const nlohmann::json& body) {
  HttpResult r = HttpRequest(http_port_, "POST", path, body.dump());
  nlohmann::json j = nlohmann::json::parse(r.body, nullptr, false);
  if (j.is_discarded()) j = nullptr;
  return {r.status, j};
}

std::vector<std::pair<int, nlohmann::json>> LocalStack::CompleteTogether(
    const std::vector<std::string>& prompts, int max_tokens) {
  std::vector<std::pair<int, nlohmann::json>> results(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i) {
    clients.emplace_back([&, i] {
      results[i] = Post("/v1/completions", {{"prompt", prompts[i]},
                                            {"max_tokens", max_tokens},
                                            {"temperature", 0},
                                            {"ignore_eos", true}});
    });
  }
  for (auto& t : clients) t.join();
  return results;
}

double LocalStack::Metric(int port, const std::string& name, const std::string& labels) {
  HttpResult r = HttpRequest(port, "GET", "/metrics");
  std::istringstream in(r.body);
  double sum = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    if (line.compare(0, name.size(), name) != 0) continue;
    const char next = line.size() > name.size() ? line[name.size()] : ' ';
    if (next != ' ' && next != '{') continue;  // a longer metric name
    if (!labels.empty() && line.find(labels) == std::string::npos) continue;
    sum += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return sum;
}

nlohmann::json Generate(const std::string& prompt, int max_tokens, const std::string& model,
                        const std::vector<std::string>& extra) {
  std::vector<std::string> args = {kPdserve,        "generate",
                                   "--model",       model,
                                   "--device",      "cpu",
                                   "--prompt",      prompt,
                                   "--max-tokens",  std::to_string(max_tokens),
                                   "--temperature", "0",
                                   "--ignore-eos",  "--json",
                                   "--threads",     "1"};
  args.insert(args.end(), extra.begin(), extra.end());
  CommandResult r = RunCommand(args);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return nlohmann::json::parse(r.out, nullptr, false);
}

void ExpectSameAsGenerate(LocalStack& stack, const std::string& prompt, int max_tokens,
                          const std::vector<std::string>& generate_flags) {
  SCOPED_TRACE(prompt.substr(0, 60));
  nlohmann::json want = Generate(prompt, max_tokens, stack.model(), generate_flags);
  ASSERT_TRUE(want.is_object());
  auto [status, got] = stack.Post(
      "/v1/completions",
      {{"prompt", prompt}, {"max_tokens", max_tokens}, {"temperature", 0}, {"ignore_eos", true}});
  ASSERT_EQ(status, 200) << got.dump();
  EXPECT_EQ(got["choices"][0]["text"], want["text"])
      << "prompt tokens " << want["prompt_token_ids"].size();
  EXPECT_EQ(got["usage"]["prompt_tokens"], want["prompt_token_ids"].size());
  EXPECT_EQ(got["usage"]["completion_tokens"], want["token_ids"].size());
}

void ExpectKvMoved(const WorkerProc& prefill, const WorkerProc& decode) {
  EXPECT_GT(LocalStack::Metric(decode.metrics_port, "pdserve_kv_transfer_bytes_total",
                               "direction=\"in\""),
            0);
  EXPECT_GT(LocalStack::Metric(prefill.metrics_port, "pdserve_kv_transfer_bytes_total",
                               "direction=\"out\""),
            0);
}

}  // namespace pdserve::testing
