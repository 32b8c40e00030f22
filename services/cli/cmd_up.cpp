// pdserve up: the whole local stack in one command. Starts the router and the
// prefill/decode workers as child processes of this binary, waits until the
// router answers /ready and every worker /health, prints where to reach them,
// and stops them all on Ctrl-C or SIGTERM. A child that dies takes the stack
// down with a non-zero exit and the child's last log lines on stderr, so a
// broken start never looks like a running one.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/dtype.h"
#include "common/flags.h"
#include "common/http/http_client.h"
#include "common/http/http_server.h"
#include "common/logging.h"
#include "common/read_file.h"
#include "common/signals.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/kv_tier_store.h"
#include "engine/make_model.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "kernels/backend_factory.h"
#include "services/cli/command.h"
#include "services/cli/kv_eviction_flags.h"
#include "services/cli/structured_flags.h"
#include "services/router/openai/reasoning.h"
#include "services/router/openai/tool_calls.h"
#include "services/router/policy.h"
#include "transport/control/handshake.h"

namespace pdserve::cli {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct Child {
  std::string name;  // "router", "prefill-0", "decode-1"
  std::string log_path;
  pid_t pid = -1;
  std::optional<int> exit_code;  // 128 + signal when killed
  int port = 0;                  // HTTP port (router) or metrics port (worker), once known
  bool up = false;               // answered /ready (router) or /health (worker)
};

std::string Describe(int code) {
  return code > 128 ? "killed by signal " + std::to_string(code - 128)
                    : "exit code " + std::to_string(code);
}

// The last `n` lines of a log file.
std::string Tail(const std::string& path, size_t n) {
  std::ifstream in(path);
  std::deque<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    lines.push_back(std::move(line));
    if (lines.size() > n) lines.pop_front();
  }
  std::string out;
  for (const auto& l : lines) out += "  | " + l + "\n";
  return out.empty() ? "  | (empty log)\n" : out;
}

std::string ReadFile(const std::string& path) {
  auto text = ReadRegularFile(path);
  return text.ok() ? std::move(*text) : std::string();
}

// A fresh cluster secret for this stack's control plane, readable by the
// owner only; every child proves it to the others.
Status WriteClusterSecret(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return Status::Unavailable("cannot write " + path + ": " + std::strerror(errno));
  const std::string secret = control::ClusterSecret::Generate() + "\n";
  const bool ok = ::fchmod(fd, 0600) == 0 &&
                  ::write(fd, secret.data(), secret.size()) == static_cast<ssize_t>(secret.size());
  const int err = errno;
  ::close(fd);
  if (!ok) return Status::Unavailable("cannot write " + path + ": " + std::strerror(err));
  return Status::Ok();
}

// Runs this binary with `args`; stdout and stderr go to the child's log.
Status Spawn(Child& child, const std::vector<std::string>& args) {
  static const std::string self = fs::read_symlink("/proc/self/exe").string();
  const int log_fd = ::open(child.log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (log_fd < 0)
    return Status::Unavailable("cannot write " + child.log_path + ": " + std::strerror(errno));
  std::vector<std::string> argv_storage = {self};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_storage) argv.push_back(a.data());
  argv.push_back(nullptr);

  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(log_fd);
    return Status::Unavailable(std::string("fork: ") + std::strerror(errno));
  }
  if (pid == 0) {
    // Children must not outlive a `pdserve up` that was killed outright.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (::getppid() != parent) ::_exit(1);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);  // the parent blocks SIGINT/SIGTERM
    ::dup2(log_fd, STDOUT_FILENO);
    ::dup2(log_fd, STDERR_FILENO);
    ::execv(argv[0], argv.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(log_fd);
  child.pid = pid;
  return Status::Ok();
}

// Reaps children that exited; returns the first one that did.
Child* ReapExited(std::vector<Child>& children) {
  Child* first = nullptr;
  for (auto& c : children) {
    if (c.exit_code) continue;
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (!first) first = &c;
    }
  }
  return first;
}

// SIGTERM to every child (workers drain), then SIGKILL whatever is left at
// the deadline.
void StopAll(std::vector<Child>& children, std::chrono::seconds grace) {
  for (auto& c : children)
    if (!c.exit_code) ::kill(c.pid, SIGTERM);
  const auto deadline = Clock::now() + grace;
  auto last_note = Clock::now();
  while (true) {
    ReapExited(children);
    std::vector<std::string> left;
    for (auto& c : children)
      if (!c.exit_code) left.push_back(c.name);
    if (left.empty()) return;
    if (Clock::now() >= deadline) {
      for (auto& c : children) {
        if (c.exit_code) continue;
        std::fprintf(stderr, "pdserve up: %s did not stop in %llds, killing it\n", c.name.c_str(),
                     static_cast<long long>(grace.count()));
        ::kill(c.pid, SIGKILL);
        int status;
        ::waitpid(c.pid, &status, 0);
        c.exit_code = 128 + SIGKILL;
      }
      return;
    }
    if (Clock::now() - last_note >= 5s) {
      std::string names;
      for (const auto& n : left) names += (names.empty() ? "" : ", ") + n;
      std::fprintf(stderr, "pdserve up: waiting for %s to finish running requests\n",
                   names.c_str());
      last_note = Clock::now();
    }
    std::this_thread::sleep_for(50ms);
  }
}

// The port a child printed in its log ("on http :8000", "metrics :9100").
std::optional<int> PortFromLog(const Child& c, const std::regex& pattern) {
  std::smatch m;
  const std::string log = ReadFile(c.log_path);
  if (!std::regex_search(log, m, pattern)) return std::nullopt;
  return std::stoi(m[1].str());
}

bool Answers(const std::string& host, int port, const std::string& path) {
  http::HttpConnection conn(host, port);
  auto r = conn.Send("GET", path, {}, {}, 1s);
  return r.ok() && r->status == 200;
}

// The router is ready for the whole stack once every worker has registered
// and synced its cache index; before that, requests would all land on the
// first worker or skip the prefill pool.
bool RouterSeesAll(const std::string& host, int port, int64_t prefill, int64_t decode) {
  http::HttpConnection conn(host, port);
  auto r = conn.Send("GET", "/ready", {}, {}, 1s);
  if (!r.ok() || r->status != 200) return false;
  auto j = nlohmann::json::parse(r->body, nullptr, false);
  return j.is_object() && j.value("prefill_workers", -1) >= prefill &&
         j.value("decode_workers", -1) >= decode;
}

std::string LocalHost(const std::string& listen_host) {
  return listen_host == "0.0.0.0" || listen_host.empty() ? "127.0.0.1" : listen_host;
}

int Fail(std::vector<Child>& children, const Child& culprit, const std::string& what) {
  std::fprintf(stderr, "pdserve up: %s %s; last lines of %s:\n%s", culprit.name.c_str(),
               what.c_str(), culprit.log_path.c_str(), Tail(culprit.log_path, 20).c_str());
  StopAll(children, 10s);
  return 1;
}

int RunUp(int argc, char** argv) {
  BlockTerminationSignals();
  int64_t prefill = 1, decode = 1, port = 8000, control_port = 9000;
  int64_t prefill_metrics_port = 9100, decode_metrics_port = 9200, threads = 0;
  int64_t kv_cache_bytes = 64ll << 20, start_timeout_s = 120, stop_timeout_s = 40;
  int64_t max_local_prefill = 512, max_prefill_queue_tokens = 0, tensor_parallel = 1;
  int64_t kv_host_cache_bytes = 0, kv_disk_cache_bytes = 0;
  std::string kv_disk_cache_dir, kv_disk_write;
  int64_t kv_disk_write_queue = 1024, kv_disk_write_bps = 0;
  std::string model, model_id, dir = ".pdserve", host = "127.0.0.1", policy = "kv";
  std::string copy_cost = "0";
  std::string log_level = "info", device = "auto", load_format = "safetensors";
  std::string kv_dtype = "fp32";
  std::string tool_call_parser;
  std::string generation_config = "auto";
  bool stream_chunks = true, expert_parallel = false;
  FlagSet flags("up",
                "Start a local stack: the router plus prefill and decode workers as child "
                "processes. Ctrl-C or SIGTERM stops them all.");
  flags.SetEnvPrefix("PDSERVE_");
  flags.AddInt("prefill", &prefill, "prefill workers (0: decode workers prefill locally)");
  flags.AddInt("decode", &decode, "decode workers (at least 1)");
  flags.AddString("model", &model,
                  "model folder (default: the tiny test model, written under --dir on first use)");
  flags.AddString("model-id", &model_id, "served model name (default: the model's own)");
  flags.AddInt("port", &port, "router HTTP port: the OpenAI API and /metrics (0: any free port)");
  flags.AddInt("control-port", &control_port, "router port the workers connect to (0: any)");
  flags.AddInt("prefill-metrics-port", &prefill_metrics_port,
               "metrics port of the first prefill worker, the next ones count up (0: any)");
  flags.AddInt("decode-metrics-port", &decode_metrics_port,
               "metrics port of the first decode worker, the next ones count up (0: any)");
  flags.AddAddress("host", &host, "address the router's HTTP port listens on");
  flags.AddString("policy", &policy, "routing policy: " + router::PolicyChoices());
  flags.AddInt("max-local-prefill", &max_local_prefill,
               "prompt tokens a decode worker computes itself; more go to a prefill worker");
  flags.AddInt("max-prefill-queue-tokens", &max_prefill_queue_tokens,
               "prompt tokens queued on a prefill worker past which it takes no new prompt "
               "(0: no bound)");
  flags.AddString("replication-copy-cost", &copy_cost,
                  "kv: hot-prefix replication's copy price, as the router's "
                  "--replication-copy-cost (0: off)");
  flags.AddString("device", &device, "device of every worker: auto|cpu|cuda|cuda:N");
  flags.AddString("load-format", &load_format,
                  "workers' weights: safetensors|dummy (random, for benchmarks)");
  flags.AddInt("threads", &threads, "compute threads per CPU worker (0: the cores shared out)");
  flags.AddBool("expert-parallel", &expert_parallel,
                "with --tensor-parallel N: whole experts per rank (docs/tensor-parallel.md)");
  flags.AddInt("tensor-parallel", &tensor_parallel,
               "ranks of every worker, 1 to 8 (docs/tensor-parallel.md); prefill workers "
               "hand KV to decode workers rank to rank");
  flags.AddBool("kv-stream-chunks", &stream_chunks,
                "prefill workers send each finished chunk's KV while the next computes");
  flags.AddBytes("kv-cache-bytes", &kv_cache_bytes, "KV cache memory per worker");
  flags.AddString("kv-dtype", &kv_dtype,
                  "KV cache type of every worker: " + std::string(kKvDTypeChoices));
  flags.AddBytes("kv-host-cache-bytes", &kv_host_cache_bytes,
                 "host-memory KV tier per worker (0: none)");
  flags.AddString("kv-disk-cache-dir", &kv_disk_cache_dir,
                  "folder of the disk KV tiers: each worker's in a subfolder named after it, so "
                  "that a restarted stack comes back warm (\"\": none)");
  flags.AddBytes("kv-disk-cache-bytes", &kv_disk_cache_bytes,
                 "disk KV tier per worker (with --kv-disk-cache-dir)");
  flags.AddString("kv-disk-write", &kv_disk_write,
                  "through|back: with both tiers, copy host-tier blocks to disk as they arrive, or "
                  "only as the host tier evicts them (default: through)");
  flags.AddInt("kv-disk-write-queue", &kv_disk_write_queue,
               "through: host-tier blocks that may wait for their disk copy, per worker");
  flags.AddBytes("kv-disk-write-bytes-per-second", &kv_disk_write_bps,
                 "through: pace of each worker's background disk copies (0: unpaced)");
  std::string chat_template;
  flags.AddString("chat-template", &chat_template,
                  "router: Jinja chat template file to use instead of the model's");
  std::string allowed_origins;
  flags.AddString("allowed-origins", &allowed_origins,
                  "router: comma-separated origins whose web pages may call the API from a "
                  "browser (CORS), or '*' for any; default: none");
  flags.AddString("tool-call-parser", &tool_call_parser,
                  "router: how the model writes tool calls "
                  "(hermes|qwen3|qwen3_coder|mistral|llama3_json|deepseek_v3|deepseek_v31; "
                  "default: from the chat template)");
  std::string scheduling_policy = "fcfs";
  flags.AddString("scheduling-policy", &scheduling_policy,
                  "router: fcfs (arrival order; a request's 'priority' is refused) or priority "
                  "(vLLM's: lower 'priority' first, preempting lower ones)");
  std::string reasoning_parser;
  flags.AddString("reasoning-parser", &reasoning_parser,
                  "router: how a reasoning model marks its thoughts (deepseek_r1|qwen3; "
                  "default: none, thoughts stay in the content)");
  flags.AddString("generation-config", &generation_config,
                  "router: sampling a request leaves out: auto (the model's "
                  "generation_config.json) or none (OpenAI's defaults)");
  StructuredFlags structured;  // passed on to the router and the workers
  structured.AddTo(flags, /*worker=*/true);
  KvEvictionFlags eviction;  // passed on to the workers
  eviction.AddTo(flags);
  flags.AddString("dir", &dir, "folder for the logs (DIR/logs) and the default model");
  flags.AddInt("start-timeout", &start_timeout_s, "seconds to wait for the stack to be ready");
  flags.AddInt("stop-timeout", &stop_timeout_s,
               "seconds to let workers drain on stop before killing them");
  flags.AddString("log-level", &log_level, "log level of the router and workers");
  flags.SetEpilog("Example: pdserve up --prefill 2 --decode 1 --port 8000");
  ParseFlagsOrExit(flags, argc, argv);

  if (prefill < 0 || prefill > 64) UsageError("up", "--prefill must be in [0, 64]");
  if (decode < 1 || decode > 64) UsageError("up", "--decode must be in [1, 64]");
  for (auto [name, p] : {std::pair{"port", port},
                         {"control-port", control_port},
                         {"prefill-metrics-port", prefill_metrics_port},
                         {"decode-metrics-port", decode_metrics_port}}) {
    if (p < 0 || p > 65535) UsageError("up", std::string("--") + name + " must be in [0, 65535]");
  }
  if (prefill_metrics_port > 0 && prefill_metrics_port + prefill - 1 > 65535)
    UsageError("up", "--prefill-metrics-port leaves no room for every prefill worker");
  if (decode_metrics_port > 0 && decode_metrics_port + decode - 1 > 65535)
    UsageError("up", "--decode-metrics-port leaves no room for every decode worker");
  (void)structured.OptionsOrExit("up");  // out-of-range values fail here, not in a child
  (void)eviction.EvictionOrExit("up");   // bad budgets fail here, not in a child
  if (threads < 0 || threads > kMaxThreadsFlag) UsageError("up", "--threads must be in [0, 1024]");
  if (tensor_parallel < 1 || tensor_parallel > 8)
    UsageError("up", "--tensor-parallel must be 1 to 8, got " + std::to_string(tensor_parallel));
  if (expert_parallel && tensor_parallel == 1) {
    UsageError("up", "--expert-parallel needs --tensor-parallel 2 or more");
  }
  if (max_local_prefill < 0) UsageError("up", "--max-local-prefill must not be negative");
  if (max_prefill_queue_tokens < 0) {
    UsageError("up", "--max-prefill-queue-tokens must not be negative");
  }
  if (char* end = nullptr; copy_cost.empty() || !(std::strtod(copy_cost.c_str(), &end) >= 0) ||
                           *end != '\0' ||
                           !std::isfinite(std::strtod(copy_cost.c_str(), nullptr))) {
    UsageError("up", "--replication-copy-cost must be a non-negative number");
  }
  if (dir.empty()) UsageError("up", "--dir must not be empty");
  if (kv_cache_bytes <= 0) UsageError("up", "--kv-cache-bytes must be positive");
  if (kv_host_cache_bytes < 0) UsageError("up", "--kv-host-cache-bytes must not be negative");
  if (kv_disk_cache_dir.empty() != (kv_disk_cache_bytes <= 0)) {
    UsageError("up", "--kv-disk-cache-dir and a positive --kv-disk-cache-bytes go together");
  }
  if (!kv_disk_write.empty() && !ParseKvDiskWrite(kv_disk_write))
    UsageError("up", "--kv-disk-write must be through or back, not '" + kv_disk_write + "'");
  if (!kv_disk_write.empty() && kv_disk_cache_dir.empty())
    UsageError("up", "--kv-disk-write needs a disk tier (--kv-disk-cache-dir)");
  if (kv_disk_write_queue <= 0 || kv_disk_write_bps < 0) {
    UsageError("up",
               "--kv-disk-write-queue must be positive, --kv-disk-write-bytes-per-second not "
               "negative");
  }
  // What the router and the workers would refuse is refused here, before
  // any child starts.
  if (const auto& names = router::PolicyNames();
      std::find(names.begin(), names.end(), policy) == names.end()) {
    UsageError("up", "--policy: unknown routing policy '" + policy +
                         "' (valid: " + router::PolicyChoices() + ")");
  }
  if (generation_config != "auto" && generation_config != "none")
    UsageError("up", "--generation-config must be auto or none, got '" + generation_config + "'");
  if (!chat_template.empty() && !std::ifstream(chat_template))
    UsageError("up", "--chat-template: cannot read " + chat_template);
  if (auto origins = http::ParseCorsOrigins(allowed_origins); !origins.ok())
    UsageError("up", "--allowed-origins: " + origins.status().message());
  if (!tool_call_parser.empty()) {
    if (auto parser = router::ParseToolParserName(tool_call_parser); !parser.ok())
      UsageError("up", "--tool-call-parser: " + parser.status().message());
  }
  if (!reasoning_parser.empty()) {
    if (auto parser = router::ParseReasoningParserName(reasoning_parser); !parser.ok())
      UsageError("up", "--reasoning-parser: " + parser.status().message());
  }
  if (scheduling_policy != "fcfs" && scheduling_policy != "priority")
    UsageError("up",
               "--scheduling-policy must be fcfs or priority, got '" + scheduling_policy + "'");
  if (!ParseLoadFormat(load_format))
    UsageError("up", "--load-format must be safetensors or dummy, not '" + load_format + "'");
  if (auto resolved = kernels::ResolveDevice(device); !resolved.ok())
    UsageError("up", "--device: " + resolved.status().message());
  if (!ParseDType(kv_dtype)) {
    UsageError("up",
               "--kv-dtype: expected " + std::string(kKvDTypeChoices) + ", got '" + kv_dtype + "'");
  }
  if (start_timeout_s < 1 || stop_timeout_s < 1 || start_timeout_s > kMaxTimeoutSecondsFlag ||
      stop_timeout_s > kMaxTimeoutSecondsFlag) {
    UsageError("up", "--start-timeout and --stop-timeout must be in [1, 31536000] (a year)");
  }
  LogLevel level;
  if (!ParseLogLevel(log_level, &level))
    UsageError("up", "--log-level: unknown level '" + log_level + "'");

  std::error_code ec;
  fs::create_directories(dir + "/logs", ec);
  if (ec) {
    std::fprintf(stderr, "pdserve up: cannot create %s/logs: %s\n", dir.c_str(),
                 ec.message().c_str());
    return 1;
  }
  if (model.empty()) {
    model = dir + "/models/tiny";
    if (!fs::exists(model + "/config.json")) {
      std::printf("pdserve up: writing the tiny test model to %s\n", model.c_str());
      auto spec = PresetModelSpec("tiny");
      Status st = spec.ok() ? WriteModel(*spec, model) : spec.status();
      if (!st.ok()) {
        std::fprintf(stderr, "pdserve up: %s\n", st.message().c_str());
        return 1;
      }
    }
  } else if (!fs::is_directory(model)) {
    UsageError("up", "--model: '" + model + "' is not a folder");
  }
  // A size the model cannot split fails here, before any child starts.
  if (tensor_parallel > 1) {
    if (auto config = LoadModelConfig(model); config.ok()) {
      if (Status split =
              CheckTensorParallel(*config, static_cast<int>(tensor_parallel), expert_parallel);
          !split.ok()) {
        UsageError("up", "--tensor-parallel: " + split.message());
      }
    }
  }

  const std::string secret_file = dir + "/cluster-secret";
  if (Status st = WriteClusterSecret(secret_file); !st.ok()) {
    std::fprintf(stderr, "pdserve up: %s\n", st.message().c_str());
    return 1;
  }
  if (threads == 0) {
    const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
    threads = std::max<int64_t>(1, cores / (prefill + decode));
  }

  std::vector<Child> children;
  children.reserve(static_cast<size_t>(1 + prefill + decode));
  auto add = [&](std::string name) -> Child& {
    Child& c = children.emplace_back();
    c.name = std::move(name);
    c.log_path = dir + "/logs/" + c.name + ".log";
    return c;
  };
  auto start = [&](Child& c, const std::vector<std::string>& args) {
    if (Status st = Spawn(c, args); !st.ok()) {
      std::fprintf(stderr, "pdserve up: starting %s: %s\n", c.name.c_str(), st.message().c_str());
      StopAll(children, 10s);
      return false;
    }
    std::printf("pdserve up: started %s (pid %d, log %s)\n", c.name.c_str(), c.pid,
                c.log_path.c_str());
    std::fflush(stdout);
    return true;
  };

  std::vector<std::string> router_args = {"router",
                                          "--model",
                                          model,
                                          "--host",
                                          host,
                                          "--port",
                                          std::to_string(port),
                                          "--control-port",
                                          std::to_string(control_port),
                                          "--policy",
                                          policy,
                                          "--max-local-prefill",
                                          std::to_string(max_local_prefill),
                                          "--max-prefill-queue-tokens",
                                          std::to_string(max_prefill_queue_tokens),
                                          "--log-level",
                                          log_level};
  if (!model_id.empty()) router_args.insert(router_args.end(), {"--model-id", model_id});
  if (!tool_call_parser.empty()) {
    router_args.insert(router_args.end(), {"--tool-call-parser", tool_call_parser});
  }
  if (!reasoning_parser.empty())
    router_args.insert(router_args.end(), {"--reasoning-parser", reasoning_parser});
  router_args.insert(router_args.end(), {"--scheduling-policy", scheduling_policy});
  if (!allowed_origins.empty())
    router_args.insert(router_args.end(), {"--allowed-origins", allowed_origins});
  if (!chat_template.empty())
    router_args.insert(router_args.end(), {"--chat-template", chat_template});
  router_args.insert(router_args.end(), {"--generation-config", generation_config});
  for (std::string& a : structured.Args(/*worker=*/false)) router_args.push_back(std::move(a));
  router_args.insert(router_args.end(), {"--cluster-secret-file", secret_file});
  router_args.insert(router_args.end(), {"--replication-copy-cost", copy_cost});
  if (!start(add("router"), router_args)) return 1;

  // Workers need the control port, which the router reports once it listens.
  static const std::regex kRouterPorts(R"(on http :(\d+), control :(\d+))");
  int http_port = 0, router_control_port = 0;
  const auto deadline = Clock::now() + std::chrono::seconds(start_timeout_s);
  while (router_control_port == 0) {
    if (Child* dead = ReapExited(children))
      return Fail(children, *dead, "exited at start (" + Describe(*dead->exit_code) + ")");
    if (WaitForTerminationSignalFor(50ms)) {
      StopAll(children, std::chrono::seconds(stop_timeout_s));
      return 0;
    }
    if (Clock::now() > deadline) return Fail(children, children[0], "did not start in time");
    std::smatch m;
    const std::string log = ReadFile(children[0].log_path);
    if (std::regex_search(log, m, kRouterPorts)) {
      http_port = std::stoi(m[1].str());
      router_control_port = std::stoi(m[2].str());
    }
  }
  children[0].port = http_port;

  auto worker_args = [&](const std::string& role, const std::string& id, int64_t metrics_port) {
    std::vector<std::string> args = {
        "worker",
        "--role",
        role,
        "--model",
        model,
        "--router",
        "127.0.0.1:" + std::to_string(router_control_port),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        std::to_string(metrics_port),
        "--worker-id",
        id,
        "--threads",
        std::to_string(threads),
        "--kv-cache-bytes",
        std::to_string(kv_cache_bytes),
        "--kv-dtype",
        kv_dtype,
        "--device",
        device,
        "--tensor-parallel",
        std::to_string(tensor_parallel),
        "--load-format",
        load_format,
        std::string("--kv-stream-chunks=") + (stream_chunks ? "true" : "false"),
        std::string("--expert-parallel=") + (expert_parallel ? "true" : "false"),
        "--log-level",
        log_level};
    if (!model_id.empty()) args.insert(args.end(), {"--model-id", model_id});
    if (kv_host_cache_bytes > 0) {
      args.insert(args.end(), {"--kv-host-cache-bytes", std::to_string(kv_host_cache_bytes)});
    }
    if (!kv_disk_cache_dir.empty()) {
      args.insert(args.end(),
                  {"--kv-disk-cache-dir", kv_disk_cache_dir + "/" + id, "--kv-disk-cache-bytes",
                   std::to_string(kv_disk_cache_bytes), "--kv-disk-write-queue",
                   std::to_string(kv_disk_write_queue), "--kv-disk-write-bytes-per-second",
                   std::to_string(kv_disk_write_bps)});
      if (!kv_disk_write.empty()) args.insert(args.end(), {"--kv-disk-write", kv_disk_write});
    }
    for (std::string& a : structured.Args(/*worker=*/true)) args.push_back(std::move(a));
    for (std::string& a : eviction.Args()) args.push_back(std::move(a));
    args.insert(args.end(), {"--cluster-secret-file", secret_file});
    return args;
  };
  for (int64_t i = 0; i < prefill; ++i) {
    const std::string id = "prefill-" + std::to_string(i);
    if (!start(add(id),
               worker_args("prefill", id, prefill_metrics_port ? prefill_metrics_port + i : 0)))
      return 1;
  }
  for (int64_t i = 0; i < decode; ++i) {
    const std::string id = "decode-" + std::to_string(i);
    if (!start(add(id),
               worker_args("decode", id, decode_metrics_port ? decode_metrics_port + i : 0)))
      return 1;
  }

  // Ready: every worker answers /health and the router lists them all as synced.
  static const std::regex kMetricsPort(R"(metrics :(\d+))");
  const std::string local = LocalHost(host);
  while (!std::all_of(children.begin(), children.end(), [](const Child& c) { return c.up; })) {
    if (Child* dead = ReapExited(children))
      return Fail(children, *dead, "exited at start (" + Describe(*dead->exit_code) + ")");
    if (WaitForTerminationSignalFor(100ms)) {
      StopAll(children, std::chrono::seconds(stop_timeout_s));
      return 0;
    }
    for (auto& c : children) {
      if (c.up) continue;
      if (c.port == 0) c.port = PortFromLog(c, kMetricsPort).value_or(0);
      if (c.port == 0) continue;
      c.up = &c == &children[0] ? RouterSeesAll(local, c.port, prefill, decode)
                                : Answers("127.0.0.1", c.port, "/health");
    }
    if (Clock::now() > deadline) {
      for (auto& c : children)
        if (!c.up) return Fail(children, c, "was not ready in time");
    }
  }

  std::string served = model_id;
  {
    http::HttpConnection conn(local, http_port);
    auto models = conn.Send("GET", "/v1/models", {}, {}, 5s);
    if (models.ok() && models->status == 200) {
      auto j = nlohmann::json::parse(models->body, nullptr, false);
      if (!j.is_discarded() && j.contains("data") && !j["data"].empty())
        served = j["data"][0].value("id", served);
    }
  }
  const std::string base = "http://" + local + ":" + std::to_string(http_port);
  std::string prefill_targets, decode_targets, worker_metrics;
  for (const auto& c : children) {
    if (&c == &children[0]) continue;
    const std::string addr = "127.0.0.1:" + std::to_string(c.port);
    std::string& list = c.name.rfind("prefill", 0) == 0 ? prefill_targets : decode_targets;
    list += (list.empty() ? "" : ",") + addr;
    worker_metrics += "           http://" + addr + "/metrics (" + c.name + ")\n";
  }
  // Chat needs a chat template: without one the example is a completion.
  bool chat = !chat_template.empty();
  if (!chat) {
    auto tokenizer = Tokenizer::Load(model);
    chat = tokenizer.ok() && !(*tokenizer)->chat_template().empty();
  }
  nlohmann::json example = {{"model", served}, {"max_tokens", 16}};
  if (chat) {
    example["messages"] = {{{"role", "user"}, {"content", "Hello!"}}};
  } else {
    example["prompt"] = "Once upon a time";
  }
  const std::string body = example.dump();
  const char* endpoint = chat ? "/v1/chat/completions" : "/v1/completions";
  std::printf(
      "\npdserve up: ready at %s (%lld prefill, %lld decode worker%s, model %s)\n"
      "  try:     curl -s %s%s -H 'Content-Type: application/json' -d '%s'\n"
      "  metrics: %s/metrics (router)\n%s"
      "  logs:    %s/logs/\n"
      "  prometheus, from a pdserve checkout: deploy/local/prometheus.sh --router %s:%d "
      "--prefill '%s' --decode '%s'\n"
      "Ctrl-C stops the stack.\n",
      base.c_str(), static_cast<long long>(prefill), static_cast<long long>(decode),
      decode == 1 ? "" : "s", served.c_str(), base.c_str(), endpoint, body.c_str(), base.c_str(),
      worker_metrics.c_str(), dir.c_str(), local.c_str(), http_port, prefill_targets.c_str(),
      decode_targets.c_str());
  std::fflush(stdout);

  while (true) {
    if (auto sig = WaitForTerminationSignalFor(200ms)) {
      std::printf("pdserve up: %s, stopping the stack\n", strsignal(*sig));
      std::fflush(stdout);
      StopAll(children, std::chrono::seconds(stop_timeout_s));
      std::printf("pdserve up: stopped\n");
      return 0;
    }
    if (Child* dead = ReapExited(children))
      return Fail(children, *dead, "exited (" + Describe(*dead->exit_code) + ")");
  }
}

}  // namespace

PDSERVE_COMMAND("up", "start a local router with prefill and decode workers", RunUp);

}  // namespace pdserve::cli
