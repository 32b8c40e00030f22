// The router process: OpenAI HTTP API in front, control-plane server behind.
//
// Workers connect to the control port, Register, and keep the router's
// prefix index and load view current with KV events and Load reports. Each
// HTTP request is tokenized (chat template for chat), hashed (spec v1),
// routed by RouterCore, sent to the chosen decode worker as Generate (naming a
// prefill worker when the router decided on remote prefill: the only such
// decision), and its tokens are streamed back. Requests too long for every
// registered decode worker (their Register.max_model_len) are refused with
// OpenAI's context_length_exceeded error.
//
// Failure contract: a worker that dies or fails a request before the first
// token reached the client → the request is retried on another worker,
// transparently; after the first token → the stream ends with an error event.
// A client that disconnects → Cancel is sent to the worker. Nothing hangs:
// every request also has a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/structured/structured.h"
#include "services/router/router_core.h"
#include "transport/control/handshake.h"
#include "transport/control/tls.h"

namespace pdserve::router {

struct RouterServiceOptions {
  // tokenizer.json, tokenizer_config.json, and config.json for its
  // `_name_or_path` only (the served id); context lengths come from workers.
  std::string model_dir;
  std::string model_id;  // served name; "" = the model folder's name
  std::string host = "0.0.0.0";
  int http_port = 8000;     // 0: any free port
  int control_port = 9000;  // 0: any free port
  int metrics_port = -1;    // -1: /metrics on the HTTP port
  std::string policy = "kv";
  double policy_temperature = 0;  // softmax temperature of the kv policy (0: argmin)
  // kv and dynamo: a prompt token in a worker's host / disk KV tier against
  // one in its device pool (PolicyOptions).
  double host_tier_weight = 0.75;
  double disk_tier_weight = 0.25;
  int64_t max_local_prefill = kDefaultMaxLocalPrefill;  // see RouterOptions
  int64_t max_prefill_queue_tokens = 0;                 // see RouterOptions
  // Hot-prefix replication (RouterOptions::copy_cost; 0: off). A copy is a
  // remote prefill by a holder of role both or prefill, which then writes the
  // prefix's blocks to the chosen worker; with it on, workers of role both
  // are also listed to decode workers as prefill peers.
  double replication_copy_cost = 0;
  // Which prefixes are hot enough to copy (RouterOptions::copy_min_requests,
  // copy_window_us).
  int64_t replication_min_requests = 2;
  double replication_window_s = 10;
  // The copy budget (RouterOptions::copy_max_inflight,
  // copy_max_tokens_per_s; services/router/copy_governor.h).
  int64_t replication_max_inflight = 0;
  double replication_max_copy_tokens_per_s = 0;
  // Scale-down: when a worker of role both or prefill announces its drain
  // (SIGTERM), the router has it write its most used recent prompts, up to
  // this many blocks, to the surviving workers before it leaves (0: off).
  int64_t drain_push_blocks = 0;
  int64_t block_size = 16;
  std::string api_key_file;
  // Keys /metrics requires ("" = none); /health and /ready stay open.
  std::string metrics_key_file;
  // Keys of POST /admin/drain {"worker": NAME} (no new requests for that
  // worker, its hot prompts pushed as on SIGTERM); "" = no admin endpoints.
  std::string admin_key_file;
  // Cache salt of each request derived from its API key (and the client's
  // salt), so that tenants never share cached blocks; needs api_key_file.
  bool salt_per_api_key = false;
  int max_json_depth = 64;  // nesting allowed in a request body
  int http_threads = 2;
  int max_concurrent_requests = 512;
  // Origins whose web pages may call the API from a browser (CORS:
  // http::ServerOptions::cors_allowed_origins); empty: none.
  std::vector<std::string> allowed_origins;
  size_t max_body_bytes = 4u << 20;
  size_t max_header_bytes = 16u << 10;
  int max_attempts = 3;  // dispatches per request (1 + retries)
  // A request waiting this long for its next token (its first included:
  // queueing, prefill) fails with 504; tokens that keep coming never time
  // it out.
  int64_t request_timeout_ms = 600'000;
  // A worker whose load reports (sent from its engine loop) stop this long
  // while its connection lives is stuck in an engine step: it gets no new
  // requests while another worker can take them, and counts as "stalled" in
  // pdserve_router_workers, until they resume (RouterOptions::worker_stall_us).
  // 0: never.
  int64_t worker_stall_timeout_ms = 30'000;
  // Control plane: the secret workers must prove (null: unauthenticated,
  // --insecure-control-plane) and optional mutual TLS.
  std::shared_ptr<const control::ClusterSecret> cluster_secret;
  std::shared_ptr<const control::TlsContext> control_tls;
  // Largest KV snapshot (cached block hashes) one worker may send; a worker
  // also may not announce more than its registered KV capacity.
  int64_t max_snapshot_blocks = int64_t{8} << 20;
  // Structured outputs: every constraint is compiled with these limits
  // before a request is routed; one that does not compile is a 400 naming
  // the reason. Routed only to workers that announce structured outputs.
  structured::CompileOptions structured;
  // How the model writes tool calls (tool_calls.h: hermes, qwen3, qwen3_coder, deepseek_v3,
  // deepseek_v31, mistral, llama3_json); "": chosen from the chat template's markers.
  std::string tool_call_parser;
  // How a reasoning model marks its thoughts (reasoning.h: deepseek_r1,
  // qwen3); "": none, thoughts stay in the content.
  std::string reasoning_parser;
  // "fcfs": requests run in arrival order and a nonzero `priority` is
  // refused (it would let any client jump the queue); "priority": vLLM's
  // policy, `priority` passed to the workers (lower first, preempting).
  std::string scheduling_policy = "fcfs";
  // A Jinja chat template file used instead of the model's (as vLLM's
  // --chat-template: a tool-calling template, or one for a model that has
  // none); it must parse, or the router does not start. "": the model's.
  std::string chat_template_file;
  // Sampling a request leaves out: "auto" takes the model folder's
  // generation_config.json values (temperature, top_p, top_k, min_p), as
  // vLLM does; "none": OpenAI's defaults (temperature 1, no truncation).
  std::string generation_config = "auto";
};

class RouterService {
 public:
  static StatusOr<std::unique_ptr<RouterService>> Create(RouterServiceOptions options);
  // What Create would refuse of the routing options (policy, its weights,
  // replication), without loading anything: for a command line to refuse a
  // bad flag before it starts.
  static Status CheckRoutingOptions(const RouterServiceOptions& options);
  virtual ~RouterService() = default;
  // Binds the HTTP, metrics and control ports and starts serving.
  virtual Status Start() = 0;
  // Fails requests in flight with an error, closes worker connections, stops.
  virtual void Stop() = 0;
  // Graceful shutdown's first half (SIGTERM): new requests are refused (503,
  // /ready fails so that the Service stops sending them), while the ones
  // in flight run to their end and their last bytes reach the client's
  // socket, for at most `timeout`. Stop() then fails whatever is left.
  // Returns how many were left.
  virtual int64_t Drain(std::chrono::milliseconds timeout) = 0;
  virtual int http_port() const = 0;
  virtual int control_port() const = 0;
  virtual int metrics_port() const = 0;  // == http_port() when shared
};

}  // namespace pdserve::router
