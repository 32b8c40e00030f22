// A local serving stack of real processes for end-to-end tests: one router
// and any number of prefill/decode workers on loopback, on the tiny model.
#pragma once

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/http_client.h"
#include "tests/support/process.h"
#include "tests/support/test_models.h"

namespace pdserve::testing {

// The binary under test; PDSERVE_BIN overrides the build's (the GPU kit runs
// these tests from another folder).
inline const std::string kPdserve =
    std::getenv("PDSERVE_BIN") ? std::getenv("PDSERVE_BIN") : PDSERVE_BIN_PATH;

struct WorkerProc {
  std::string id;
  std::string role;
  int metrics_port = 0;
  ChildProcess proc;
};

class LocalStack {
 public:
  // Writes the tiny model once per test binary.
  static const std::string& Model();

  explicit LocalStack(std::string name) : name_(std::move(name)) {}

  // The model folder the router and the workers started from now on serve
  // (default: Model()).
  void SetModel(std::string dir) { model_ = std::move(dir); }
  const std::string& model() const { return model_.empty() ? Model() : model_; }

  // Starts the router; extra flags are appended. A control port of 0 picks
  // a free one; a restarted router passes the previous control_port().
  void StartRouter(const std::vector<std::string>& extra = {}, int control_port = 0);
  // SIGKILLs the router and starts a new one on the same control port (the
  // workers reconnect to it on their own); `extra` as for StartRouter.
  void RestartRouter(const std::vector<std::string>& extra = {});
  // Starts a worker and waits until the router lists it as synced (with
  // `expect_synced` false: only until it serves metrics, for a worker the
  // router is to refuse).
  WorkerProc& StartWorker(const std::string& role, const std::vector<std::string>& extra = {},
                          bool expect_synced = true);
  // Workers started from now on run under `prefix`, e.g. `ip netns exec NAME`
  // to place them in a network namespace (empty: run directly).
  void SetWorkerLauncher(std::vector<std::string> prefix) { worker_launcher_ = std::move(prefix); }
  // Environment entries of the workers started from now on (test hooks).
  void SetWorkerEnv(std::map<std::string, std::string> env) { worker_env_ = std::move(env); }
  // Workers move KV over loopback only (UCX_NET_DEVICES=lo) unless this was
  // called: interfaces that parallel tests add and remove (the chaos tests'
  // veth pairs) would otherwise enter every worker's UCX device list, where
  // a cut one stalls the connections over it. For stacks that span network
  // namespaces, and tests of interfaces that come and go.
  void UseEveryNetworkInterface() { every_interface_ = true; }
  // Waits for /ready.
  bool WaitReady(std::chrono::milliseconds timeout = std::chrono::seconds(60));

  // The cluster secret file every process of this stack gets, unless its
  // extra flags name --cluster-secret-file or --insecure-control-plane.
  const std::string& SecretFile();

  int http_port() const { return http_port_; }
  int control_port() const { return control_port_; }
  ChildProcess& router() { return router_; }
  std::vector<std::unique_ptr<WorkerProc>>& workers() { return workers_; }

  // POST helper: parsed JSON body (null when not JSON) plus the status.
  std::pair<int, nlohmann::json> Post(const std::string& path, const nlohmann::json& body);
  // Greedy /v1/completions of `max_tokens` (EOS ignored) for every prompt,
  // all in flight at once (a client thread each); results in prompt order.
  std::vector<std::pair<int, nlohmann::json>> CompleteTogether(
      const std::vector<std::string>& prompts, int max_tokens);
  // One metric value scraped from `port` (sum over label sets matching `labels`).
  static double Metric(int port, const std::string& name, const std::string& labels = "");

 private:
  std::vector<std::string> WithSecurity(std::vector<std::string> argv,
                                        const std::vector<std::string>& extra);

  std::string name_;
  std::string model_;
  std::string dir_;
  std::string secret_file_;
  ChildProcess router_;
  int router_starts_ = 0;
  int http_port_ = 0;
  int control_port_ = 0;
  std::vector<std::unique_ptr<WorkerProc>> workers_;
  std::vector<std::string> worker_launcher_;
  std::map<std::string, std::string> worker_env_;
  bool every_interface_ = false;
};

// `pdserve generate --json` for the same prompt, greedy (on the CPU), with
// `extra` flags (e.g. --kv-dtype).
nlohmann::json Generate(const std::string& prompt, int max_tokens,
                        const std::string& model = LocalStack::Model(),
                        const std::vector<std::string>& extra = {});

// A greedy completion through the stack's router equals `pdserve generate`
// on the CPU with the stack's model (and `generate_flags`): text, prompt and
// completion tokens.
void ExpectSameAsGenerate(LocalStack& stack, const std::string& prompt, int max_tokens,
                          const std::vector<std::string>& generate_flags = {});

// KV blocks went from `prefill` to `decode` (their transfer byte counters).
void ExpectKvMoved(const WorkerProc& prefill, const WorkerProc& decode);

}  // namespace pdserve::testing
