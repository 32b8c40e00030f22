#include "services/router/router_service.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <regex>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "common/block_hash.h"
#include "common/chat_template/chat_template.h"
#include "common/http/bearer_auth.h"
#include "common/http/http_server.h"
#include "common/logging.h"
#include "common/metrics/metrics.h"
#include "common/model_id.h"
#include "common/proto/pdserve.pb.h"
#include "common/random_id.h"
#include "common/read_file.h"
#include "common/tokenizer/tokenizer.h"
#include "services/protocol/kv_events.h"
#include "services/protocol/role.h"
#include "services/protocol/sampling.h"
#include "services/router/openai/openai_api.h"
#include "services/router/openai/prompt_batch.h"
#include "services/router/openai/reasoning.h"
#include "services/router/openai/responses_api.h"
#include "services/router/openai/tool_call_grammar.h"
#include "services/router/router_core.h"
#include "transport/control/connection.h"

namespace pdserve::router {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The routing core's options, as the service's flags give them.
RouterOptions RoutingOptionsOf(const RouterServiceOptions& o) {
  RouterOptions ro;
  ro.policy = o.policy;
  ro.policy_options.temperature = o.policy_temperature;
  ro.policy_options.host_tier_weight = o.host_tier_weight;
  ro.policy_options.disk_tier_weight = o.disk_tier_weight;
  ro.block_tokens = o.block_size;
  ro.max_local_prefill = o.max_local_prefill;
  ro.max_prefill_queue_tokens = o.max_prefill_queue_tokens;
  ro.copy_cost = o.replication_copy_cost;
  ro.copy_min_requests = o.replication_min_requests;
  ro.copy_window_us = static_cast<int64_t>(o.replication_window_s * 1e6);
  ro.copy_max_inflight = o.replication_max_inflight;
  ro.copy_max_tokens_per_s = o.replication_max_copy_tokens_per_s;
  ro.drain_push = o.drain_push_blocks > 0;
  ro.worker_stall_us = o.worker_stall_timeout_ms * 1000;
  return ro;
}

// max_tokens of a chat request that gives none while no registered worker
// reported its context length (older workers): the worker still stops at its
// own limit, with finish_reason "length".
constexpr int64_t kMaxTokensWhenContextUnknown = 4096;

// A registered SnapKV budget above this is refused: past any context an
// engine runs (2^20 tokens with attention sinks), so only a broken or
// hostile worker sends it.
constexpr int64_t kMaxSnapKvBudgetTokens = int64_t{1} << 24;

// A registration's KV layer groups: at most one a layer (the loader takes up
// to 1,024 layers), each window within the same bound as a SnapKV budget.
constexpr int kMaxKvGroups = 1024;
constexpr int64_t kMaxKvWindowTokens = kMaxSnapKvBudgetTokens;

// A worker's control address (host:port) is passed on to decode workers,
// which connect to it; past any host name it is a broken worker's.
constexpr size_t kMaxControlAddressBytes = 512;

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* FinishName(proto::FinishReason r) {
  switch (r) {
    case proto::FINISH_REASON_LENGTH:
      return "length";
    default:
      return "stop";
  }
}

// Router metrics (docs/architecture.md section 8).
struct RouterMetrics {
  explicit RouterMetrics(prometheus::Registry& r)
      : requests(metrics::AddCounterFamily(r, "pdserve_router_requests_total",
                                           "Requests answered by the router, by outcome")),
        predicted_hit_tokens(metrics::AddCounter(
            r, "pdserve_router_predicted_hit_tokens_total",
            "Prompt tokens the index predicted cached on the prefilling worker")),
        predicted_tier_hit_tokens(metrics::AddCounterFamily(
            r, "pdserve_router_predicted_tier_hit_tokens_total",
            "Prompt tokens the index predicted in a lower KV tier (tier=host|disk) of the "
            "prefilling worker, past its device prefix")),
        prompt_tokens(
            metrics::AddCounter(r, "pdserve_router_prompt_tokens_total", "Prompt tokens routed")),
        decisions(metrics::AddCounterFamily(r, "pdserve_router_decisions_total",
                                            "Routing decisions by kind")),
        retries(metrics::AddCounter(r, "pdserve_router_retries_total",
                                    "Requests re-sent to another worker before their first token")),
        ttft(metrics::AddHistogram(
            r, "pdserve_router_time_to_first_token_seconds",
            "Time from request arrival to its first token, seen by the router",
            metrics::TimeToFirstTokenBuckets())),
        route_seconds(
            metrics::AddHistogram(r, "pdserve_router_route_seconds",
                                  "Time to tokenize, hash and choose workers for a request",
                                  metrics::RouteDecisionBuckets())),
        e2e(metrics::AddHistogram(r, "pdserve_router_request_duration_seconds",
                                  "Time from request arrival to its last byte",
                                  metrics::RequestLatencyBuckets())),
        event_gaps(
            metrics::AddCounter(r, "pdserve_router_kv_event_gaps_total",
                                "KV event batches out of sequence (each triggers a resync)")),
        workers(metrics::AddGaugeFamily(r, "pdserve_router_workers",
                                        "Connected workers by role and state")),
        inflight(
            metrics::AddGauge(r, "pdserve_router_requests_in_flight", "Requests being served")),
        index_blocks(metrics::AddGauge(r, "pdserve_router_index_blocks",
                                       "Distinct block hashes in the prefix index")),
        index_bytes(
            metrics::AddGauge(r, "pdserve_router_index_bytes", "Memory held by the prefix index")),
        control_buffered_bytes(metrics::AddGauge(
            r, "pdserve_router_control_buffered_bytes",
            "Bytes held for control connections: incomplete received frames and queued sends")),
        snapshot_pending_bytes(
            metrics::AddGauge(r, "pdserve_router_snapshot_pending_bytes",
                              "Bytes of KV snapshots being received and not yet complete")),
        control_rejected(
            metrics::AddCounterFamily(r, "pdserve_router_control_rejected_total",
                                      "Control messages or connections refused, by reason")),
        control_refused(metrics::AddCounterFamily(
            r, "pdserve_control_refused_total",
            "Control connections refused before completing their handshake, by reason")),
        replications(metrics::AddCounterFamily(
            r, "pdserve_router_replications_total",
            "Hot-prefix copies by outcome: started (a holder was asked to write the prefix's "
            "blocks to the chosen worker), finished (that request's first token came), failed "
            "(no path to the holder, or the request failed before its first token)")),
        replicated_blocks(metrics::AddCounter(
            r, "pdserve_router_replicated_blocks_total",
            "KV blocks holders were asked to copy (the bytes are in the workers' "
            "pdserve_kv_transfer_bytes_total)")),
        copies_declined(metrics::AddCounterFamily(
            r, "pdserve_router_copies_declined_total",
            "Hot-prefix copies that a price of link time alone would have made, declined by "
            "the first rule against them (enough_holders, breaker_open, inflight_budget, "
            "rate_budget, link_busy, receiver_queue, receiver_pressure; docs/routing.md)")),
        copy_outcomes(metrics::AddCounterFamily(
            r, "pdserve_router_copy_outcomes_total",
            "Copies by what became of them: reused (another request hit the copied blocks on "
            "their receiver) or unused (evicted, or not hit within the reuse window)")),
        copy_reuse_ratio(metrics::AddGauge(
            r, "pdserve_router_copy_reuse_ratio",
            "The copy breaker's moving average of reused / (reused + unused) outcomes")),
        copy_breaker_state(metrics::AddGauge(
            r, "pdserve_router_copy_breaker_state",
            "Copy breaker: 0 closed (copies may start), 1 half-open (one probe at a time), 2 open "
            "(none start)")),
        copy_breaker_trips(metrics::AddCounter(r, "pdserve_router_copy_breaker_trips_total",
                                               "Times the copy breaker opened")),
        copy_budget_scale(metrics::AddGauge(
            r, "pdserve_router_copy_budget_scale",
            "Share (1/16 to 1) of the full copy budget open now: grows with reused copies, "
            "shrinks with unused ones")),
        copies_in_flight(metrics::AddGauge(r, "pdserve_router_copies_in_flight",
                                           "Copies started whose blocks have not landed")),
        copy_inflight_limit(metrics::AddGauge(
            r, "pdserve_router_copy_inflight_limit",
            "The most copies in flight the budget allows now (0: replication off)")) {
    // Every outcome and decision exists from the start at 0, so rate() and
    // ratios over them are defined before the first request of each kind.
    for (const char* status :
         {"ok", "rejected", "error", "cancelled", "unavailable", "unauthorized", "overloaded"})
      requests.Add({{"status", status}});
    for (const char* kind : {"remote_prefill", "local_prefill"}) decisions.Add({{"kind", kind}});
    for (const char* reason :
         {"not_dispatched_here", "duplicate_worker", "snapshot_too_large", "registration_invalid"})
      control_rejected.Add({{"reason", reason}});
    for (const char* reason : control::kRefusalReasons) control_refused.Add({{"reason", reason}});
    for (const char* outcome : {"started", "finished", "failed"}) {
      replications.Add({{"outcome", outcome}});
    }
    for (size_t k = 0; k < kCopyDeclineCount; ++k)
      copies_declined.Add({{"reason", CopyDeclineName(static_cast<CopyDecline>(k))}});
    for (const char* outcome : {"reused", "unused"}) copy_outcomes.Add({{"outcome", outcome}});
    for (const char* tier : {"host", "disk"}) predicted_tier_hit_tokens.Add({{"tier", tier}});
    // Before any worker registers too: "no ready decode worker" must be
    // visible on a router that never had one.
    for (const char* role : {"prefill", "decode", "both"}) {
      for (const char* state : {"ready", "syncing", "draining", "stalled"})
        workers.Add({{"role", role}, {"state", state}});
    }
  }

  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Counter& predicted_hit_tokens;
  prometheus::Family<prometheus::Counter>& predicted_tier_hit_tokens;
  prometheus::Counter& prompt_tokens;
  prometheus::Family<prometheus::Counter>& decisions;
  prometheus::Counter& retries;
  prometheus::Histogram& ttft;
  prometheus::Histogram& route_seconds;
  prometheus::Histogram& e2e;
  prometheus::Counter& event_gaps;
  prometheus::Family<prometheus::Gauge>& workers;
  prometheus::Gauge& inflight;
  prometheus::Gauge& index_blocks;
  prometheus::Gauge& index_bytes;
  prometheus::Gauge& control_buffered_bytes;
  prometheus::Gauge& snapshot_pending_bytes;
  prometheus::Family<prometheus::Counter>& control_rejected;
  prometheus::Family<prometheus::Counter>& control_refused;
  prometheus::Family<prometheus::Counter>& replications;
  prometheus::Counter& replicated_blocks;
  prometheus::Family<prometheus::Counter>& copies_declined;
  prometheus::Family<prometheus::Counter>& copy_outcomes;
  prometheus::Gauge& copy_reuse_ratio;
  prometheus::Gauge& copy_breaker_state;
  prometheus::Counter& copy_breaker_trips;
  prometheus::Gauge& copy_budget_scale;
  prometheus::Gauge& copies_in_flight;
  prometheus::Gauge& copy_inflight_limit;
};

// One connected worker.
struct WorkerLink {
  control::ConnectionPtr conn;
  std::optional<WorkerId> id;  // set after a valid Register
  std::string name;
  Role role = Role::kBoth;
  std::string control_address;
  int64_t kv_capacity_blocks = 0;                      // as registered
  int64_t host_tier_blocks = 0, disk_tier_blocks = 0;  // likewise, its lower KV tiers
  // A tier registered larger than --max-snapshot-blocks: its snapshot lists
  // are cut to that many (the rest not indexed), not refused.
  bool host_tier_clamped = false, disk_tier_clamped = false;
  bool structured_outputs = false;  // honours SamplingParams.constraint
  bool parallel_sampling = false;   // honours Generate.n
  bool synced = false;
  bool draining = false;  // no new requests (its own goodbye, or POST /admin/drain)
  bool leaving = false;   // it said it is shutting down: never undrained
  bool stalled = false;   // its load reports stopped (the watchdog's view, for logs and gauges)
  // KvSnapshot chunks being assembled: device pool, host tier, disk tier.
  std::vector<BlockHash> snapshot, snapshot_host, snapshot_disk;
  uint64_t rejected_messages = 0;  // for rate-limited logging
};

// One HTTP request in flight.
struct Inflight {
  uint64_t id = 0;
  // The id of the current dispatch on the control plane (fresh per attempt,
  // unguessable), and the connection it went out on: only that connection may
  // answer for it.
  std::string wire_id;
  uint64_t decode_conn = 0;
  std::string request_id;  // "cmpl-..." / "chatcmpl-..."
  std::string http_request_id;
  std::shared_ptr<http::Exchange> exchange;
  std::unique_ptr<ApiRequest> api;
  std::unique_ptr<ResponseFormatter> formatter;
  // With tools: the functions a call may name, built once (outside the
  // router's lock) for every choice's parser.
  ToolFunctionList tool_functions;
  // Set when a reasoning parser splits the output: whether it begins
  // inside thinking (from the rendered prompt, reasoning.h).
  std::optional<bool> starts_thinking;
  std::string prompt_text;  // for echo; a chat's rendered prompt
  std::vector<TokenId> prompt_ids;
  // echo with logprobs: the prompt's tokens as the worker scored them.
  std::vector<TokenPiece> prompt_pieces;
  std::vector<TokenPiece> prompt_pieces_pending;  // scores come in, until all are here
  std::vector<BlockHash> hashes;
  Clock::time_point arrived;
  // --request-timeout after its arrival, then after each token: a request
  // fails when it waits that long for its next token (the first included),
  // never while its tokens flow (a long answer is not a stuck one).
  Clock::time_point deadline;
  int attempts = 0;
  // Workers that failed it (a retryable error): a retry goes elsewhere
  // while another can take it.
  std::vector<WorkerId> failed_on;
  bool counted = false;        // its prompt is in the router's counters
  bool ttft_observed = false;  // its TTFT is in the histogram
  std::optional<WorkerId> decode;
  std::optional<WorkerId> prefill;
  std::optional<WorkerId> copy_from;  // a holder copying a hot prefix as its prefill worker
  bool started_stream = false;        // HTTP headers sent
  bool first_token_seen = false;
  double ttft_s = 0;
  // One per sequence the worker generates (n, or best_of), by Token.index.
  struct Choice {
    std::vector<TokenPiece> pieces;                 // non-streaming: the whole output
    std::unique_ptr<IncrementalDetokenizer> detok;  // when workers send ids only
    // Chat with tools (tool_choice not none), streaming: output parsed into calls.
    std::unique_ptr<ToolCallStreamer> tool_stream;
    // With a reasoning parser, streaming: the thoughts split from the rest
    // (which the tool streamer, if any, reads).
    std::unique_ptr<ReasoningStreamer> reasoning;
    int64_t reasoning_tokens = 0;  // its tokens the reasoning streamer read as thoughts
    size_t tool_calls_sent = 0;
    size_t streamed_text_chars = 0;  // completions' logprobs.text_offset (TextOffsetLength)
    bool finished = false;
    std::string finish_reason;
    double logprob_sum = 0;  // best_of: the sequence's likelihood
    int64_t tokens = 0;      // generated so far (continuous usage)
  };
  std::vector<Choice> choices;
  size_t choices_finished = 0;
  Usage usage;  // the prompt once, every sequence's completion tokens
};

class RouterServiceImpl : public RouterService {
 public:
  explicit RouterServiceImpl(RouterServiceOptions o) : opts_(std::move(o)) {}

  Status Init() {
    auto tok = Tokenizer::Load(opts_.model_dir);
    if (!tok.ok()) return tok.status();
    tokenizer_ = std::move(*tok);
    std::string template_text = tokenizer_->chat_template();
    if (!opts_.chat_template_file.empty()) {
      auto text = ReadRegularFile(opts_.chat_template_file);
      if (!text.ok() || text->empty()) {
        return Status::InvalidArgument("chat template " + opts_.chat_template_file +
                                       ": cannot read it, or it is empty");
      }
      auto tmpl = ChatTemplate::Parse(*text);
      if (!tmpl.ok()) {
        return Status::InvalidArgument("chat template " + opts_.chat_template_file + ": " +
                                       tmpl.status().message());
      }
      chat_template_.emplace(std::move(*tmpl));
      template_text = std::move(*text);
      PDSERVE_LOG(INFO) << "chat template from " << opts_.chat_template_file
                        << " (the model's is not used)";
    } else if (!template_text.empty()) {
      auto tmpl = ChatTemplate::Parse(template_text);
      if (!tmpl.ok()) {
        PDSERVE_LOG(WARN) << "chat template unusable, /v1/chat/completions disabled: "
                          << tmpl.status().message();
        chat_template_error_ = std::string(tmpl.status().message());
      } else {
        chat_template_.emplace(std::move(*tmpl));
      }
      // The model's "tool_use" template renders requests with tools, as
      // transformers does (Hermes-2-Pro, Command-R); its call format is
      // the one the tool parser reads.
      if (const std::string& tools_text = tokenizer_->tool_use_chat_template();
          !tools_text.empty()) {
        auto tools_tmpl = ChatTemplate::Parse(tools_text);
        if (!tools_tmpl.ok()) {
          PDSERVE_LOG(WARN) << "chat template 'tool_use' unusable, the default one renders tools: "
                            << tools_tmpl.status().message();
        } else {
          tool_use_template_.emplace(std::move(*tools_tmpl));
          template_text = tools_text + template_text;
        }
      }
    }
    template_knows_developer_ = template_text.find("developer") != std::string::npos;
    // A template that loops over a message's content takes its parts
    // (Gemma-3's, Mistral-Small-3.1's, the vision Llamas'), others a string:
    // vLLM's content-format detection.
    static const std::regex kLoopsOverContent(
        R"(for\s+\w+\s+in\s+\w+\s*(\[\s*['"]content['"]\s*\]|\.content\b))");
    auto loops = [](const std::string& text) { return std::regex_search(text, kLoopsOverContent); };
    template_takes_parts_ =
        chat_template_ &&
        loops(opts_.chat_template_file.empty() ? tokenizer_->chat_template() : template_text);
    tool_use_takes_parts_ = tool_use_template_ && loops(tokenizer_->tool_use_chat_template());
    if (!opts_.tool_call_parser.empty()) {
      auto parser = ParseToolParserName(opts_.tool_call_parser);
      if (!parser.ok()) return parser.status();
      tool_parser_ = *parser;
    } else {
      tool_parser_ = ToolParserForTemplate(template_text);
    }
    if (opts_.scheduling_policy != "fcfs" && opts_.scheduling_policy != "priority") {
      return Status::InvalidArgument("scheduling policy must be fcfs or priority, not '" +
                                     opts_.scheduling_policy + "'");
    }
    if (!opts_.reasoning_parser.empty()) {
      auto parser = ParseReasoningParserName(opts_.reasoning_parser);
      if (!parser.ok()) return parser.status();
      reasoning_parser_ = *parser;
    }
    mistral_name_args_ = MistralNameArgsForm(template_text);
    PDSERVE_RETURN_IF_ERROR(LoadSamplingDefaults());
    // The context length is not read here: workers report theirs (Register).
    auto model_id = ServedModelIdOfFolder(opts_.model_dir, opts_.model_id);
    if (!model_id.ok()) return model_id.status();
    model_id_ = std::move(*model_id);
    auto api_keys = http::ReloadingKeys::LoadFlag("--api-key-file", opts_.api_key_file);
    if (!api_keys.ok()) return api_keys.status();
    api_keys_ = std::move(*api_keys);
    auto core = RouterCore::Create(RoutingOptionsOf(opts_));
    if (!core.ok()) return core.status();
    core_ = std::move(*core);
    limits_.model_ids = {model_id_};
    PDSERVE_RETURN_IF_ERROR(InitHttpOptions());
    return Status::Ok();
  }

  // --generation-config auto: the model's recommended sampling, for the
  // values a request leaves out.
  Status LoadSamplingDefaults() {
    if (opts_.generation_config == "none") return Status::Ok();
    if (opts_.generation_config != "auto") {
      return Status::InvalidArgument("generation_config must be auto or none, got '" +
                                     opts_.generation_config + "'");
    }
    const std::string path =
        (std::filesystem::path(opts_.model_dir) / "generation_config.json").string();
    auto text = ReadRegularFile(path);
    if (text.status().code() == StatusCode::kNotFound) return Status::Ok();  // OpenAI's defaults
    if (!text.ok()) return text.status();
    const auto config = nlohmann::ordered_json::parse(*text, nullptr, false);
    if (config.is_discarded() || !config.is_object()) {
      return Status::InvalidArgument(path + ": not a JSON object");
    }
    std::vector<std::string> ignored;
    limits_.sampling_defaults = ParseSamplingDefaults(config, &ignored);
    for (const std::string& what : ignored) {
      PDSERVE_LOG(WARN) << "router: generation_config.json: " << what << " not applied";
    }
    if (!limits_.sampling_defaults.empty()) {
      PDSERVE_LOG(INFO) << "router: sampling defaults from generation_config.json: "
                        << limits_.sampling_defaults.ToString()
                        << " (a request's own values win; --generation-config none: OpenAI's)";
    }
    return Status::Ok();
  }

  Status Start() override {
    loop_ = std::make_unique<control::EventLoop>("router-control", 1);
    control::ConnectionOptions co;
    co.role = proto::ROLE_ROUTER;
    co.id = "router";
    co.secret = opts_.cluster_secret;
    co.tls = opts_.control_tls;
    control::ConnectionHandlers handlers;
    handlers.on_message = [this](const control::ConnectionPtr& c, proto::Envelope& e) {
      OnControl(c, e);
    };
    handlers.on_close = [this](const control::ConnectionPtr& c, const Status& s) {
      OnWorkerClosed(c, s);
    };
    control::ServerLimits limits;
    limits.on_refused = [this](const char* reason) {
      metrics_.control_refused.Add({{"reason", reason}}).Increment();
    };
    control_ = std::make_unique<control::Server>(loop_.get(), co, handlers, std::move(limits));
    PDSERVE_RETURN_IF_ERROR(
        control_->Listen(opts_.host, static_cast<uint16_t>(opts_.control_port)));

    http::ServerOptions ho;
    ho.host = opts_.host;
    ho.port = opts_.http_port;
    ho.threads = opts_.http_threads;
    ho.max_body_bytes = opts_.max_body_bytes;
    ho.max_header_bytes = opts_.max_header_bytes;
    ho.max_concurrent_requests = opts_.max_concurrent_requests;
    // The probes and the scrape are answered however many API requests are
    // open: a router at its limit is busy, not broken.
    ho.unlimited_paths = {"/health", "/live", "/ready", "/metrics"};
    ho.on_overload = [this](const http::Request&) { CountRequest("overloaded"); };
    ho.cors_allowed_origins = opts_.allowed_origins;
    http_ = std::make_unique<http::Server>(
        ho, [this](const http::Request& r, std::shared_ptr<http::Exchange> ex) {
          HandleHttp(r, std::move(ex));
        });
    PDSERVE_RETURN_IF_ERROR(http_->Start());
    if (opts_.metrics_port >= 0) {
      http::ServerOptions mo;
      mo.host = opts_.host;
      mo.port = opts_.metrics_port;
      mo.threads = 1;
      metrics_http_ = std::make_unique<http::Server>(
          mo, [this](const http::Request& r, std::shared_ptr<http::Exchange> ex) {
            if (!metrics::ServeStandardEndpoints(
                    r, *ex, *registry_, [] { return metrics::Health{}; },
                    *http::ReloadingKeys::CurrentOf(metrics_keys_))) {
              ex->Reply(http::ErrorResponse(404, "only /metrics and /health are served here"));
            }
          });
      PDSERVE_RETURN_IF_ERROR(metrics_http_->Start());
    }
    watchdog_ = std::thread([this] { Watchdog(); });
    PDSERVE_LOG(INFO) << "router serving model '" << model_id_ << "' (block size "
                      << opts_.block_size << ", policy " << opts_.policy
                      << ") on http :" << http_->port() << ", control :" << control_->port()
                      << (metrics_http_ ? ", metrics :" + std::to_string(metrics_http_->port())
                                        : "");
    return Status::Ok();
  }

  int64_t Drain(std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    draining_ = true;
    if (!inflight_.empty()) {
      PDSERVE_LOG(INFO) << "router: draining " << inflight_.size() << " requests (at most "
                        << timeout.count() / 1000 << " s)";
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    drained_cv_.wait_until(lock, deadline, [&] { return inflight_.empty(); });
    const auto left = static_cast<int64_t>(inflight_.size());
    lock.unlock();
    // A request leaves inflight_ once its last chunk is handed to the HTTP
    // server; Stop would cut that chunk if it were still queued.
    if (left == 0 && http_ && !http_->WaitIdle(deadline)) {
      return std::max<int64_t>(1, http_->in_flight());
    }
    return left;
  }

  void Stop() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    watchdog_cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::vector<uint64_t> ids;
      for (auto& [id, _] : inflight_) ids.push_back(id);
      for (uint64_t id : ids) {
        FailLocked(id, 503, "the router is shutting down", "server_error", /*retry_after=*/true);
      }
    }
    if (http_) http_->Stop();
    if (metrics_http_) metrics_http_->Stop();
    if (control_) control_->Stop("router stopping");
    control_.reset();
    loop_.reset();
  }

  ~RouterServiceImpl() override { Stop(); }

  int http_port() const override { return http_ ? http_->port() : 0; }
  int control_port() const override { return control_ ? control_->port() : 0; }
  int metrics_port() const override { return metrics_http_ ? metrics_http_->port() : http_port(); }

 private:
  // ---------------------------------------------------------------- HTTP side
  // Init's part for the HTTP side: request limits, /metrics keys, tenancy.
  Status InitHttpOptions() {
    if (opts_.max_json_depth < 1)
      return Status::InvalidArgument("--max-json-depth must be at least 1");
    limits_.max_json_depth = opts_.max_json_depth;
    if (opts_.salt_per_api_key && !api_keys_) {
      return Status::InvalidArgument(
          "--salt-per-api-key derives cache salts from API keys: it needs --api-key-file");
    }
    auto metrics_keys = http::ReloadingKeys::LoadFlag("--metrics-key-file", opts_.metrics_key_file);
    if (!metrics_keys.ok()) return metrics_keys.status();
    metrics_keys_ = std::move(*metrics_keys);
    auto admin_keys = http::ReloadingKeys::LoadFlag("--admin-key-file", opts_.admin_key_file);
    if (!admin_keys.ok()) return admin_keys.status();
    admin_keys_ = std::move(*admin_keys);
    return Status::Ok();
  }

  void HandleHttp(const http::Request& req, std::shared_ptr<http::Exchange> ex) {
    if (!metrics_http_ && metrics::ServeStandardEndpoints(
                              req, *ex, *registry_, [] { return metrics::Health{}; },
                              *http::ReloadingKeys::CurrentOf(metrics_keys_))) {
      return;
    }
    if (req.path == "/health" || req.path == "/live") {  // metrics on their own port: probes stay
      ex->Reply({200, "application/json", {}, R"({"status":"ok"})"});
      return;
    }
    if (req.path == "/ready") {
      bool draining = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        draining = draining_;
      }
      const bool ready = !draining && HasDecodeWorker();
      http::Response r;
      r.status = ready ? 200 : 503;
      r.body = nlohmann::json{{"ready", ready},
                              {"decode_workers", CountSyncedWorkers(/*prefill=*/false)},
                              {"prefill_workers", CountSyncedWorkers(/*prefill=*/true)}}
                   .dump();
      if (!ready) r.headers.emplace_back("Retry-After", "1");
      ex->Reply(std::move(r));
      return;
    }
    if (req.path.rfind("/admin/", 0) == 0) {
      if (!admin_keys_) {
        return ex->Reply(http::ErrorResponse(404, "admin endpoints are off (--admin-key-file)",
                                             "invalid_request_error", "", "not_found"));
      }
      const http::BearerCheck auth = http::CheckBearer(req, *admin_keys_->Current());
      if (!auth.accepted()) return ex->Reply(http::BearerRefusal(auth));
      if (req.path == "/admin/drain") return HandleAdminDrain(req, ex);
      if (req.path == "/admin/undrain") return HandleAdminUndrain(req, ex);
      return ex->Reply(http::ErrorResponse(404, "no such endpoint: " + req.method + " " + req.path,
                                           "invalid_request_error", "", "not_found"));
    }
    const bool tokenizer_path = req.path == "/tokenize" || req.path == "/detokenize";
    const bool is_api = req.path.rfind("/v1/", 0) == 0 || tokenizer_path;
    std::optional<std::string> api_key;  // the key that authorized the request
    if (is_api && api_keys_) {
      const auto keys = api_keys_->Current();
      const http::BearerCheck auth = http::CheckBearer(req, *keys);
      if (!auth.accepted()) {
        http::Response refusal = http::BearerRefusal(auth);
        const int status = refusal.status;
        ex->Reply(std::move(refusal));
        CountRequest("unauthorized");
        // No request id yet: the client is not trusted with one.
        PDSERVE_LOG(INFO) << "request from " << req.remote << " " << req.method << " " << req.path
                          << " refused " << status << ": "
                          << (auth.outcome == http::BearerCheck::Outcome::kAmbiguous
                                  ? "several Authorization headers"
                                  : "no valid API key");
        return;
      }
      api_key = (*keys)[auth.key_index];
    }
    // GET /v1/models lists the model; GET /v1/models/{id} retrieves it.
    constexpr std::string_view kModelsPath = "/v1/models";
    if (req.path == kModelsPath || req.path.starts_with(std::string(kModelsPath) + "/")) {
      if (req.method != "GET") return ex->Reply(http::ErrorResponse(405, "use GET for /v1/models"));
      // max_model_len: what the registered workers run (null before one says).
      const int64_t max_len = core_->MaxModelLen();
      nlohmann::json model = {{"id", model_id_},          {"object", "model"},
                              {"created", started_unix_}, {"owned_by", "pdserve"},
                              {"root", model_id_},        {"max_model_len", nullptr}};
      if (max_len > 0) model["max_model_len"] = max_len;
      if (req.path == kModelsPath) {
        ex->Reply({200,
                   "application/json",
                   {},
                   nlohmann::json{{"object", "list"}, {"data", {model}}}.dump()});
        return;
      }
      // Clients encode the id as a path parameter ("org%2Fname").
      const std::string raw_id = req.path.substr(kModelsPath.size() + 1);
      const std::string id = http::PercentDecode(raw_id).value_or(raw_id);
      if (id != model_id_) {
        return ex->Reply(http::ErrorResponse(404, "The model `" + id + "` does not exist.",
                                             "invalid_request_error", "model", "model_not_found"));
      }
      ex->Reply({200, "application/json", {}, model.dump()});
      return;
    }
    if (req.path == "/v1/completions" || req.path == "/v1/chat/completions" ||
        req.path == "/v1/responses") {
      if (req.method != "POST")
        return ex->Reply(http::ErrorResponse(405, "use POST for " + req.path));
      HandleGenerate(req, std::move(ex),
                     req.path == "/v1/completions" ? Endpoint::kCompletions
                     : req.path == "/v1/responses" ? Endpoint::kResponses
                                                   : Endpoint::kChatCompletions,
                     api_key);
      return;
    }
    if (req.path.starts_with("/v1/responses/")) {
      return ex->Reply(http::ErrorResponse(
          404, "responses are not stored here: each is answered once, to the request that made it",
          "invalid_request_error", "", "not_found"));
    }
    if (tokenizer_path) return HandleTokenizer(req, *ex);
    ex->Reply(http::ErrorResponse(404, "no such endpoint: " + req.method + " " + req.path,
                                  "invalid_request_error", "", "not_found"));
  }

  // A batch of prompts (services/router/openai/prompt_batch.h): each prompt
  // is a request of its own, its answer merged into the client's. Once a
  // prompt's answer is an error, which is then the batch's, the prompts
  // after it are not served.
  void ServeBatch(const http::Request& req, std::shared_ptr<http::Exchange> ex,
                  const PromptBatchSplit& split, std::optional<std::string> api_key) {
    PromptBatch batch(std::move(ex), split);
    // One x-request-id for every prompt: the batch's log lines join on it
    // and the client gets it back.
    http::Headers headers;
    for (const auto& h : req.headers) {
      if (h.first != "x-request-id") headers.push_back(h);
    }
    const std::string_view client_rid = req.Header("x-request-id");
    headers.emplace_back("x-request-id",
                         IsPlainTraceId(client_rid) ? std::string(client_rid) : NewUnguessableId());
    for (size_t i = 0; i < split.bodies.size() && !batch.failed(); ++i) {
      // Field by field, not a copy of `req`: that would copy the whole
      // batch's body for every prompt.
      http::Request one;
      one.method = req.method;
      one.target = req.target;
      one.path = req.path;
      one.headers = headers;
      one.remote = req.remote;
      one.body = split.bodies[i];
      HandleGenerate(one, batch.ExchangeFor(i), Endpoint::kCompletions, api_key);
    }
  }

  // `api_key`: the key that authorized the request, if any.
  void HandleGenerate(const http::Request& req, std::shared_ptr<http::Exchange> ex,
                      Endpoint endpoint, std::optional<std::string> api_key) {
    const auto arrived = Clock::now();
    auto r = std::make_unique<Inflight>();
    r->arrived = arrived;
    r->deadline = arrived + std::chrono::milliseconds(opts_.request_timeout_ms);
    r->exchange = ex;
    r->api = std::make_unique<ApiRequest>();
    std::string rid(req.Header("x-request-id"));
    {
      std::lock_guard<std::mutex> lock(mu_);
      r->id = next_id_++;
    }
    // The client's id goes into every log line of the request and back in
    // the response: only a bounded id of a plain alphabet is taken, so that
    // no client can write fields of its own into the log.
    if (!IsPlainTraceId(rid)) rid = NewUnguessableId();
    r->request_id = (endpoint == Endpoint::kCompletions ? "cmpl-"
                     : endpoint == Endpoint::kResponses ? "resp_"
                                                        : "chatcmpl-") +
                    NewUnguessableId().substr(0, 24);
    r->http_request_id = rid;
    bool parsed = false;  // ParseRequest's own errors are in the endpoint's terms already
    auto reject = [&](const ApiError& chat_error, const char* status) {
      // A Responses request was served as chat: its errors name its fields.
      const ApiError e =
          endpoint == Endpoint::kResponses && parsed ? InResponsesTerms(chat_error) : chat_error;
      http::Response resp = e.ToResponse();
      resp.headers.emplace_back("x-request-id", rid);
      // Unavailable here, not for the client: another router takes it.
      if (e.status == 503) resp.headers.emplace_back("Retry-After", "1");
      ex->Reply(std::move(resp));
      CountRequest(status);
      PDSERVE_LOG(INFO) << "request " << rid << " " << req.path << " rejected " << e.status << ": "
                        << e.message;
    };
    if (auto err = ParseRequest(endpoint, req.body, limits_, r->api.get())) {
      // A batch of prompts is split only when it is one: other requests
      // parse their body once.
      if (err->code == kPromptBatchCode) {
        ApiError batch_error;
        if (auto split = SplitPromptBatch(req.body, &batch_error)) {
          return ServeBatch(req, std::move(ex), *split, api_key);
        }
        return reject(batch_error.message.empty() ? *err : batch_error, "rejected");
      }
      return reject(*err, "rejected");
    }
    parsed = true;
    ApiRequest& api = *r->api;
    if (api.priority != 0 && opts_.scheduling_policy != "priority") {
      return reject({400,
                     "'priority' is not enabled on this server: it schedules requests in "
                     "arrival order (start the router with --scheduling-policy priority)",
                     "invalid_request_error", "priority", ""},
                    "rejected");
    }
    // Tenancy: each key's requests share cache only among themselves.
    if (opts_.salt_per_api_key && api_key)
      api.cache_salt = TenantCacheSalt(*api_key, api.cache_salt);

    // Tokenize.
    if (endpoint != Endpoint::kCompletions) {  // chat, and responses as chat
      if (auto err = RenderChatPrompt(api, &r->prompt_text)) return reject(*err, "rejected");
      r->prompt_ids = tokenizer_->Encode(r->prompt_text, /*add_special_tokens=*/false);
    } else if (api.prompt_text) {
      r->prompt_text = *api.prompt_text;
      r->prompt_ids = tokenizer_->Encode(*api.prompt_text, /*add_special_tokens=*/true);
    } else {
      r->prompt_ids = *api.prompt_ids;
      for (TokenId id : r->prompt_ids) {
        if (static_cast<size_t>(id) >= tokenizer_->vocab_size()) {
          return reject({400,
                         "token id " + std::to_string(id) + " is outside the vocabulary (size " +
                             std::to_string(tokenizer_->vocab_size()) + ")",
                         "invalid_request_error", "prompt", ""},
                        "rejected");
        }
      }
      if (api.echo) r->prompt_text = tokenizer_->Decode(r->prompt_ids, false);
    }
    // vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: as many
    // as the context holds), the echoed text theirs.
    if (api.truncate_prompt_tokens) {
      const int64_t context = core_->MaxModelLen();
      const int64_t keep = *api.truncate_prompt_tokens > 0 ? *api.truncate_prompt_tokens : context;
      if (context > 0 && keep > context) {
        return reject({400,
                       "truncate_prompt_tokens value (" + std::to_string(keep) +
                           ") is greater than max_model_len (" + std::to_string(context) +
                           "). Please, select a smaller truncation size.",
                       "invalid_request_error", "truncate_prompt_tokens", ""},
                      "rejected");
      }
      if (keep > 0 && static_cast<int64_t>(r->prompt_ids.size()) > keep) {
        r->prompt_ids.erase(r->prompt_ids.begin(), r->prompt_ids.end() - keep);
        // A text prompt's special tokens were added by encoding it: not its text.
        r->prompt_text = tokenizer_->Decode(
            r->prompt_ids, /*skip_special_tokens=*/endpoint == Endpoint::kCompletions &&
                               api.prompt_text.has_value());
      }
    }
    const int64_t prompt_len = static_cast<int64_t>(r->prompt_ids.size());
    const char* prompt_param = endpoint == Endpoint::kCompletions ? "prompt"
                               : endpoint == Endpoint::kResponses ? "input"
                                                                  : "messages";
    if (prompt_len == 0) {
      return reject({400, "the prompt is empty after tokenization", "invalid_request_error",
                     prompt_param, ""},
                    "rejected");
    }
    // The longest sequence a registered decode worker runs (0: unknown, the
    // worker then stops generation at its own limit).
    const int64_t max_len = core_->MaxModelLen();
    // A prompt scored alone (echo, max_tokens 0) may fill the context.
    const bool scored_alone = api.max_tokens == 0;
    if (max_len > 0 && (prompt_len > max_len || (prompt_len == max_len && !scored_alone))) {
      return reject(
          {400,
           "This model's maximum context length is " + std::to_string(max_len) +
               " tokens. However, your prompt has " + std::to_string(prompt_len) + " tokens.",
           "invalid_request_error", prompt_param, "context_length_exceeded"},
          "rejected");
    }
    const int64_t room = max_len > 0 ? max_len - prompt_len : kMaxTokensWhenContextUnknown;
    // Unsaid: completions' 16 (OpenAI's, and vLLM's); chat's the model's
    // max_new_tokens (generation_config.json, as vLLM takes it), else the
    // room in the context.
    const std::optional<int>& model_max = limits_.sampling_defaults.max_tokens;
    int64_t max_tokens = api.max_tokens                       ? *api.max_tokens
                         : endpoint == Endpoint::kCompletions ? 16
                         : model_max                          ? *model_max
                                                              : room;
    if (max_len > 0 && api.max_tokens && max_tokens > room) {
      return reject(
          {400,
           "This model's maximum context length is " + std::to_string(max_len) +
               " tokens. However, you requested " + std::to_string(prompt_len + max_tokens) +
               " tokens (" + std::to_string(prompt_len) + " in the prompt, " +
               std::to_string(max_tokens) + " for the completion).",
           "invalid_request_error", api.max_tokens_param, "context_length_exceeded"},
          "rejected");
    }
    max_tokens = std::min(max_tokens, room);
    api.sampling.max_tokens = static_cast<int>(max_tokens);
    api.sampling.bad_words_token_ids = BadWordsTokenIds(*tokenizer_, api.bad_words);
    if (Status st = ValidateSamplingParams(api.sampling, tokenizer_->vocab_size()); !st.ok()) {
      // Its messages start with the parameter's name ("logit_bias: ...",
      // "top_p must be ..."): that is the error's param.
      const std::string& m = st.message();
      const size_t name_end = m.find_first_not_of("abcdefghijklmnopqrstuvwxyz_");
      return reject({400, m, "invalid_request_error", m.substr(0, name_end), ""}, "rejected");
    }
    if (api.sampling.constraint) {
      if (Status st = CheckConstraint(*api.sampling.constraint); !st.ok()) {
        return reject({400, "'" + api.constraint_param + "': " + st.message(),
                       "invalid_request_error", api.constraint_param, ""},
                      "rejected");
      }
    }
    const BlockHash seed = BlockHashSeed(model_id_, api.cache_salt);
    r->hashes = HashPrompt(seed, r->prompt_ids, static_cast<size_t>(opts_.block_size));
    r->formatter = std::make_unique<ResponseFormatter>(api, r->request_id, UnixSeconds());
    r->choices.resize(static_cast<size_t>(std::max(api.n, api.best_of)));
    // A one-token prompt has nothing to score: its one piece is known here.
    if (api.echo && api.sampling.logprobs && r->prompt_ids.size() == 1) {
      TokenPiece p;
      p.token = r->prompt_ids[0];
      p.token_text = LogprobToken(api, p.token);
      p.text = r->prompt_text;
      r->prompt_pieces.push_back(std::move(p));
    }
    // A streamed echo sends the prompt first: text offsets count from its end.
    if (api.echo) {
      for (auto& c : r->choices) c.streamed_text_chars = TextOffsetLength(r->prompt_text);
    }
    // A tool parser reads markers that may be special tokens ([TOOL_CALLS],
    // a special <tool_call>): the workers keep them in the text, as vLLM
    // does, and the parser takes them out.
    if (ToolsActive(api) && tool_parser_ != ToolParser::kNone)
      api.sampling.skip_special_tokens = false;
    if (ToolsActive(api)) r->tool_functions = ToolFunctions(api.tools);
    if (ToolsActive(api) && api.stream) {
      for (auto& c : r->choices)
        c.tool_stream = std::make_unique<ToolCallStreamer>(tool_parser_, r->tool_functions);
    }
    // A constrained output (a structured output, a forced call) follows its
    // grammar from its first token: it has no thoughts to split off.
    if (reasoning_parser_ != ReasoningParser::kNone && endpoint != Endpoint::kCompletions &&
        !api.sampling.constraint) {
      r->starts_thinking = OutputStartsThinking(reasoning_parser_, r->prompt_text);
      if (api.stream) {
        for (auto& c : r->choices)
          c.reasoning = std::make_unique<ReasoningStreamer>(*r->starts_thinking);
      }
    }

    const uint64_t id = r->id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_ || draining_)
        return reject({503, "the router is shutting down", "server_error", "", ""}, "unavailable");
      inflight_.emplace(id, std::move(r));
      metrics_.inflight.Increment();
      DispatchLocked(id);
    }
    // Outside the lock: the callback runs at once if the client already left.
    ex->OnClientGone([this, id] {
      std::lock_guard<std::mutex> lock(mu_);
      CancelLocked(id, "client disconnected");
    });
  }

  // The text a chat request prefills: its messages through the chat
  // template, tools prepared (PrepareTools) and, for continue_final_message,
  // cut after the final message; or the error to answer.
  // `generates`: false for /tokenize, which renders the tools as the
  // template does but parses no output, so needs no tool parser (vLLM's).
  std::optional<ApiError> RenderChatPrompt(ApiRequest& api, std::string* text,
                                           bool generates = true) {
    if (!chat_template_) {
      return ApiError{400,
                      chat_template_error_.empty()
                          ? "this model has no chat template; use /v1/completions"
                          : "this model's chat template cannot be used (" + chat_template_error_ +
                                "); give the router one with --chat-template, or use "
                                "/v1/completions",
                      "invalid_request_error", "messages", ""};
    }
    if (generates) {
      if (auto err = PrepareTools(api)) return err;
    }
    // OpenAI's developer messages are its system messages; a template that
    // never names the role would drop them (Qwen3's does).
    if (!template_knows_developer_) {
      for (auto& m : api.messages) {
        if (m["role"] == "developer") m["role"] = "system";
      }
    }
    const bool with_tools = api.tools.is_array() && !api.tools.empty();
    const bool tool_use = with_tools && tool_use_template_;
    const ChatTemplate& tmpl = tool_use ? *tool_use_template_ : *chat_template_;
    // Content given as parts goes to a template that loops over them as
    // parts (not for continue_final_message, whose cut finds the final
    // message's text as one string).
    nlohmann::ordered_json with_parts;
    const bool parts =
        (tool_use ? tool_use_takes_parts_ : template_takes_parts_) && !api.continue_final_message;
    if (parts) {
      with_parts = api.messages;
      for (size_t i = 0; i < api.content_parts.size() && i < with_parts.size(); ++i) {
        if (!api.content_parts[i].is_null()) with_parts[i]["content"] = api.content_parts[i];
      }
    }
    auto rendered = RenderChat(tmpl, parts ? with_parts : api.messages, api.add_generation_prompt,
                               tokenizer_->bos_token(), tokenizer_->eos_token(), api.tools,
                               api.chat_template_kwargs);
    if (!rendered.ok()) {
      return ApiError{400,
                      "the chat template rejected the messages: " + rendered.status().message(),
                      "invalid_request_error", "messages", ""};
    }
    if (api.continue_final_message) {
      const StatusOr<std::string_view> final_text = FinalMessageText(api.messages.back());
      StatusOr<std::string> cut = final_text.ok() ? CutAfterFinalMessage(*rendered, *final_text)
                                                  : StatusOr<std::string>(final_text.status());
      if (!cut.ok()) {
        return ApiError{400, cut.status().message(), "invalid_request_error",
                        "continue_final_message", ""};
      }
      rendered = std::move(cut);
    }
    *text = std::move(*rendered);
    return std::nullopt;
  }

  // vLLM's POST /tokenize and /detokenize, answered here from the model's
  // tokenizer and chat template: no worker takes part. A prompt's ids are
  // those the generation endpoints would prefill for the same body.
  void HandleTokenizer(const http::Request& req, http::Exchange& ex) {
    std::string rid(req.Header("x-request-id"));
    if (!IsPlainTraceId(rid)) rid = NewUnguessableId();
    auto reply = [&](int status, const nlohmann::json& body, const std::string& what) {
      http::Response resp{status,
                          "application/json",
                          {},
                          // Token strings and decoded text need not be UTF-8.
                          body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)};
      resp.headers.emplace_back("x-request-id", rid);
      ex.Reply(std::move(resp));
      PDSERVE_LOG(INFO) << "request " << rid << " " << req.path << " " << what;
    };
    auto refuse = [&](const ApiError& e) {
      http::Response resp = e.ToResponse();
      resp.headers.emplace_back("x-request-id", rid);
      ex.Reply(std::move(resp));
      PDSERVE_LOG(INFO) << "request " << rid << " " << req.path << " rejected " << e.status << ": "
                        << e.message;
    };
    if (req.method != "POST")
      return refuse({405, "use POST for " + req.path, "invalid_request_error", "", ""});
    if (req.path == "/detokenize") {
      DetokenizeRequest d;
      if (auto err = ParseDetokenizeRequest(req.body, limits_, &d)) return refuse(*err);
      for (TokenId id : d.tokens) {
        if (static_cast<size_t>(id) >= tokenizer_->vocab_size()) {
          return refuse({400,
                         "'tokens' holds " + std::to_string(id) +
                             ", outside the vocabulary (size " +
                             std::to_string(tokenizer_->vocab_size()) + ")",
                         "invalid_request_error", "tokens", ""});
        }
      }
      return reply(200, {{"prompt", tokenizer_->Decode(d.tokens, /*skip_special_tokens=*/false)}},
                   "ok: " + std::to_string(d.tokens.size()) + " tokens");
    }
    TokenizeRequest t;
    if (auto err = ParseTokenizeRequest(req.body, limits_, &t)) return refuse(*err);
    std::string text;
    if (t.input.endpoint == Endpoint::kChatCompletions) {
      if (auto err = RenderChatPrompt(t.input, &text, /*generates=*/false)) return refuse(*err);
    } else {
      text = *t.input.prompt_text;
    }
    std::vector<TokenId> ids = tokenizer_->Encode(text, t.add_special_tokens);
    // truncate_prompt_tokens as generation applies it: the last k ids.
    if (const auto& k = t.input.truncate_prompt_tokens) {
      const int64_t keep = *k > 0 ? *k : core_->MaxModelLen();
      if (keep > 0 && static_cast<int64_t>(ids.size()) > keep)
        ids.erase(ids.begin(), ids.end() - keep);
    }
    nlohmann::json body = {{"count", ids.size()},
                           {"max_model_len", nullptr},
                           {"tokens", ids},
                           {"token_strs", nullptr}};
    if (const int64_t max_len = core_->MaxModelLen(); max_len > 0) body["max_model_len"] = max_len;
    if (t.return_token_strs) {
      nlohmann::json strs = nlohmann::json::array();
      for (TokenId id : ids) strs.push_back(tokenizer_->IdToToken(id).value_or(""));
      body["token_strs"] = std::move(strs);
    }
    reply(200, body, "ok: " + std::to_string(ids.size()) + " tokens");
  }

  static bool ToolsActive(const ApiRequest& api) {
    return !api.tools.is_null() && api.tool_choice != ApiRequest::ToolChoice::kNone;
  }

  // Tool calling: a parser must know the model's format; tool_choice
  // required or named constrains the output to calls in that format, each
  // function's parameters checked as a schema first so that an error names
  // the function.
  std::optional<ApiError> PrepareTools(ApiRequest& api) {
    if (!ToolsActive(api)) return std::nullopt;
    if (tool_parser_ == ToolParser::kNone) {
      return ApiError{400,
                      "this model's chat template writes no tool calls this server can parse; "
                      "start the router with --tool-call-parser (hermes, qwen3, qwen3_coder, "
                      "mistral, llama3_json, deepseek_v3, deepseek_v31)",
                      "invalid_request_error", "tools", ""};
    }
    using TC = ApiRequest::ToolChoice;
    if (api.tool_choice != TC::kRequired && api.tool_choice != TC::kNamed) return std::nullopt;
    for (size_t k = 0; k < api.tools.size(); ++k) {
      const auto& fn = api.tools[k]["function"];
      if (api.tool_choice == TC::kNamed && fn["name"] != api.tool_choice_name) continue;
      if (!fn.contains("parameters") || fn["parameters"].is_null()) continue;
      const std::string param = "tools[" + std::to_string(k) + "].function.parameters";
      Status st = CheckConstraint({OutputConstraint::Kind::kJsonSchema, fn["parameters"].dump()});
      if (!st.ok())
        return ApiError{400, "'" + param + "': " + st.message(), "invalid_request_error", param,
                        ""};
    }
    std::optional<std::string> named;
    if (api.tool_choice == TC::kNamed) named = api.tool_choice_name;
    // A named function is called once (OpenAI's forced call), whatever
    // parallel_tool_calls says; `required` may call several unless it is false.
    const bool parallel = api.parallel_tool_calls && !named;
    auto grammar = ToolCallGrammar(tool_parser_, api.tools, named, parallel,
                                   opts_.structured.max_text_bytes, mistral_name_args_);
    if (!grammar.ok())
      return ApiError{400, grammar.status().message(), "invalid_request_error", "tools", ""};
    api.sampling.constraint =
        OutputConstraint{OutputConstraint::Kind::kGrammar, std::move(grammar).value()};
    api.constraint_param = "tools";
    return std::nullopt;
  }

  // Compiles a constraint (without token masks) to refuse what would not
  // compile on a worker; constraints that compiled are remembered by hash.
  Status CheckConstraint(const OutputConstraint& c) {
    const uint64_t h = structured::ConstraintHash(c);
    {
      std::lock_guard<std::mutex> lock(constraints_mu_);
      if (good_constraints_.count(h)) return Status::Ok();
    }
    auto g = structured::ConstraintGrammar(c, opts_.structured);
    if (!g.ok()) return g.status();
    std::lock_guard<std::mutex> lock(constraints_mu_);
    if (good_constraints_.size() >= 4096) good_constraints_.clear();
    good_constraints_.insert(h);
    return Status::Ok();
  }

  // Routes and sends Generate; on failure answers the client. Requires mu_.
  void DispatchLocked(uint64_t id) {
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    Inflight& r = *it->second;
    while (true) {
      if (r.attempts >= opts_.max_attempts) {
        return FailLocked(
            id, 503,
            "no worker could serve the request after " + std::to_string(r.attempts) + " attempts",
            "server_error", /*retry_after=*/true, "unavailable");
      }
      ++r.attempts;
      RouteRequest rr;
      rr.request_id = id;
      rr.block_hashes = r.hashes;
      rr.prompt_tokens = static_cast<int64_t>(r.prompt_ids.size());
      rr.max_new_tokens = r.api->sampling.max_tokens;
      rr.avoid = r.failed_on;
      auto decision = core_->Route(rr);
      // Tokenizing, hashing and the first choice of workers, as its help says.
      if (r.attempts == 1) metrics_.route_seconds.Observe(SecondsSince(r.arrived));
      if (!decision.ok()) {
        return FailLocked(id, 503, "no decode worker is available: " + decision.status().message(),
                          "server_error", /*retry_after=*/true, "unavailable");
      }
      auto decode_link = LinkOf(decision->decode);
      if (!decode_link) {
        core_->OnRequestFinished(id);
        continue;
      }
      if (r.choices.size() > 1 && !decode_link->parallel_sampling) {
        core_->OnRequestFinished(id);
        return FailLocked(
            id, 503, "worker " + decode_link->name + " does not support n > 1 (an older version)",
            "server_error", /*retry_after=*/true, "unavailable");
      }
      if (r.api->sampling.constraint && !decode_link->structured_outputs) {
        core_->OnRequestFinished(id);
        return FailLocked(id, 503,
                          "worker " + decode_link->name +
                              " does not support structured outputs (an older version)",
                          "server_error", /*retry_after=*/true, "unavailable");
      }
      SetWireIdLocked(r, NewUnguessableId());
      proto::Envelope env;
      proto::Generate* g = env.mutable_generate();
      g->set_request_id(r.wire_id);
      g->set_trace_id(r.http_request_id);
      for (TokenId t : r.prompt_ids) g->add_prompt_token_ids(t);
      SamplingParams sampling = r.api->sampling;
      // best_of picks by likelihood: the chosen tokens' logprobs are needed.
      if (r.api->best_of > r.api->n && !sampling.logprobs) sampling.logprobs = 0;
      ToProto(sampling, g->mutable_sampling());
      g->set_n(static_cast<uint32_t>(r.choices.size()));
      g->set_cache_salt(r.api->cache_salt);
      g->set_priority(r.api->priority);
      // The prefill decision travels with the request: an address means
      // "prefill remotely there", none means "prefill locally". A prompt to
      // score is prefilled where its logits are wanted: locally, no copy.
      if (sampling.prompt_logprobs) {
        if (decision->prefill) core_->OnPrefillDone(id);
        decision->prefill.reset();
        if (decision->copy_from) core_->OnCopyLanded(id);
        decision->copy_from.reset();
      }
      if (decision->prefill) {
        if (auto p = LinkOf(*decision->prefill)) {
          g->set_prefill_worker_id(p->name);
          g->set_prefill_address(p->control_address);
        } else {
          core_->OnPrefillDone(id);  // no link: local prefill after all
          decision->prefill.reset();
        }
      }
      // A hot-prefix copy rides on the existing hand-off: the holder is the
      // request's prefill worker; it computes only what it lacks (the prefix
      // is cached there) and writes every block the decode worker lacks.
      // Without a link the decode worker recomputes the prefix.
      r.copy_from.reset();
      if (decision->copy_from) {
        auto holder = LinkOf(*decision->copy_from);
        if (holder && !holder->draining) {
          g->set_prefill_worker_id(holder->name);
          g->set_prefill_address(holder->control_address);
          g->set_prefix_copy(true);
          r.copy_from = decision->copy_from;
          metrics_.replications.Add({{"outcome", "started"}}).Increment();
          metrics_.replicated_blocks.Increment(static_cast<double>(decision->copy_blocks));
        } else {
          metrics_.replications.Add({{"outcome", "failed"}}).Increment();
          core_->OnCopyLanded(id);  // nothing travels: its links are free
        }
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(r.deadline - Clock::now()).count();
      g->set_deadline_ms(static_cast<uint32_t>(std::max<int64_t>(1, left)));
      if (Status st = decode_link->conn->Send(std::move(env)); !st.ok()) {
        PDSERVE_LOG(WARN) << "request " << r.http_request_id << ": send to " << decode_link->name
                          << " failed: " << st.message();
        core_->OnRequestFinished(id);
        continue;
      }
      // The decision's pending entries, now that the request is on its way.
      core_->FlushPending();
      r.decode = decision->decode;
      r.decode_conn = decode_link->conn->id();
      r.prefill = decision->prefill;
      if (opts_.drain_push_blocks > 0) {
        // Both hold the prompt once it is served: either may drain.
        RecordHotPromptLocked(decision->decode, r);
        if (decision->prefill) RecordHotPromptLocked(*decision->prefill, r);
      }
      // A request's prompt and predicted hits count once (at its first
      // dispatch), as its TTFT does; every decision counts.
      if (!r.counted) {
        r.counted = true;
        metrics_.prompt_tokens.Increment(static_cast<double>(r.prompt_ids.size()));
        const int64_t overlap =
            decision->prefill ? decision->prefill_overlap_blocks : decision->decode_overlap_blocks;
        metrics_.predicted_hit_tokens.Increment(static_cast<double>(overlap * opts_.block_size));
        if (decision->prefill_host_blocks > 0) {
          metrics_.predicted_tier_hit_tokens.Add({{"tier", "host"}})
              .Increment(static_cast<double>(decision->prefill_host_blocks * opts_.block_size));
        }
        if (decision->prefill_disk_blocks > 0) {
          metrics_.predicted_tier_hit_tokens.Add({{"tier", "disk"}})
              .Increment(static_cast<double>(decision->prefill_disk_blocks * opts_.block_size));
        }
      }
      metrics_.decisions
          .Add({{"kind", decision->prefill || r.copy_from ? "remote_prefill" : "local_prefill"}})
          .Increment();
      if (r.attempts > 1) metrics_.retries.Increment();
      return;
    }
  }

  // ------------------------------------------------------------ control side
  void OnControl(const control::ConnectionPtr& c, proto::Envelope& e) {
    std::lock_guard<std::mutex> lock(mu_);
    WorkerLink& link = links_[c->id()];
    link.conn = c;
    switch (e.body_case()) {
      case proto::Envelope::kRegistration:
        return OnRegisterLocked(link, e.registration());
      case proto::Envelope::kLoad: {
        if (!link.id) return;
        const auto& l = e.load();
        WorkerLoad load;
        load.queued_prefill_tokens = static_cast<int64_t>(l.queued_prefill_tokens());
        load.running = l.running_requests();
        load.waiting = l.waiting_requests();
        load.free_blocks = static_cast<int64_t>(l.free_blocks());
        load.total_blocks = static_cast<int64_t>(l.total_blocks());
        (void)core_->OnLoad(*link.id, load);
        return;
      }
      case proto::Envelope::kKvEvents:
        return OnKvEventsLocked(link, e.kv_events());
      case proto::Envelope::kKvSnapshot: {
        if (!link.id) return;
        const auto& s = e.kv_snapshot();
        std::vector<BlockHash>* parts[] = {&link.snapshot, &link.snapshot_host,
                                           &link.snapshot_disk};
        if (s.chunk_index() == 0) {
          for (auto* part : parts) {
            snapshot_pending_bytes_ -= part->size() * sizeof(BlockHash);
            part->clear();
          }
        }
        // A worker cannot cache more blocks than it has, in its pool or in
        // a tier; a snapshot that claims more is a fault, and must not grow
        // the router without bound.
        // A tier larger than --max-snapshot-blocks (its capacity was cut
        // to that at Register) is indexed up to that many blocks.
        const struct {
          const google::protobuf::RepeatedField<uint64_t>& hashes;
          int64_t capacity;
          bool clamped;
          const char* what;
        } tiers[] = {
            {s.block_hashes(), link.kv_capacity_blocks, false, "KV"},
            {s.host_block_hashes(), link.host_tier_blocks, link.host_tier_clamped, "host tier"},
            {s.disk_block_hashes(), link.disk_tier_blocks, link.disk_tier_clamped, "disk tier"}};
        for (size_t t = 0; t < 3; ++t) {
          const size_t limit =
              static_cast<size_t>(std::min<int64_t>(opts_.max_snapshot_blocks, tiers[t].capacity));
          size_t take = static_cast<size_t>(tiers[t].hashes.size());
          if (parts[t]->size() + take > limit) {
            if (!tiers[t].clamped) {
              metrics_.control_rejected.Add({{"reason", "snapshot_too_large"}}).Increment();
              return RefuseLocked(link, std::string(tiers[t].what) + " snapshot of more than " +
                                            std::to_string(limit) +
                                            " blocks (registered capacity " +
                                            std::to_string(tiers[t].capacity) + ")");
            }
            take = limit - std::min(limit, parts[t]->size());
          }
          parts[t]->insert(parts[t]->end(), tiers[t].hashes.begin(),
                           tiers[t].hashes.begin() + static_cast<ptrdiff_t>(take));
          snapshot_pending_bytes_ += take * sizeof(BlockHash);
        }
        if (s.last_chunk()) {
          Status st = core_->OnSnapshot(*link.id, s.sequence(), link.snapshot, link.snapshot_host,
                                        link.snapshot_disk);
          if (!st.ok())
            PDSERVE_LOG(WARN) << "worker " << link.name << ": snapshot refused: " << st.message();
          link.synced = st.ok();
          PDSERVE_LOG(INFO) << "worker " << link.name << " synced: " << link.snapshot.size()
                            << " cached blocks (" << link.snapshot_host.size()
                            << " in its host tier, " << link.snapshot_disk.size()
                            << " on its disk) at sequence " << s.sequence();
          for (auto* part : parts) {
            snapshot_pending_bytes_ -= part->size() * sizeof(BlockHash);
            part->clear();
            part->shrink_to_fit();
          }
          UpdateWorkerGaugesLocked();
        }
        return;
      }
      case proto::Envelope::kToken:
        return OnTokenLocked(link, e.token());
      case proto::Envelope::kFinished:
        return OnFinishedLocked(link, e.finished());
      case proto::Envelope::kError:
        return OnRequestErrorLocked(link, e.error());
      case proto::Envelope::kGoodbye:
        if (e.goodbye().drain()) {
          PDSERVE_LOG(INFO) << "worker " << link.name << " is draining: " << e.goodbye().reason();
          link.leaving = true;
          DrainLocked(link);
        }
        return;
      default:
        PDSERVE_LOG(WARN) << "worker " << link.name << " sent an unexpected message (field "
                          << static_cast<int>(e.body_case()) << "); ignored";
    }
  }

  // The request dispatched under `wire_id` on `link`'s connection, or null
  // (finished meanwhile, or a message from a connection it was not sent on,
  // which is counted and logged, and changes nothing).
  Inflight* DispatchedOnLocked(WorkerLink& link, const std::string& wire_id, const char* what) {
    auto w = wire_ids_.find(wire_id);
    if (w != wire_ids_.end()) {
      auto it = inflight_.find(w->second);
      if (it != inflight_.end() && it->second->decode_conn == link.conn->id())
        return it->second.get();
      if (it != inflight_.end()) {
        metrics_.control_rejected.Add({{"reason", "not_dispatched_here"}}).Increment();
        // Powers of two: a misbehaving peer cannot flood the log.
        if (std::has_single_bit(++link.rejected_messages)) {
          PDSERVE_LOG(WARN) << "worker " << link.name << " from " << link.conn->remote_address()
                            << " sent " << what << " for a request not dispatched to it; ignored ("
                            << link.rejected_messages << " so far)";
        }
      }
    }
    return nullptr;
  }

  void SetWireIdLocked(Inflight& r, std::string wire_id) {
    if (!r.wire_id.empty()) wire_ids_.erase(r.wire_id);
    r.wire_id = std::move(wire_id);
    if (!r.wire_id.empty()) wire_ids_[r.wire_id] = r.id;
  }

  // ---------------------------------------------- scale-down (drain push)
  struct Pushed {
    size_t prompts = 0;
    int64_t blocks = 0;
  };

  // No new requests for `link` (running ones finish); with drain pushes its
  // hot prompts go to the survivors. Idempotent.
  Pushed DrainLocked(WorkerLink& link) {
    Pushed pushed;
    if (link.draining) return pushed;
    link.synced = false;
    link.draining = true;
    if (link.id) core_->SetDraining(*link.id, true);
    if (link.id && opts_.drain_push_blocks > 0) pushed = PushHotPromptsLocked(link);
    if (link.id && WritesKvForOthers(link)) BroadcastPrefillWorkersLocked();
    UpdateWorkerGaugesLocked();
    return pushed;
  }

  // The worker an admin request's body {"worker": NAME} names, under mu_;
  // null when it answered the request itself (bad body, no such worker).
  WorkerLink* AdminTargetLocked(const http::Request& req, const std::shared_ptr<http::Exchange>& ex,
                                const char* what) {
    if (req.method != "POST") {
      ex->Reply(http::ErrorResponse(405, "use POST"));
      return nullptr;
    }
    const nlohmann::json body = nlohmann::json::parse(req.body, nullptr, false);
    if (!body.is_object() || !body.contains("worker") || !body["worker"].is_string()) {
      ex->Reply(http::ErrorResponse(400, "expected {\"worker\": NAME}", "invalid_request_error",
                                    "worker", ""));
      return nullptr;
    }
    const std::string name = body["worker"];
    for (auto& [_, l] : links_) {
      if (l.id && l.name == name) return &l;
    }
    PDSERVE_LOG(INFO) << "admin: " << what << " " << name << ": no such worker";
    ex->Reply(http::ErrorResponse(404, "no registered worker '" + name + "'",
                                  "invalid_request_error", "worker", "not_found"));
    return nullptr;
  }

  // POST /admin/drain {"worker": NAME}: the operator's scale-down before
  // terminating a worker (needs --admin-key-file).
  void HandleAdminDrain(const http::Request& req, const std::shared_ptr<http::Exchange>& ex) {
    std::lock_guard<std::mutex> lock(mu_);
    WorkerLink* l = AdminTargetLocked(req, ex, "drain");
    if (!l) return;
    const bool already = l->draining;
    const Pushed pushed = DrainLocked(*l);
    PDSERVE_LOG(INFO) << "admin: drain " << l->name << (already ? " (already draining)" : "")
                      << ": " << pushed.prompts << " prompt(s), " << pushed.blocks
                      << " block(s) pushed";
    ex->Reply({200,
               "application/json",
               {},
               nlohmann::json{{"worker", l->name},
                              {"draining", true},
                              {"pushed_prompts", pushed.prompts},
                              {"pushed_blocks", pushed.blocks}}
                   .dump()});
  }

  // POST /admin/undrain {"worker": NAME}: puts a worker drained by
  // /admin/drain back into service without restarting it: it is routed to
  // at once, and its prefix index is rebuilt from a fresh snapshot (KV
  // events of a drained worker are not checked for gaps; it counts as ready
  // again once the snapshot is in, "worker NAME synced"). A worker that is
  // shutting down itself (SIGTERM) cannot be put back: 409.
  void HandleAdminUndrain(const http::Request& req, const std::shared_ptr<http::Exchange>& ex) {
    std::lock_guard<std::mutex> lock(mu_);
    WorkerLink* l = AdminTargetLocked(req, ex, "undrain");
    if (!l) return;
    if (l->leaving) {
      PDSERVE_LOG(INFO) << "admin: undrain " << l->name << ": refused, it is shutting down";
      return ex->Reply(http::ErrorResponse(
          409, "worker '" + l->name + "' is shutting down and cannot be put back",
          "invalid_request_error", "worker", "worker_leaving"));
    }
    const bool was_draining = l->draining;
    if (was_draining) {
      l->draining = false;
      core_->SetDraining(*l->id, false);
      proto::Envelope env;
      env.mutable_resync()->set_reason("undrained");
      (void)l->conn->Send(std::move(env));
      if (WritesKvForOthers(*l)) BroadcastPrefillWorkersLocked();
      UpdateWorkerGaugesLocked();
    }
    PDSERVE_LOG(INFO) << "admin: undrain " << l->name
                      << (was_draining ? ": routed to again; resyncing its prefix index"
                                       : " (was not draining)");
    ex->Reply({200,
               "application/json",
               {},
               nlohmann::json{{"worker", l->name}, {"draining", false}}.dump()});
  }

  // The prompts each worker served most often lately, by the hash of their
  // last full block: what a draining worker has the survivors copy.
  struct HotPrompt {
    std::vector<TokenId> tokens;  // whole blocks only
    std::vector<BlockHash> hashes;
    std::string cache_salt;
    int64_t uses = 0;
    uint64_t last_use = 0;
  };
  static constexpr size_t kHotPromptsPerWorker = 64;

  void RecordHotPromptLocked(WorkerId worker, const Inflight& r) {
    if (r.hashes.empty()) return;
    auto& prompts = hot_prompts_[worker];
    HotPrompt& p = prompts[r.hashes.back()];
    if (p.uses == 0) {
      const size_t n = r.hashes.size() * static_cast<size_t>(opts_.block_size);
      p.tokens.assign(r.prompt_ids.begin(), r.prompt_ids.begin() + static_cast<ptrdiff_t>(n));
      p.hashes = r.hashes;
      p.cache_salt = r.api->cache_salt;
    }
    ++p.uses;
    p.last_use = ++hot_clock_;
    if (prompts.size() > kHotPromptsPerWorker) {  // forget the least recently used
      auto coldest = prompts.begin();
      for (auto it = prompts.begin(); it != prompts.end(); ++it) {
        if (it->second.last_use < coldest->second.last_use) coldest = it;
      }
      prompts.erase(coldest);
    }
  }

  // A worker announced its drain: each of its hottest prompts that it still
  // holds goes, as a one-token request, to a survivor in turn with the
  // draining worker as prefill worker, which writes the blocks the survivor
  // lacks (a survivor without a link to it computes them), up to
  // drain_push_blocks blocks.
  Pushed PushHotPromptsLocked(const WorkerLink& leaving) {
    auto found = hot_prompts_.find(*leaving.id);
    if (found == hot_prompts_.end() || !WritesKvForOthers(leaving)) return {};
    std::vector<const WorkerLink*> survivors;
    for (auto& [_, l] : links_) {
      if (l.id && l.synced && !l.draining && l.role != Role::kPrefill && &l != &leaving)
        survivors.push_back(&l);
    }
    if (survivors.empty()) return {};
    std::vector<std::pair<BlockHash, const HotPrompt*>> order;
    for (const auto& [hash, p] : found->second) order.emplace_back(hash, &p);
    std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
      return a.second->uses != b.second->uses ? a.second->uses > b.second->uses
                                              : a.second->last_use > b.second->last_use;
    });
    std::vector<PushCandidate> candidates;
    for (const auto& [_, p] : order) candidates.push_back({p->hashes, p->uses});
    int64_t pushed_blocks = 0;
    size_t pushed = 0;
    for (const PushPlan& plan :
         core_->PlanDrainPush(*leaving.id, candidates, opts_.drain_push_blocks)) {
      const HotPrompt& p = *order[plan.candidate].second;
      const WorkerLink* target = LinkOf(plan.target);
      if (!target) continue;
      proto::Envelope env;
      proto::Generate* g = env.mutable_generate();
      const std::string wire_id = "drain-push-" + NewUnguessableId();
      g->set_request_id(wire_id);
      for (TokenId t : p.tokens) g->add_prompt_token_ids(t);
      SamplingParams one_token;
      one_token.temperature = 0;
      one_token.max_tokens = 1;
      ToProto(one_token, g->mutable_sampling());
      g->set_cache_salt(p.cache_salt);
      g->set_prefill_worker_id(leaving.name);
      g->set_prefill_address(leaving.control_address);
      g->set_prefix_copy(true);
      g->set_deadline_ms(static_cast<uint32_t>(opts_.request_timeout_ms));
      if (!target->conn->Send(std::move(env)).ok()) continue;
      pushes_[wire_id] = Push{target->conn->id(), false};
      pushed_blocks += plan.blocks;
      ++pushed;
      metrics_.replications.Add({{"outcome", "started"}}).Increment();
      metrics_.replicated_blocks.Increment(static_cast<double>(plan.blocks));
    }
    hot_prompts_.erase(found);
    PDSERVE_LOG(INFO) << "worker " << leaving.name << " drains: " << pushed << " hot prompt(s), "
                      << pushed_blocks << " block(s) pushed to " << survivors.size()
                      << " survivor(s)";
    return {pushed, pushed_blocks};
  }

  // True when `wire_id` is a drain push (its result is only counted).
  bool EndPushLocked(const WorkerLink& link, const std::string& wire_id, bool ok) {
    auto it = pushes_.find(wire_id);
    if (it == pushes_.end() || it->second.conn != link.conn->id()) return false;
    ok = ok && it->second.copied;  // a push that fell back to local prefill copied nothing
    pushes_.erase(it);
    metrics_.replications.Add({{"outcome", ok ? "finished" : "failed"}}).Increment();
    return true;
  }

  // Whether decode workers connect to `l`'s peer port: prefill workers, and
  // with replication or drain pushes every worker (any holder may copy a
  // prefix; decode-only workers write KV for those copies alone).
  bool WritesKvForOthers(const WorkerLink& l) const {
    return l.role == Role::kPrefill || opts_.replication_copy_cost > 0 ||
           opts_.drain_push_blocks > 0;
  }

  // The workers `recipient` may be told to take a prefill from: registered,
  // writing KV for others, not draining, not itself.
  proto::Envelope PrefillWorkersLocked(const WorkerLink& recipient) {
    proto::Envelope env;
    auto* list = env.mutable_prefill_workers();
    for (auto& [_, l] : links_) {
      // A draining worker stays listed when it may push its prompts: the
      // router sends it no new prefills either way.
      if (!l.id || !WritesKvForOthers(l) || &l == &recipient) continue;
      if (l.draining && opts_.drain_push_blocks == 0) continue;
      auto* w = list->add_workers();
      w->set_worker_id(l.name);
      w->set_control_address(l.control_address);
    }
    return env;
  }

  void BroadcastPrefillWorkersLocked() {
    for (auto& [_, l] : links_) {
      if (l.id && l.role != Role::kPrefill) (void)l.conn->Send(PrefillWorkersLocked(l));
    }
  }

  void RefuseLocked(WorkerLink& link, const std::string& why) {
    PDSERVE_LOG(WARN) << "refusing worker '" << link.name << "' from "
                      << link.conn->remote_address() << ": " << why;
    proto::Envelope env;
    env.mutable_error()->set_code(proto::ERROR_CODE_INVALID_ARGUMENT);
    env.mutable_error()->set_message(why);
    (void)link.conn->Send(std::move(env));
    // Closed from a fresh loop turn: Close may complete inline, and its
    // on_close takes mu_, which the caller holds.
    loop_->Post([conn = link.conn, why] { conn->Close(why); });
  }

  void OnRegisterLocked(WorkerLink& link, const proto::Register& reg) {
    link.name = reg.worker_id();
    if (link.id) return RefuseLocked(link, "Register sent twice on one connection");
    auto role = FromProto(reg.role());
    if (!role) return RefuseLocked(link, "worker role must be prefill, decode or both");
    if (reg.model_id() != model_id_) {
      return RefuseLocked(link, "model_id: '" + reg.model_id() + "' on the worker, '" + model_id_ +
                                    "' on the router");
    }
    if (static_cast<int64_t>(reg.block_size()) != opts_.block_size) {
      return RefuseLocked(link, "block_size: " + std::to_string(reg.block_size()) +
                                    " on the worker, " + std::to_string(opts_.block_size) +
                                    " on the router");
    }
    if (reg.hash_version() != kBlockHashVersion) {
      return RefuseLocked(link, "hash_version: " + std::to_string(reg.hash_version()) +
                                    " on the worker, " + std::to_string(kBlockHashVersion) +
                                    " on the router");
    }
    std::vector<int64_t> group_windows;
    {
      // The KV layer groups: the first worker's are the model's; every
      // other must have the same (the prefix prediction follows them). With
      // no worker registered any more the next one's are learnt afresh, so
      // that no worker fixes them for the router's whole life. The prefix
      // index works per group and prompt block: a worker claiming more
      // groups than a model has layers, or windows past any context, is
      // refused before it costs every request.
      if (by_worker_.empty()) kv_groups_known_ = false;
      if (reg.kv_group_windows_size() > kMaxKvGroups ||
          reg.kv_sink_tokens() > static_cast<uint64_t>(kMaxKvWindowTokens)) {
        metrics_.control_rejected.Add({{"reason", "registration_invalid"}}).Increment();
        return RefuseLocked(
            link, "kv_group_windows: " + std::to_string(reg.kv_group_windows_size()) +
                      " groups (at most " + std::to_string(kMaxKvGroups) + "), kv_sink_tokens " +
                      std::to_string(reg.kv_sink_tokens()));
      }
      std::vector<int64_t> windows(reg.kv_group_windows().begin(), reg.kv_group_windows().end());
      for (int64_t w : windows) {
        if (w < 0 || w > kMaxKvWindowTokens) {
          metrics_.control_rejected.Add({{"reason", "registration_invalid"}}).Increment();
          return RefuseLocked(link, "kv_group_windows: a window of " + std::to_string(w) +
                                        " tokens is outside [0, " +
                                        std::to_string(kMaxKvWindowTokens) + "]");
        }
      }
      if (windows.size() == 1 && windows[0] == 0) windows.clear();
      auto describe = [](const std::vector<int64_t>& w) {
        std::string s = "[";
        for (size_t i = 0; i < w.size() && i < 16; ++i) s += (i ? "," : "") + std::to_string(w[i]);
        return s + (w.size() > 16 ? ",... " + std::to_string(w.size()) + " groups]" : "]");
      };
      if (const auto known = core_->KvGroupWindows(); kv_groups_known_ && known != windows) {
        return RefuseLocked(link, "kv_group_windows: " + describe(windows) + " on the worker, " +
                                      describe(known) + " on the router");
      }
      if (const int64_t known = core_->KvSinkTokens();
          kv_groups_known_ && known != static_cast<int64_t>(reg.kv_sink_tokens())) {
        return RefuseLocked(link, "kv_sink_tokens: " + std::to_string(reg.kv_sink_tokens()) +
                                      " on the worker, " + std::to_string(known) +
                                      " on the router");
      }
      group_windows = std::move(windows);
    }
    // SnapKV's budget and window decide which cached prefix a long prompt
    // reuses: one rule per router, and a budget that can hold its window.
    const int64_t snapkv_budget = reg.kv_snapkv_budget_tokens(),
                  snapkv_window = reg.kv_snapkv_observation_window();
    if (snapkv_budget > kMaxSnapKvBudgetTokens ||
        (snapkv_budget == 0 ? snapkv_window != 0
                            : snapkv_window < 1 || snapkv_window > snapkv_budget)) {
      metrics_.control_rejected.Add({{"reason", "registration_invalid"}}).Increment();
      return RefuseLocked(
          link, "kv_snapkv_budget_tokens " + std::to_string(snapkv_budget) +
                    " with kv_snapkv_observation_window " + std::to_string(snapkv_window) +
                    ": the window must be in [1, budget] and the budget at most " +
                    std::to_string(kMaxSnapKvBudgetTokens) + " (both 0 without SnapKV)");
    }
    if (const auto known = core_->SnapKv();
        kv_groups_known_ && known != std::pair{snapkv_budget, snapkv_window}) {
      return RefuseLocked(link, "SnapKV budget/window: " + std::to_string(snapkv_budget) + "/" +
                                    std::to_string(snapkv_window) + " on the worker, " +
                                    std::to_string(known.first) + "/" +
                                    std::to_string(known.second) + " on the router");
    }
    if (reg.kv_capacity_blocks() == 0 ||
        reg.kv_capacity_blocks() > static_cast<uint64_t>(opts_.max_snapshot_blocks)) {
      metrics_.control_rejected.Add({{"reason", "registration_invalid"}}).Increment();
      return RefuseLocked(link, "kv_capacity_blocks " + std::to_string(reg.kv_capacity_blocks()) +
                                    " is outside [1, " + std::to_string(opts_.max_snapshot_blocks) +
                                    "] (router --max-snapshot-blocks)");
    }
    if (reg.control_address().size() > kMaxControlAddressBytes) {
      metrics_.control_rejected.Add({{"reason", "registration_invalid"}}).Increment();
      return RefuseLocked(link,
                          "control_address of " + std::to_string(reg.control_address().size()) +
                              " bytes (at most " + std::to_string(kMaxControlAddressBytes) + ")");
    }
    auto id = core_->AddWorker(reg.worker_id(), *role, reg.max_model_len(),
                               static_cast<int64_t>(reg.kv_capacity_blocks()));
    if (!id.ok()) {
      // The live worker of that name keeps its place: a second connection
      // claiming it never evicts the first.
      metrics_.control_rejected.Add({{"reason", "duplicate_worker"}}).Increment();
      return RefuseLocked(link, id.status().message());
    }
    if (!kv_groups_known_) {
      kv_groups_known_ = true;
      core_->SetKvGroupWindows(std::move(group_windows), reg.kv_sink_tokens());
      core_->SetSnapKv(snapkv_budget, snapkv_window);
    }
    link.id = *id;
    link.role = *role;
    link.control_address = reg.control_address();
    link.kv_capacity_blocks = static_cast<int64_t>(reg.kv_capacity_blocks());
    link.host_tier_blocks = static_cast<int64_t>(
        std::min<uint64_t>(reg.host_tier_capacity_blocks(), opts_.max_snapshot_blocks));
    link.host_tier_clamped =
        reg.host_tier_capacity_blocks() > static_cast<uint64_t>(opts_.max_snapshot_blocks);
    link.disk_tier_clamped =
        reg.disk_tier_capacity_blocks() > static_cast<uint64_t>(opts_.max_snapshot_blocks);
    link.structured_outputs = reg.structured_outputs();
    link.parallel_sampling = reg.parallel_sampling();
    link.disk_tier_blocks = static_cast<int64_t>(
        std::min<uint64_t>(reg.disk_tier_capacity_blocks(), opts_.max_snapshot_blocks));
    by_worker_[*id] = link.conn->id();
    PDSERVE_LOG(INFO) << "worker " << link.name << " registered: role " << RoleName(*role) << ", "
                      << reg.kv_capacity_blocks() << " KV blocks, max_model_len "
                      << (reg.max_model_len() ? std::to_string(reg.max_model_len()) : "unknown")
                      << ", control " << reg.control_address();
    proto::Envelope env;
    env.mutable_resync()->set_reason("new connection");
    (void)link.conn->Send(std::move(env));
    if (WritesKvForOthers(link)) {
      BroadcastPrefillWorkersLocked();  // re-admitted: decode workers reconnect at once
    } else {
      (void)link.conn->Send(PrefillWorkersLocked(link));
    }
    UpdateWorkerGaugesLocked();
  }

  void OnKvEventsLocked(WorkerLink& link, const proto::KvEvents& ev) {
    if (!link.id) return;
    const KvEventBatch batch = FromProto(ev);
    const ApplyOutcome out = core_->OnKvEvents(*link.id, batch);
    if (out == ApplyOutcome::kNeedsResync && link.synced) {
      link.synced = false;
      metrics_.event_gaps.Increment();
      PDSERVE_LOG(WARN) << "worker " << link.name << ": KV event gap at sequence "
                        << batch.sequence_number << "; resyncing";
      proto::Envelope env;
      env.mutable_resync()->set_reason("sequence gap");
      (void)link.conn->Send(std::move(env));
      UpdateWorkerGaugesLocked();
    }
  }

  void OnWorkerClosed(const control::ConnectionPtr& c, const Status& why) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = links_.find(c->id());
    if (it == links_.end()) return;
    WorkerLink link = std::move(it->second);
    links_.erase(it);
    // Every part of a snapshot still being received (device, host, disk).
    for (const auto* part : {&link.snapshot, &link.snapshot_host, &link.snapshot_disk}) {
      snapshot_pending_bytes_ -= part->size() * sizeof(BlockHash);
    }
    // Drain pushes to it end here: failed, as they copied nothing it keeps.
    std::erase_if(pushes_, [&](const auto& entry) {
      if (entry.second.conn != link.conn->id()) return false;
      metrics_.replications.Add({{"outcome", "failed"}}).Increment();
      return true;
    });
    if (!link.id) return;
    by_worker_.erase(*link.id);
    hot_prompts_.erase(*link.id);  // its slot's next worker starts with none
    if (WritesKvForOthers(link)) BroadcastPrefillWorkersLocked();
    std::vector<uint64_t> orphans = core_->RemoveWorker(*link.id);
    PDSERVE_LOG(WARN) << "worker " << link.name << " disconnected (" << why.message()
                      << "); index purged, " << orphans.size() << " request(s) affected";
    // Requests whose prefill worker died stay with their decode worker, which
    // falls back to local prefill; only those it was decoding move elsewhere.
    for (uint64_t id : orphans) {
      auto it = inflight_.find(id);
      if (it == inflight_.end() || it->second->decode != link.id) continue;
      RetryOrFailLocked(id, "worker " + link.name + " disconnected");
    }
    UpdateWorkerGaugesLocked();
  }

  void RetryOrFailLocked(uint64_t id, const std::string& why) {
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    Inflight& r = *it->second;
    // Retried while nothing has reached the client: before the first token,
    // or at any point of an unstreamed answer (its output is still here, and
    // is dropped to start again).
    if (!r.started_stream && !stopping_) {
      PDSERVE_LOG(INFO) << "request " << r.http_request_id << ": " << why
                        << (r.first_token_seen ? " during generation, nothing sent yet"
                                               : " before the first token")
                        << "; retrying";
      if (r.copy_from && !r.first_token_seen) {
        metrics_.replications.Add({{"outcome", "failed"}}).Increment();
      }
      // The failed attempt's other sequences (n > 1: one failed, the rest
      // run on) stop there; the retry has a wire id of its own.
      if (r.decode) SendCancelLocked(r, "retried after: " + why);
      r.decode.reset();
      r.prefill.reset();
      if (r.first_token_seen) {
        for (auto& c : r.choices) c = Inflight::Choice{};
        r.choices_finished = 0;
        r.usage = Usage{};
        if (r.prompt_ids.size() > 1) r.prompt_pieces.clear();  // a one-token prompt's is not sent
        r.prompt_pieces_pending.clear();
        r.first_token_seen = false;
      }
      return DispatchLocked(id);
    }
    FailLocked(id, 503, why + " during generation", "server_error", /*retry_after=*/true);
  }

  // A token's string for logprobs: the exact bytes it adds after other text
  // (" there" for "▁there", a byte token's one byte), so that a choice's
  // tokens join to its text and "bytes" are the token's own; a special token
  // as its text ("<|im_end|>").
  std::string TokenString(TokenId id) const {
    if (auto bytes = tokenizer_->TokenBytes(id)) return *std::move(bytes);
    return tokenizer_->Decode(std::span<const TokenId>(&id, 1), /*skip_special_tokens=*/false);
  }
  // A token as logprobs name it: its text, or "token_id:ID" when the
  // request asked for ids (return_tokens_as_token_ids).
  std::string LogprobToken(const ApiRequest& api, TokenId id) const {
    return api.return_tokens_as_token_ids ? "token_id:" + std::to_string(id) : TokenString(id);
  }

  void OnTokenLocked(WorkerLink& link, const proto::Token& t) {
    Inflight* found = DispatchedOnLocked(link, t.request_id(), "Token");
    if (!found) {
      // A drain push's token says whether the blocks came by copy.
      auto push = pushes_.find(t.request_id());
      if (push != pushes_.end() && push->second.conn == link.conn->id() && t.prefilled_remotely())
        push->second.copied = true;
      return;  // cancelled or finished meanwhile, or not this worker's
    }
    Inflight& r = *found;
    // Nobody reads this answer any more: the client left before its gone
    // callback ran, or another prompt of its batch failed, which answered
    // the client (prompt_batch.h) without cancelling the prompts running.
    if (r.exchange->client_gone()) return CancelLocked(r.id, "its answer is no longer wanted");
    r.deadline = Clock::now() + std::chrono::milliseconds(opts_.request_timeout_ms);
    if (t.prompt_logprobs_size() > 0) {
      TakePromptScoresLocked(link, r, t);
      if (!r.prompt_pieces_pending.empty()) return;  // more of them to come
    }
    if (!r.first_token_seen) {
      r.first_token_seen = true;
      r.ttft_s = SecondsSince(r.arrived);
      // Once a request: a retry after a token (unstreamed) does not add one.
      if (!std::exchange(r.ttft_observed, true)) metrics_.ttft.Observe(r.ttft_s);
      core_->OnPrefillDone(r.id);
      // A copy that fell back to local prefill (the holder evicted the
      // prefix, the hand-off failed) copied nothing.
      if (r.copy_from) {
        metrics_.replications.Add({{"outcome", t.prefilled_remotely() ? "finished" : "failed"}})
            .Increment();
      }
      if (r.api->stream) {
        r.exchange->BeginStream(200, "text/event-stream", {{"x-request-id", r.http_request_id}});
        r.started_stream = true;
        RunningUsageLocked(r, 0);
        r.exchange->Write(r.formatter->StreamStart(r.api->n, r.prompt_text, &r.prompt_pieces));
      }
    }
    if (t.token_ids_size() == 0) {  // the prompt's scores alone, or a sequence's last text
      if (t.has_text()) TakeTailTextLocked(r, t);
      return;
    }
    if (t.index() >= r.choices.size()) {
      PDSERVE_LOG(WARN) << "worker " << link.name << ": token of sequence " << t.index()
                        << " of request " << r.http_request_id << ", which has "
                        << r.choices.size();
      return;
    }
    const int index = static_cast<int>(t.index());
    Inflight::Choice& c = r.choices[t.index()];
    c.tokens += t.token_ids_size();
    // A worker that writes past max_tokens is broken: its stream would grow
    // an unstreamed answer here without end.
    if (c.tokens > std::max(1, r.api->sampling.max_tokens)) {
      PDSERVE_LOG(WARN) << "worker " << link.name << " sent " << c.tokens << " tokens for sequence "
                        << t.index() << " of request " << r.http_request_id
                        << ", which asked for at most " << r.api->sampling.max_tokens;
      return FailLocked(r.id, 502, "the worker sent more tokens than max_tokens", "server_error");
    }
    RunningUsageLocked(r, c.tokens);
    std::vector<TokenPiece> pieces;
    for (int i = 0; i < t.token_ids_size(); ++i) {
      TokenPiece p;
      p.token = t.token_ids(i);
      if (i < t.logprobs_size()) c.logprob_sum += t.logprobs(i);
      if (r.api->sampling.logprobs) {
        p.token_text = LogprobToken(*r.api, p.token);
        if (i < t.logprobs_size()) p.logprob = t.logprobs(i);
        if (i < t.top_logprobs_size()) {
          const auto& top = t.top_logprobs(i);
          for (int k = 0; k < top.token_ids_size() && k < top.logprobs_size(); ++k) {
            TokenId tid = top.token_ids(k);
            p.top_logprobs.emplace_back(LogprobToken(*r.api, tid), top.logprobs(k));
          }
        }
      }
      if (!t.has_text()) {
        if (!c.detok) {
          c.detok = std::make_unique<IncrementalDetokenizer>(*tokenizer_, true, r.prompt_ids);
        }
        p.text = c.detok->Push(p.token);
      }
      pieces.push_back(std::move(p));
    }
    if (t.has_text() && !pieces.empty()) pieces.back().text = t.text();
    if (r.api->stream && (c.tool_stream || c.reasoning)) {
      StreamParsedText(r, index, pieces, /*final=*/false);
    } else if (r.api->stream) {
      std::string event = r.formatter->StreamDelta(pieces, index, c.streamed_text_chars);
      // text_offset is logprobs' alone: counted only where it is sent.
      if (r.api->sampling.logprobs) {
        for (const auto& p : pieces) c.streamed_text_chars += TextOffsetLength(p.text);
      }
      if (!event.empty()) r.exchange->Write(std::move(event));
    } else {
      for (auto& p : pieces) c.pieces.push_back(std::move(p));
    }
  }

  // echo with logprobs: the prompt's scores, one per token after the first,
  // from the first sequence (the worker scores the prompt once: every
  // choice shows them).
  void TakePromptScoresLocked(const WorkerLink& link, Inflight& r, const proto::Token& t) {
    const size_t n = r.prompt_ids.size();
    if (!r.prompt_pieces.empty() || !r.api->echo || !r.api->sampling.logprobs) return;
    // The first sequence's scores, in order, over one Token or several.
    const size_t got = r.prompt_pieces_pending.size();
    if (t.index() != 0 || t.prompt_top_logprobs_size() != t.prompt_logprobs_size() ||
        got + static_cast<size_t>(t.prompt_logprobs_size()) + 1 > n) {
      PDSERVE_LOG(WARN) << "worker " << link.name << ": " << t.prompt_logprobs_size()
                        << " more prompt scores for request " << r.http_request_id << " (sequence "
                        << t.index() << ", " << got << " before), whose prompt has " << n
                        << " tokens; ignored";
      return;
    }
    for (int i = 0; i < t.prompt_logprobs_size(); ++i) {
      TokenPiece p;
      p.logprob = t.prompt_logprobs(i);
      const auto& top = t.prompt_top_logprobs(i);
      for (int k = 0; k < top.token_ids_size() && k < top.logprobs_size(); ++k) {
        p.top_logprobs.emplace_back(LogprobToken(*r.api, top.token_ids(k)), top.logprobs(k));
      }
      r.prompt_pieces_pending.push_back(std::move(p));
    }
    if (r.prompt_pieces_pending.size() + 1 < n) return;
    // Complete. The pieces' text is the echoed text's: a text prompt's
    // special tokens (BOS) were added by encoding it and are not in it; a
    // token-id prompt's text is decoded with them.
    IncrementalDetokenizer detok(*tokenizer_,
                                 /*skip_special_tokens=*/r.api->prompt_text.has_value());
    r.prompt_pieces.resize(n);
    size_t chars = 0;
    for (size_t i = 0; i < n; ++i) {
      TokenPiece& p = r.prompt_pieces[i];
      if (i > 0) p = std::move(r.prompt_pieces_pending[i - 1]);  // nothing scores the first token
      p.token = r.prompt_ids[i];
      p.token_text = LogprobToken(*r.api, p.token);
      p.text = detok.Push(p.token);
      if (i + 1 == n) p.text += detok.Flush();
      chars += TextOffsetLength(p.text);
    }
    r.prompt_pieces_pending.clear();
    // A streamed output's offsets continue from the prompt's pieces.
    for (auto& c : r.choices) c.streamed_text_chars = chars;
  }

  // parallel_tool_calls false: a turn makes one call at most, whatever the
  // model wrote after it (as OpenAI answers; vLLM keeps the first too).
  static void KeepOneCallUnlessParallel(const ApiRequest& api, size_t sent,
                                        std::vector<ToolCall>* calls) {
    if (api.parallel_tool_calls) return;
    calls->resize(sent > 0 ? 0 : std::min<size_t>(calls->size(), 1));
  }

  // Text a worker released without a new token: what it held back for a
  // possible stop string when the sequence ended without one (a structured
  // output's dead end, the context outgrowing the KV pool).
  void TakeTailTextLocked(Inflight& r, const proto::Token& t) {
    if (t.text().empty() || t.index() >= r.choices.size()) return;
    const int index = static_cast<int>(t.index());
    Inflight::Choice& c = r.choices[index];
    RunningUsageLocked(r, c.tokens);
    if (r.api->stream && (c.tool_stream || c.reasoning)) {
      TokenPiece tail;
      tail.text = t.text();
      StreamParsedText(r, index, {tail}, /*final=*/false);
    } else if (r.api->stream) {
      std::string event = r.formatter->StreamText(t.text(), index);
      if (r.api->sampling.logprobs) c.streamed_text_chars += TextOffsetLength(t.text());
      if (!event.empty()) r.exchange->Write(std::move(event));
    } else if (!c.pieces.empty()) {
      c.pieces.back().text += t.text();  // the text its last token left held back
    }
  }

  // Streaming chat with tools or a reasoning parser: thoughts and content
  // as they come, each call once complete.
  void StreamParsedText(Inflight& r, int index, const std::vector<TokenPiece>& pieces, bool final) {
    std::string events = ParsedTextEvents(r, index, pieces, final);
    if (!events.empty()) r.exchange->Write(std::move(events));
  }

  // The events of a choice's next text: thoughts, content and calls in the
  // order written, as its reasoning and tool streamers split them (a
  // Responses item after a call comes after it).
  std::string ParsedTextEvents(Inflight& r, int index, const std::vector<TokenPiece>& pieces,
                               bool final) {
    Inflight::Choice& c = r.choices[index];
    std::string text;
    std::vector<TokenPiece> scored;  // the new tokens: their logprobs go out now
    for (const auto& p : pieces) {
      text += p.text;
      if (p.logprob) scored.push_back(p);
    }
    std::vector<ReasoningPart> split;
    if (c.reasoning) {
      // Token by token, to count the thoughts' tokens (a piece without text
      // of its own, its text on a later one, counts as the state it finds).
      for (const auto& p : pieces) c.reasoning_tokens += c.reasoning->PushToken(p.text, &split);
      if (final) c.reasoning->Finish(&split);
      // Pushed in several calls: merge neighbours of one kind.
      std::vector<ReasoningPart> merged;
      for (auto& p : split) {
        if (!merged.empty() && merged.back().reasoning == p.reasoning) {
          merged.back().text += p.text;
        } else {
          merged.push_back(std::move(p));
        }
      }
      split = std::move(merged);
    } else {
      split.push_back({false, std::move(text)});
    }
    struct Part {
      bool reasoning = false;
      ToolStreamPart tool;  // not reasoning: content or a call
    };
    std::vector<Part> parts;
    for (ReasoningPart& p : split) {
      if (p.reasoning) {
        parts.push_back({true, ToolStreamPart{std::move(p.text), std::nullopt}});
      } else if (!c.tool_stream) {
        parts.push_back({false, ToolStreamPart{std::move(p.text), std::nullopt}});
      } else {
        std::vector<ToolStreamPart> tool_parts;
        c.tool_stream->Push(p.text, &tool_parts);
        for (auto& tp : tool_parts) parts.push_back({false, std::move(tp)});
      }
    }
    if (final && c.tool_stream) {
      std::vector<ToolStreamPart> tool_parts;
      c.tool_stream->Finish(&tool_parts);
      for (auto& tp : tool_parts) parts.push_back({false, std::move(tp)});
    }
    // The logprobs go with the first text, or alone before any call.
    if (parts.empty() || parts.front().tool.call) parts.insert(parts.begin(), Part{});
    std::string events;
    for (size_t k = 0; k < parts.size();) {
      const std::vector<TokenPiece> logprobs = k == 0 ? scored : std::vector<TokenPiece>{};
      if (parts[k].reasoning) {
        // Left out (include_reasoning false): its tokens' logprobs still go.
        const std::string& thoughts = r.api->include_reasoning ? parts[k].tool.content : "";
        events += r.formatter->StreamReasoning(thoughts, index, logprobs);
        ++k;
        continue;
      }
      if (!parts[k].tool.call) {
        events += r.formatter->StreamContent(parts[k].tool.content, index, logprobs);
        ++k;
        continue;
      }
      std::vector<ToolCall> calls;
      for (; k < parts.size() && !parts[k].reasoning && parts[k].tool.call; ++k)
        calls.push_back(std::move(*parts[k].tool.call));
      KeepOneCallUnlessParallel(*r.api, c.tool_calls_sent, &calls);
      events += r.formatter->StreamToolCalls(calls, c.tool_calls_sent, index);
      c.tool_calls_sent += calls.size();
    }
    return events;
  }

  // An unstreamed response (/v1/responses): its stream replayed token by
  // token and its events dropped, so that its items come in the order and
  // shape a streamed one's do (text after a call is an item after it).
  nlohmann::ordered_json ReplayedResponse(Inflight& r) {
    Inflight::Choice& c = r.choices[0];
    if (!ToolsActive(*r.api) && !r.starts_thinking)  // the formatter replays plain text itself
      return r.formatter->Complete(r.prompt_text, c.pieces, c.finish_reason, r.usage);
    if (ToolsActive(*r.api))
      c.tool_stream = std::make_unique<ToolCallStreamer>(tool_parser_, r.tool_functions);
    if (r.starts_thinking) c.reasoning = std::make_unique<ReasoningStreamer>(*r.starts_thinking);
    c.reasoning_tokens = 0;
    for (const TokenPiece& p : c.pieces) (void)ParsedTextEvents(r, 0, {p}, /*final=*/false);
    (void)ParsedTextEvents(r, 0, {}, /*final=*/true);
    if (r.starts_thinking) r.usage.reasoning_tokens = c.reasoning_tokens;
    c.finish_reason = CallsFinishReason(*r.api, c.finish_reason, c.tool_calls_sent > 0);
    (void)r.formatter->StreamChoiceFinish(c.finish_reason, 0);
    return r.formatter->ResponseObject(r.usage);
  }

  void OnFinishedLocked(WorkerLink& link, const proto::Finished& f) {
    if (EndPushLocked(link, f.request_id(), /*ok=*/true)) return;
    Inflight* found = DispatchedOnLocked(link, f.request_id(), "Finished");
    if (!found) return;
    Inflight& r = *found;
    if (f.reason() == proto::FINISH_REASON_CANCELLED) return;  // our own Cancel echoed back
    if (f.index() >= r.choices.size() || r.choices[f.index()].finished) return;
    const int index = static_cast<int>(f.index());
    Inflight::Choice& c = r.choices[index];
    c.finished = true;
    ++r.choices_finished;
    // The prompt counts once; every sequence's tokens count.
    r.usage.prompt_tokens = std::max<int64_t>(r.usage.prompt_tokens, f.usage().prompt_tokens());
    r.usage.completion_tokens += f.usage().completion_tokens();
    if (index == 0) r.usage.cached_tokens = f.usage().cached_tokens();
    c.finish_reason = FinishName(f.reason());
    std::vector<TokenPiece> tail_pieces;
    if (c.detok) {
      // Text held back by the router-side detokenizer ends the output.
      std::string tail = c.detok->Flush();
      if (!tail.empty()) {
        TokenPiece p;
        p.text = std::move(tail);
        tail_pieces.push_back(p);
      }
    }
    const bool last = r.choices_finished == r.choices.size();
    if (r.api->stream) {
      if (!r.started_stream) {
        r.exchange->BeginStream(200, "text/event-stream", {{"x-request-id", r.http_request_id}});
        RunningUsageLocked(r, 0);
        r.exchange->Write(r.formatter->StreamStart(r.api->n, r.prompt_text, &r.prompt_pieces));
        r.started_stream = true;
      }
      RunningUsageLocked(r, c.tokens);
      if (c.tool_stream || c.reasoning) {
        StreamParsedText(r, index, tail_pieces, /*final=*/true);
        // A turn cut off by max_tokens stays "length", calls or not.
        c.finish_reason = CallsFinishReason(*r.api, c.finish_reason, c.tool_calls_sent > 0);
      } else if (!tail_pieces.empty()) {
        r.exchange->Write(r.formatter->StreamDelta(tail_pieces, index, c.streamed_text_chars));
      }
      r.exchange->Write(r.formatter->StreamChoiceFinish(c.finish_reason, index));
      if (!last) return;
      if (r.starts_thinking) {
        r.usage.reasoning_tokens = 0;
        for (const auto& ch : r.choices) *r.usage.reasoning_tokens += ch.reasoning_tokens;
      }
      r.exchange->Write(r.formatter->StreamEnd(r.usage));
      r.exchange->End();
    } else {
      for (auto& p : tail_pieces) c.pieces.push_back(std::move(p));
      if (!last) return;
      http::Response resp;
      if (r.api->endpoint == Endpoint::kResponses) {
        resp.body = ReplayedResponse(r).dump();
      } else {
        // best_of: the n most likely sequences, in that order.
        std::vector<size_t> order(r.choices.size());
        for (size_t k = 0; k < order.size(); ++k) order[k] = k;
        if (r.api->best_of > r.api->n) {
          std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
            return r.choices[a].logprob_sum > r.choices[b].logprob_sum;
          });
        }
        order.resize(static_cast<size_t>(r.api->n));
        // Thoughts and answer of every sequence (usage counts each one's
        // thought tokens, as completion_tokens counts its tokens).
        std::vector<std::pair<std::string, std::string>> split(r.choices.size());
        if (r.starts_thinking) {
          r.usage.reasoning_tokens = 0;
          for (size_t i = 0; i < r.choices.size(); ++i) {
            std::vector<std::string_view> tokens;
            for (const auto& p : r.choices[i].pieces) tokens.push_back(p.text);
            *r.usage.reasoning_tokens +=
                SplitReasoning(*r.starts_thinking, tokens, &split[i].first, &split[i].second);
          }
        }
        std::vector<ChatOutcome> outcomes(order.size());
        std::vector<ResponseFormatter::ChoiceOutput> out;
        for (size_t k = 0; k < order.size(); ++k) {
          Inflight::Choice& ch = r.choices[order[k]];
          ResponseFormatter::ChoiceOutput o{static_cast<int>(k), &ch.pieces, ch.finish_reason,
                                            nullptr, &r.prompt_pieces};
          if (ToolsActive(*r.api) || r.starts_thinking) {
            ChatOutcome& out = outcomes[k];
            std::string text;
            if (r.starts_thinking) {
              out.split_reasoning = true;
              if (r.api->include_reasoning) out.reasoning = std::move(split[order[k]].first);
              text = std::move(split[order[k]].second);
            } else {
              for (const auto& p : ch.pieces) text += p.text;
            }
            if (ToolsActive(*r.api)) {
              ParseToolCalls(tool_parser_, r.tool_functions, text, &out.content, &out.calls);
              KeepOneCallUnlessParallel(*r.api, 0, &out.calls);
              o.finish_reason = CallsFinishReason(*r.api, o.finish_reason, !out.calls.empty());
            } else {
              out.content = std::move(text);
            }
            o.outcome = &out;
          }
          out.push_back(o);
        }
        resp.body = r.formatter->Complete(r.prompt_text, out, r.usage).dump();
      }
      resp.headers.emplace_back("x-request-id", r.http_request_id);
      r.exchange->Reply(std::move(resp));
    }
    const Usage& usage = r.usage;
    PDSERVE_LOG(INFO) << "request " << r.http_request_id << " ok: prompt " << usage.prompt_tokens
                      << " (cached " << usage.cached_tokens << "), completion "
                      << usage.completion_tokens << ", finish " << r.choices[0].finish_reason
                      << (r.choices.size() > 1
                              ? ", " + std::to_string(r.choices.size()) + " sequences"
                              : std::string())
                      << ", decode " << WorkerName(r.decode)
                      << (r.prefill     ? ", prefill " + WorkerName(r.prefill)
                          : r.copy_from ? ", prefix copied by " + WorkerName(r.copy_from)
                                        : std::string(", local prefill"))
                      << ", ttft " << r.ttft_s << "s, total " << SecondsSince(r.arrived)
                      << "s, attempts " << r.attempts;
    FinishLocked(r.id, "ok");
  }

  void OnRequestErrorLocked(WorkerLink& link, const proto::Error& e) {
    if (EndPushLocked(link, e.request_id(), /*ok=*/false)) return;
    Inflight* found = DispatchedOnLocked(link, e.request_id(), "Error");
    if (!found) return;
    const uint64_t id = found->id;
    PDSERVE_LOG(WARN) << "worker " << link.name << " failed request " << found->http_request_id
                      << ": " << e.message();
    core_->OnRequestFinished(id);
    if (e.retryable()) {
      if (link.id) found->failed_on.push_back(*link.id);
      return RetryOrFailLocked(id, "worker " + link.name + ": " + e.message());
    }
    const int status = e.code() == proto::ERROR_CODE_INVALID_ARGUMENT ? 400 : 500;
    FailLocked(id, status, e.message(), status == 400 ? "invalid_request_error" : "server_error");
  }

  // ------------------------------------------------------- request endings
  // `outcome` labels pdserve_router_requests_total (default: "error" for 5xx,
  // "rejected" otherwise).
  void FailLocked(uint64_t id, int status, const std::string& message, const std::string& type,
                  bool retry_after = false, const char* outcome = nullptr) {
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    Inflight& r = *it->second;
    ApiError err{status, message, type, "", ""};
    if (r.started_stream) {
      r.exchange->Write(r.formatter->StreamFailure(err));
      r.exchange->End();
    } else {
      http::Response resp = err.ToResponse();
      resp.headers.emplace_back("x-request-id", r.http_request_id);
      if (retry_after) resp.headers.emplace_back("Retry-After", "1");
      r.exchange->Reply(std::move(resp));
    }
    PDSERVE_LOG(INFO) << "request " << r.http_request_id << " failed " << status << ": " << message;
    if (r.decode) SendCancelLocked(r, message);
    FinishLocked(id, outcome ? outcome : (status >= 500 ? "error" : "rejected"));
  }

  void CancelLocked(uint64_t id, const std::string& why) {
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    Inflight& r = *it->second;
    PDSERVE_LOG(INFO) << "request " << r.http_request_id << " cancelled: " << why;
    if (r.decode) SendCancelLocked(r, why);
    FinishLocked(id, "cancelled");
  }

  // The usage the next stream chunks carry (stream_options'
  // continuous_usage_stats): the prompt and one choice's tokens so far.
  static void RunningUsageLocked(Inflight& r, int64_t completion_tokens) {
    if (r.api->continuous_usage) {
      r.formatter->SetRunningUsage(static_cast<int64_t>(r.prompt_ids.size()), completion_tokens);
    }
  }

  // A turn that made calls ends "tool_calls", as OpenAI's do, except where
  // tool_choice named the function: OpenAI (and vLLM) end those "stop". A
  // turn cut off by max_tokens stays "length".
  static std::string CallsFinishReason(const ApiRequest& api, const std::string& reason,
                                       bool made_calls) {
    if (!made_calls || reason != "stop" || api.tool_choice == ApiRequest::ToolChoice::kNamed) {
      return reason;
    }
    return "tool_calls";
  }

  void SendCancelLocked(Inflight& r, const std::string& why) {
    if (auto link = LinkOf(*r.decode)) {
      proto::Envelope env;
      env.mutable_cancel()->set_request_id(r.wire_id);
      env.mutable_cancel()->set_reason(why);
      (void)link->conn->Send(std::move(env));
    }
  }

  void FinishLocked(uint64_t id, const char* status) {
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;
    metrics_.e2e.Observe(SecondsSince(it->second->arrived));
    core_->OnRequestFinished(id);
    SetWireIdLocked(*it->second, "");
    inflight_.erase(it);
    metrics_.inflight.Decrement();
    CountRequest(status);
    if (inflight_.empty()) drained_cv_.notify_all();
  }

  // Deadlines and periodic gauges.
  void Watchdog() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
      watchdog_cv_.wait_for(lock, std::chrono::milliseconds(250));
      if (stopping_) break;
      const auto now = Clock::now();
      std::vector<uint64_t> expired;
      for (auto& [id, r] : inflight_) {
        if (now > r->deadline) expired.push_back(id);
      }
      for (uint64_t id : expired)
        FailLocked(id, 504,
                   "no token came for " +
                       (opts_.request_timeout_ms % 1000 == 0
                            ? std::to_string(opts_.request_timeout_ms / 1000) + " s"
                            : std::to_string(opts_.request_timeout_ms) + " ms") +
                       " (--request-timeout)",
                   "timeout");
      const RouterStats s = core_->stats();
      ExportCopyGovernorLocked(s.copy);
      metrics_.index_blocks.Set(static_cast<double>(s.index.entries));
      metrics_.index_bytes.Set(static_cast<double>(s.index.bytes));
      metrics_.snapshot_pending_bytes.Set(static_cast<double>(snapshot_pending_bytes_));
      if (control_)
        metrics_.control_buffered_bytes.Set(static_cast<double>(control_->buffered_bytes()));
      WatchStallsLocked();
    }
  }

  // A worker's stall is time passing without its load reports: the
  // watchdog logs each change and keeps the worker gauges current.
  void WatchStallsLocked() {
    std::unordered_map<WorkerId, bool> stalled;
    for (const WorkerView& v : core_->Workers()) stalled[v.id] = v.stalled;
    bool changed = false;
    for (auto& [_, l] : links_) {
      if (!l.id) continue;
      const auto v = stalled.find(*l.id);
      if (v == stalled.end() || l.stalled == v->second) continue;
      l.stalled = v->second;
      changed = true;
      if (l.stalled) {
        PDSERVE_LOG(WARN) << "worker " << l.name << " sent no load report for "
                          << opts_.worker_stall_timeout_ms / 1000
                          << " s (its engine is stuck in a step): new requests go elsewhere";
      } else {
        PDSERVE_LOG(INFO) << "worker " << l.name << " reports again: it takes requests";
      }
    }
    if (changed) UpdateWorkerGaugesLocked();
  }

  // The governor's counters, as increments since the last export.
  void ExportCopyGovernorLocked(const CopyGovernorStats& c) {
    for (size_t k = 0; k < kCopyDeclineCount; ++k) {
      const uint64_t delta = c.declined[k] - exported_copy_.declined[k];
      if (delta > 0) {
        metrics_.copies_declined.Add({{"reason", CopyDeclineName(static_cast<CopyDecline>(k))}})
            .Increment(static_cast<double>(delta));
      }
    }
    if (c.reused > exported_copy_.reused) {
      metrics_.copy_outcomes.Add({{"outcome", "reused"}})
          .Increment(static_cast<double>(c.reused - exported_copy_.reused));
    }
    if (c.unused > exported_copy_.unused) {
      metrics_.copy_outcomes.Add({{"outcome", "unused"}})
          .Increment(static_cast<double>(c.unused - exported_copy_.unused));
    }
    if (c.breaker_trips > exported_copy_.breaker_trips) {
      metrics_.copy_breaker_trips.Increment(
          static_cast<double>(c.breaker_trips - exported_copy_.breaker_trips));
    }
    metrics_.copy_reuse_ratio.Set(c.reuse_ratio);
    metrics_.copy_breaker_state.Set(static_cast<double>(static_cast<int>(c.breaker)));
    metrics_.copy_budget_scale.Set(c.budget_scale);
    metrics_.copies_in_flight.Set(static_cast<double>(c.inflight));
    metrics_.copy_inflight_limit.Set(static_cast<double>(c.inflight_limit));
    exported_copy_ = c;
  }

  // ------------------------------------------------------------ helpers
  WorkerLink* LinkOf(WorkerId w) {
    auto it = by_worker_.find(w);
    if (it == by_worker_.end()) return nullptr;
    auto l = links_.find(it->second);
    return l == links_.end() ? nullptr : &l->second;
  }

  std::string WorkerName(std::optional<WorkerId> w) {
    if (!w) return "-";
    auto* l = LinkOf(*w);
    return l ? l->name : "gone";
  }

  bool HasDecodeWorker() { return CountSyncedWorkers(/*prefill=*/false) > 0; }

  // Registered, synced workers that prefill only, or that can decode.
  int CountSyncedWorkers(bool prefill) {
    std::lock_guard<std::mutex> lock(mu_);
    int n = 0;
    for (auto& [_, l] : links_) {
      if (l.id && l.synced && (l.role == Role::kPrefill) == prefill) ++n;
    }
    return n;
  }

  void UpdateWorkerGaugesLocked() {
    for (const char* role : {"prefill", "decode", "both"}) {
      for (const char* state : {"ready", "syncing", "draining", "stalled"})
        metrics_.workers.Add({{"role", role}, {"state", state}}).Set(0);
    }
    for (auto& [_, l] : links_) {
      if (!l.id) continue;
      // A draining or stalled worker takes no requests, however its index stands.
      const char* state = l.draining  ? "draining"
                          : l.stalled ? "stalled"
                          : l.synced  ? "ready"
                                      : "syncing";
      metrics_.workers.Add({{"role", RoleName(l.role)}, {"state", state}}).Increment();
    }
  }

  void CountRequest(const char* status) { metrics_.requests.Add({{"status", status}}).Increment(); }

  RouterServiceOptions opts_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  std::string chat_template_error_;  // why the model's template could not be used, if so
  std::optional<ChatTemplate> tool_use_template_;  // the model's "tool_use", if any
  // Whether each template loops over a message's content (then given parts).
  bool template_takes_parts_ = false, tool_use_takes_parts_ = false;
  bool template_knows_developer_ = false;  // the template's source names the role
  ToolParser tool_parser_ = ToolParser::kNone;
  ReasoningParser reasoning_parser_ = ReasoningParser::kNone;
  // Forced mistral calls as [TOOL_CALLS]name[ARGS]{...}, as the template writes them.
  bool mistral_name_args_ = false;
  std::string model_id_;
  // Key files, reread as they change (null: off; /metrics open, /admin/* off).
  std::shared_ptr<http::ReloadingKeys> api_keys_, metrics_keys_, admin_keys_;
  ApiLimits limits_;
  std::unique_ptr<RouterCore> core_;
  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  RouterMetrics metrics_{*registry_};
  const int64_t started_unix_ = UnixSeconds();

  std::unique_ptr<control::EventLoop> loop_;
  std::unique_ptr<control::Server> control_;
  std::unique_ptr<http::Server> http_;
  std::unique_ptr<http::Server> metrics_http_;
  std::thread watchdog_;
  std::condition_variable watchdog_cv_;

  std::mutex constraints_mu_;
  std::unordered_set<uint64_t> good_constraints_;  // constraints known to compile, by hash

  std::mutex mu_;  // everything below
  bool stopping_ = false;
  bool draining_ = false;               // Drain: new requests refused, /ready fails
  std::condition_variable drained_cv_;  // the last request in flight ended
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, WorkerLink> links_;    // by connection id
  std::unordered_map<WorkerId, uint64_t> by_worker_;  // worker → connection id
  std::unordered_map<uint64_t, std::unique_ptr<Inflight>> inflight_;
  std::unordered_map<std::string, uint64_t> wire_ids_;  // Inflight::wire_id → id
  std::unordered_map<WorkerId, std::unordered_map<BlockHash, HotPrompt>> hot_prompts_;
  uint64_t hot_clock_ = 0;
  // Set by the first worker that registered: its KV layer groups are the
  // model's (RouterCore::SetKvGroupWindows).
  bool kv_groups_known_ = false;
  struct Push {
    uint64_t conn = 0;    // the survivor's connection
    bool copied = false;  // its first token came after the blocks were copied
  };
  std::unordered_map<std::string, Push> pushes_;  // by drain push wire id
  CopyGovernorStats exported_copy_;               // what ExportCopyGovernorLocked last saw
  size_t snapshot_pending_bytes_ = 0;
};

}  // namespace

Status RouterService::CheckRoutingOptions(const RouterServiceOptions& options) {
  return RouterCore::Create(RoutingOptionsOf(options)).status();
}

StatusOr<std::unique_ptr<RouterService>> RouterService::Create(RouterServiceOptions options) {
  auto service = std::make_unique<RouterServiceImpl>(std::move(options));
  PDSERVE_RETURN_IF_ERROR(service->Init());
  return std::unique_ptr<RouterService>(std::move(service));
}

}  // namespace pdserve::router
