// pdserve router: the OpenAI-compatible front door and KV-aware router.
#include <cstdio>
#include <string>

#include "common/flags.h"
#include "common/http/http_server.h"
#include "common/logging.h"
#include "common/signals.h"
#include "services/cli/command.h"
#include "services/cli/control_security_flags.h"
#include "services/cli/structured_flags.h"
#include "services/router/openai/reasoning.h"
#include "services/router/openai/tool_calls.h"
#include "services/router/router_service.h"

namespace pdserve::cli {
namespace {

int RunRouter(int argc, char** argv) {
  BlockTerminationSignals();
  router::RouterServiceOptions o;
  int64_t http_port = o.http_port, control_port = o.control_port, metrics_port = o.metrics_port;
  int64_t http_threads = o.http_threads, max_concurrent = o.max_concurrent_requests;
  int64_t max_body = static_cast<int64_t>(o.max_body_bytes);
  int64_t timeout_s = o.request_timeout_ms / 1000, max_attempts = o.max_attempts;
  int64_t worker_stall_s = o.worker_stall_timeout_ms / 1000;
  std::string log_level = "info";
  int64_t drain_s = 25;
  FlagSet flags("router", "Serve the OpenAI API and route requests to prefill/decode workers.");
  flags.SetEnvPrefix("PDSERVE_");
  flags.AddString("model", &o.model_dir,
                  "model folder (tokenizer, chat template; config.json for the served name)");
  flags.AddString(
      "model-id", &o.model_id,
      "served model name (default: config.json's _name_or_path, else the model folder's name)");
  flags.AddAddress("host", &o.host, "address to listen on");
  flags.AddInt("drain-timeout", &drain_s,
               "seconds SIGTERM lets requests in flight finish (new ones get 503 and /ready "
               "fails meanwhile) before failing the rest");
  flags.AddInt("port", &http_port, "HTTP port of the OpenAI API (0: any free port)");
  flags.AddInt("control-port", &control_port, "port workers connect to (0: any free port)");
  flags.AddInt("metrics-port", &metrics_port,
               "separate port for /metrics (-1: serve it on --port)");
  flags.AddString("policy", &o.policy,
                  "routing policy: " + router::PolicyChoices() +
                      " (dynamo, llm-d, sglang, production-stack: those projects' default "
                      "KV-aware policies, see docs/routing.md)");
  flags.AddDouble("policy-temperature", &o.policy_temperature,
                  "softmax temperature of the kv policy (0: always the cheapest worker)");
  flags.AddDouble("host-tier-weight", &o.host_tier_weight,
                  "kv, dynamo: a prompt token in a worker's host-memory KV tier, against one in "
                  "its device pool (1) and one to compute (0)");
  flags.AddDouble("disk-tier-weight", &o.disk_tier_weight,
                  "kv, dynamo: a prompt token in a worker's disk KV tier, likewise");
  flags.AddDouble("replication-copy-cost", &o.replication_copy_cost,
                  "kv: price of copying one token of KV from a busy holder, in prompt tokens of "
                  "prefill (copy time / prefill time; e.g. 0.1); when a hot prefix's holders are "
                  "busier than that, a holder writes it to a less loaded worker (0: off)");
  flags.AddInt("replication-min-requests", &o.replication_min_requests,
               "kv: a prefix is copied only once this many requests (the one routed included) "
               "reached it as their longest cached prefix within --replication-window-s, so a "
               "conversation's own history stays with its holder; the same test marks the hot "
               "prefixes whose holders kv relieves by load where no copy can spread them (1-" +
                   std::to_string(router::kMaxCopyMinRequests) + ")");
  flags.AddDouble("replication-window-s", &o.replication_window_s,
                  "kv: the window of --replication-min-requests, in seconds");
  flags.AddInt("replication-max-inflight", &o.replication_max_inflight,
               "kv: copies in flight cluster-wide at full budget; the budget shrinks while "
               "copies go unused and grows while they are reused (0: one per two decode "
               "workers)");
  flags.AddDouble("replication-max-copy-tokens-per-s", &o.replication_max_copy_tokens_per_s,
                  "kv: copied prompt tokens per second cluster-wide at full budget (bytes per "
                  "second / the model's KV bytes per token), scaled like the in-flight budget "
                  "(0: no rate budget)");
  flags.AddInt("drain-push-blocks", &o.drain_push_blocks,
               "when a worker drains (SIGTERM), the most KV blocks of its most used recent "
               "prompts it writes to the surviving workers before it leaves (0: off)");
  flags.AddInt("max-local-prefill", &o.max_local_prefill,
               "the most prompt tokens a decode worker prefills itself: a request whose decode "
               "worker would compute more (cached prefix excluded) goes to a prefill worker; "
               "the router alone decides, workers follow");
  flags.AddInt("max-prefill-queue-tokens", &o.max_prefill_queue_tokens,
               "a prefill worker with more prompt tokens queued than this takes no new prompt; "
               "with none under it, the decode worker prefills itself (0: no bound)");
  flags.AddInt("block-size", &o.block_size, "tokens per KV block (must match the workers)");
  flags.AddString("api-key-file", &o.api_key_file, "file of accepted API keys, one per line");
  flags.AddBool("salt-per-api-key", &o.salt_per_api_key,
                "derive each request's cache salt from its API key, so that tenants never share "
                "cached prefixes or see each other's cache timing (needs --api-key-file)");
  flags.AddString("metrics-key-file", &o.metrics_key_file,
                  "file of keys /metrics requires as 'Authorization: Bearer KEY' (/health, "
                  "/live and /ready stay open)");
  flags.AddString("admin-key-file", &o.admin_key_file,
                  "file of keys the admin endpoints require as 'Authorization: Bearer KEY': POST "
                  "/admin/drain {\"worker\": NAME} stops routing to a worker and pushes its hot "
                  "prompts, POST /admin/undrain {\"worker\": NAME} puts it back; without it "
                  "there are no admin endpoints");
  int64_t max_json_depth = o.max_json_depth;
  flags.AddInt("max-json-depth", &max_json_depth, "deepest nesting accepted in a request body");
  flags.AddInt("http-threads", &http_threads, "HTTP I/O threads");
  flags.AddInt("max-concurrent-requests", &max_concurrent, "requests in flight before 503");
  std::string allowed_origins;
  flags.AddString("allowed-origins", &allowed_origins,
                  "comma-separated origins whose web pages may call the API from a browser "
                  "(CORS), or '*' for any; default: none");
  flags.AddBytes("max-body-bytes", &max_body, "largest accepted request body");
  flags.AddInt("request-timeout", &timeout_s,
               "seconds a request may wait for its next token (the first included) before it "
               "fails with 504");
  flags.AddInt("max-attempts", &max_attempts, "workers tried per request before it fails");
  flags.AddInt("worker-stall-timeout", &worker_stall_s,
               "seconds without a worker's load report (its engine loop sends them between "
               "steps) after which it gets no new requests until they resume (0: never)");
  flags.AddInt("max-snapshot-blocks", &o.max_snapshot_blocks,
               "largest KV capacity (and snapshot) a worker may register, in blocks");
  ControlSecurityFlags security;
  security.AddTo(flags);
  StructuredFlags structured;
  structured.AddTo(flags, /*worker=*/false);
  flags.AddString("chat-template", &o.chat_template_file,
                  "Jinja chat template file to use instead of the model's (a tool-calling "
                  "template, or one for a model without a template)");
  flags.AddString("tool-call-parser", &o.tool_call_parser,
                  "how the model writes tool calls: "
                  "hermes|qwen3|qwen3_coder|mistral|llama3_json|deepseek_v3|deepseek_v31 "
                  "(default: from the chat template's markers)");
  flags.AddString("reasoning-parser", &o.reasoning_parser,
                  "how a reasoning model marks its thoughts, returned apart from the answer: "
                  "deepseek_r1|qwen3 (default: none, thoughts stay in the content)");
  flags.AddString("scheduling-policy", &o.scheduling_policy,
                  "fcfs (requests run in arrival order; a request's 'priority' is refused) or "
                  "priority (vLLM's: lower 'priority' first, preempting lower ones)");
  flags.AddString("generation-config", &o.generation_config,
                  "sampling a request leaves out: auto (the model's generation_config.json: "
                  "temperature, top_p, top_k, min_p) or none (OpenAI's defaults)");
  flags.AddString("log-level", &log_level, "debug|info|warn|error");
  ParseFlagsOrExit(flags, argc, argv);
  o.structured = structured.OptionsOrExit("router");
  if (o.generation_config != "auto" && o.generation_config != "none")
    UsageError("router",
               "--generation-config must be auto or none, got '" + o.generation_config + "'");
  if (!o.tool_call_parser.empty() && !router::ParseToolParserName(o.tool_call_parser).ok())
    UsageError("router", "--tool-call-parser: " +
                             router::ParseToolParserName(o.tool_call_parser).status().message());
  if (o.scheduling_policy != "fcfs" && o.scheduling_policy != "priority")
    UsageError("router",
               "--scheduling-policy must be fcfs or priority, got '" + o.scheduling_policy + "'");
  if (!o.reasoning_parser.empty()) {
    if (auto parser = router::ParseReasoningParserName(o.reasoning_parser); !parser.ok())
      UsageError("router", "--reasoning-parser: " + parser.status().message());
  }
  for (auto [name, w] : {std::pair{"host-tier-weight", o.host_tier_weight},
                         {"disk-tier-weight", o.disk_tier_weight}}) {
    if (!(w >= 0 && w <= 1)) UsageError("router", std::string("--") + name + " must be in [0, 1]");
  }

  LogLevel level;
  if (!ParseLogLevel(log_level, &level))
    UsageError("router", "--log-level: unknown level '" + log_level + "'");
  SetLogLevel(level);
  if (o.model_dir.empty()) UsageError("router", "--model is required");
  if (drain_s < 0 || drain_s > kMaxTimeoutSecondsFlag)
    UsageError("router", "--drain-timeout must be in [0, 31536000] (a year)");
  if (o.salt_per_api_key && o.api_key_file.empty())
    UsageError("router", "--salt-per-api-key needs --api-key-file (salts derive from the keys)");
  if (max_json_depth < 1 || max_json_depth > 1000)
    UsageError("router", "--max-json-depth must be in [1, 1000]");
  o.max_json_depth = static_cast<int>(max_json_depth);
  if (o.max_snapshot_blocks < 1) UsageError("router", "--max-snapshot-blocks must be positive");
  auto port_ok = [](int64_t p, bool allow_minus_one) {
    return (p >= 0 && p <= 65535) || (allow_minus_one && p == -1);
  };
  if (!port_ok(http_port, false)) UsageError("router", "--port must be in [0, 65535]");
  if (!port_ok(control_port, false)) UsageError("router", "--control-port must be in [0, 65535]");
  if (!port_ok(metrics_port, true))
    UsageError("router", "--metrics-port must be -1 or in [0, 65535]");
  if (o.block_size <= 0 || o.block_size > 1024) {
    UsageError("router", "--block-size must be in [1, 1024] (as the workers')");
  }
  if (o.max_local_prefill < 0) UsageError("router", "--max-local-prefill must not be negative");
  if (o.max_prefill_queue_tokens < 0) {
    UsageError("router", "--max-prefill-queue-tokens must not be negative");
  }
  if (o.drain_push_blocks < 0) UsageError("router", "--drain-push-blocks must not be negative");
  if (o.replication_max_inflight < 0 || !(o.replication_max_copy_tokens_per_s >= 0)) {
    UsageError("router",
               "--replication-max-inflight and --replication-max-copy-tokens-per-s "
               "must not be negative");
  }
  if (o.replication_copy_cost < 0) {
    UsageError("router", "--replication-copy-cost must not be negative");
  }
  if (o.replication_min_requests < 1 || o.replication_min_requests > router::kMaxCopyMinRequests) {
    UsageError("router", "--replication-min-requests must be in [1, " +
                             std::to_string(router::kMaxCopyMinRequests) + "]");
  }
  if (!(o.replication_window_s >= 1e-3) || !(o.replication_window_s <= 86400)) {
    UsageError("router", "--replication-window-s must be in [0.001, 86400]");
  }
  if (http_threads < 1 || max_concurrent < 1 || max_body < 1 || timeout_s < 1 || max_attempts < 1) {
    UsageError("router", "thread, request, size, timeout and attempt limits must be positive");
  }
  if (http_threads > kMaxThreadsFlag || max_concurrent > 1'000'000 || max_attempts > 100 ||
      timeout_s > kMaxTimeoutSecondsFlag) {
    UsageError("router",
               "--http-threads must be at most 1024, --max-concurrent-requests 1000000, "
               "--max-attempts 100 and --request-timeout a year");
  }
  if (worker_stall_s < 0 || worker_stall_s > 86400)
    UsageError("router", "--worker-stall-timeout must be in [0, 86400]");
  if (auto origins = http::ParseCorsOrigins(allowed_origins); origins.ok()) {
    o.allowed_origins = std::move(*origins);
  } else {
    UsageError("router", "--allowed-origins: " + origins.status().message());
  }
  o.worker_stall_timeout_ms = worker_stall_s * 1000;
  if (Status st = router::RouterService::CheckRoutingOptions(o); !st.ok()) {
    UsageError("router", st.message());
  }
  {
    // After the other flags: its warning about an open control plane is for
    // a router that is about to start, not one refused for a bad flag.
    ControlSecurity sec = security.LoadOrExit("router");
    o.cluster_secret = std::move(sec.secret);
    o.control_tls = std::move(sec.tls);
  }
  o.http_port = static_cast<int>(http_port);
  o.control_port = static_cast<int>(control_port);
  o.metrics_port = static_cast<int>(metrics_port);
  o.http_threads = static_cast<int>(http_threads);
  o.max_concurrent_requests = static_cast<int>(max_concurrent);
  o.max_body_bytes = static_cast<size_t>(max_body);
  o.request_timeout_ms = timeout_s * 1000;
  o.max_attempts = static_cast<int>(max_attempts);

  auto service = router::RouterService::Create(o);
  if (!service.ok()) {
    std::fprintf(stderr, "pdserve router: %s\n", service.status().message().c_str());
    return service.status().code() == StatusCode::kInvalidArgument ||
                   service.status().code() == StatusCode::kNotFound
               ? 2
               : 1;
  }
  if (Status st = (*service)->Start(); !st.ok()) {
    std::fprintf(stderr, "pdserve router: %s\n", st.message().c_str());
    return 1;
  }
  const int sig = WaitForTerminationSignal();
  PDSERVE_LOG(INFO) << "router: signal " << sig << ", shutting down";
  if (const int64_t left = (*service)->Drain(std::chrono::seconds(drain_s)); left > 0) {
    PDSERVE_LOG(WARN) << "router: " << left << " requests still running after --drain-timeout "
                      << drain_s << " s: failing them";
  }
  (*service)->Stop();
  return 0;
}

}  // namespace

PDSERVE_COMMAND("router", "OpenAI API front door and KV-aware router", RunRouter);

}  // namespace pdserve::cli
