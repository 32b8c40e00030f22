#include "services/router/router_service.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "common/block_hash.h"
#include "common/chat_template/chat_template.h"
#include "common/http/bearer_auth.h"
#include "common/http/http_server.h"
#include "common/logging.h"
#include "common/metrics/metrics.h"
#include "common/proto/pdserve.pb.h"
#include "common/random_id.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/model_config.h"
#include "engine/model_id.h"
#include "services/protocol/sampling.h"
#include "services/router/openai/openai_api.h"
#include "services/router/router_core.h"
#include "transport/control/connection.h"

namespace pdserve::router {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::optional<WorkerRole> FromProtoRole(proto::Role r) {
  switch (r) {
    case proto::ROLE_PREFILL:
      return WorkerRole::kPrefill;
    case proto::ROLE_DECODE:
      return WorkerRole::kDecode;
    case proto::ROLE_BOTH:
      return WorkerRole::kBoth;
    default:
      return std::nullopt;
  }
}

const char* FinishName(proto::FinishReason r) {
  switch (r) {
    case proto::FINISH_REASON_LENGTH:
      return "length";
    default:
      return "stop";
  }
}

// Router metrics (ARCHITECTURE.md section 8).
struct RouterMetrics {
  explicit RouterMetrics(prometheus::Registry& r)
      : requests(metrics::AddCounterFamily(r, "pdserve_router_requests_total",
                                           "Requests answered by the router, by outcome")),
        predicted_hit_tokens(metrics::AddCounter(
            r, "pdserve_router_predicted_hit_tokens_total",
            "Prompt tokens the index predicted cached on the prefilling worker")),
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
                                      "Control messages or connections refused, by reason")) {
    // Every outcome and decision exists from the start at 0, so rate() and
    // ratios over them are defined before the first request of each kind.
    for (const char* status :
         {"ok", "rejected", "error", "cancelled", "unavailable", "unauthorized"})
      requests.Add({{"status", status}});
    for (const char* kind : {"remote_prefill", "local_prefill"}) decisions.Add({{"kind", kind}});
    for (const char* reason :
         {"not_dispatched_here", "duplicate_worker", "snapshot_too_large", "registration_invalid"})
      control_rejected.Add({{"reason", reason}});
  }

  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Counter& predicted_hit_tokens;
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
};

// One connected worker.
struct WorkerLink {
  control::ConnectionPtr conn;
  std::optional<WorkerId> id;  // set after a valid Register
  std::string name;
  WorkerRole role = WorkerRole::kBoth;
  std::string control_address;
  int64_t kv_capacity_blocks = 0;  // as registered
  bool synced = false;
  bool draining = false;
  // KvSnapshot chunks being assembled.
  std::vector<BlockHash> snapshot;
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
  std::string prompt_text;  // for echo
  std::vector<TokenId> prompt_ids;
  std::vector<BlockHash> hashes;
  Clock::time_point arrived;
  Clock::time_point deadline;
  int attempts = 0;
  std::optional<WorkerId> decode;
  std::optional<WorkerId> prefill;
  bool started_stream = false;  // HTTP headers sent
  bool first_token_seen = false;
  double ttft_s = 0;
  std::vector<TokenPiece> pieces;  // non-streaming: the whole output
  size_t completion_tokens = 0;
  std::unique_ptr<IncrementalDetokenizer> detok;  // when workers send ids only
};

class RouterServiceImpl : public RouterService {
 public:
  explicit RouterServiceImpl(RouterServiceOptions o) : opts_(std::move(o)) {}

  Status Init() {
    auto tok = Tokenizer::Load(opts_.model_dir);
    if (!tok.ok()) return tok.status();
    tokenizer_ = std::move(*tok);
    if (!tokenizer_->chat_template().empty()) {
      auto tmpl = ChatTemplate::Parse(tokenizer_->chat_template());
      if (!tmpl.ok()) {
        PDSERVE_LOG(WARN) << "chat template unusable, /v1/chat/completions disabled: "
                          << tmpl.status().message();
      } else {
        chat_template_.emplace(std::move(*tmpl));
      }
    }
    auto config = LoadModelConfig(opts_.model_dir);
    if (!config.ok()) return config.status();
    max_context_ = config->max_context();
    model_id_ = ServedModelId(opts_.model_dir, *config, opts_.model_id);
    if (!opts_.api_key_file.empty()) {
      auto keys = http::LoadApiKeys(opts_.api_key_file);
      if (!keys.ok()) return keys.status();
      api_keys_ = std::move(*keys);
    }
    RouterOptions ro;
    ro.policy = opts_.policy;
    ro.policy_options.temperature = opts_.policy_temperature;
    ro.block_tokens = opts_.block_size;
    ro.max_local_prefill = opts_.max_local_prefill;
    auto core = RouterCore::Create(ro);
    if (!core.ok()) return core.status();
    core_ = std::move(*core);
    limits_.model_ids = {model_id_};
    PDSERVE_RETURN_IF_ERROR(InitHttpOptions());
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
    control_ = std::make_unique<control::Server>(loop_.get(), co, handlers);
    PDSERVE_RETURN_IF_ERROR(
        control_->Listen(opts_.host, static_cast<uint16_t>(opts_.control_port)));

    http::ServerOptions ho;
    ho.host = opts_.host;
    ho.port = opts_.http_port;
    ho.threads = opts_.http_threads;
    ho.max_body_bytes = opts_.max_body_bytes;
    ho.max_header_bytes = opts_.max_header_bytes;
    ho.max_concurrent_requests = opts_.max_concurrent_requests;
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
                    r, *ex, *registry_, [] { return metrics::Health{}; }, metrics_keys_)) {
              ex->Reply(http::ErrorResponse(404, "only /metrics and /health are served here"));
            }
          });
      PDSERVE_RETURN_IF_ERROR(metrics_http_->Start());
    }
    watchdog_ = std::thread([this] { Watchdog(); });
    PDSERVE_LOG(INFO) << "router serving model '" << model_id_ << "' (context " << max_context_
                      << ", block size " << opts_.block_size << ", policy " << opts_.policy
                      << ") on http :" << http_->port() << ", control :" << control_->port()
                      << (metrics_http_ ? ", metrics :" + std::to_string(metrics_http_->port())
                                        : "");
    return Status::Ok();
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
      for (uint64_t id : ids) FailLocked(id, 503, "the router is shutting down", "server_error");
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
    if (opts_.salt_per_api_key && api_keys_.empty()) {
      return Status::InvalidArgument(
          "--salt-per-api-key derives cache salts from API keys: it needs --api-key-file");
    }
    if (!opts_.metrics_key_file.empty()) {
      auto keys = http::LoadApiKeys(opts_.metrics_key_file);
      if (!keys.ok()) return keys.status();
      metrics_keys_ = std::move(*keys);
    }
    return Status::Ok();
  }

  void HandleHttp(const http::Request& req, std::shared_ptr<http::Exchange> ex) {
    if (!metrics_http_ &&
        metrics::ServeStandardEndpoints(
            req, *ex, *registry_, [] { return metrics::Health{}; }, metrics_keys_)) {
      return;
    }
    if (req.path == "/health") {  // metrics on their own port: health stays here too
      ex->Reply({200, "application/json", {}, R"({"status":"ok"})"});
      return;
    }
    if (req.path == "/ready") {
      const bool ready = HasDecodeWorker();
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
    const bool is_api = req.path.rfind("/v1/", 0) == 0;
    std::optional<size_t> api_key;  // which key authorized the request
    if (is_api && !api_keys_.empty()) {
      const http::BearerCheck auth = http::CheckBearer(req, api_keys_);
      if (!auth.accepted()) {
        ex->Reply(http::BearerRefusal(auth));
        CountRequest("unauthorized");
        return;
      }
      api_key = auth.key_index;
    }
    if (req.path == "/v1/models") {
      if (req.method != "GET") return ex->Reply(http::ErrorResponse(405, "use GET for /v1/models"));
      nlohmann::json model = {{"id", model_id_},          {"object", "model"},
                              {"created", started_unix_}, {"owned_by", "pdserve"},
                              {"root", model_id_},        {"max_model_len", max_context_}};
      ex->Reply({200,
                 "application/json",
                 {},
                 nlohmann::json{{"object", "list"}, {"data", {model}}}.dump()});
      return;
    }
    if (req.path == "/v1/completions" || req.path == "/v1/chat/completions") {
      if (req.method != "POST")
        return ex->Reply(http::ErrorResponse(405, "use POST for " + req.path));
      HandleGenerate(
          req, std::move(ex),
          req.path == "/v1/completions" ? Endpoint::kCompletions : Endpoint::kChatCompletions,
          api_key);
      return;
    }
    ex->Reply(http::ErrorResponse(404, "no such endpoint: " + req.method + " " + req.path,
                                  "invalid_request_error", "", "not_found"));
  }

  // `api_key`: the index of the key that authorized the request, if any.
  void HandleGenerate(const http::Request& req, std::shared_ptr<http::Exchange> ex,
                      Endpoint endpoint, std::optional<size_t> api_key) {
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
    if (rid.empty()) rid = NewUnguessableId();
    r->request_id = (endpoint == Endpoint::kCompletions ? "cmpl-" : "chatcmpl-") +
                    NewUnguessableId().substr(0, 24);
    r->http_request_id = rid;
    auto reject = [&](const ApiError& e, const char* status) {
      http::Response resp = e.ToResponse();
      resp.headers.emplace_back("x-request-id", rid);
      ex->Reply(std::move(resp));
      CountRequest(status);
      PDSERVE_LOG(INFO) << "request " << rid << " " << req.path << " rejected " << e.status << ": "
                        << e.message;
    };
    if (auto err = ParseRequest(endpoint, req.body, limits_, r->api.get()))
      return reject(*err, "rejected");
    ApiRequest& api = *r->api;
    // Tenancy: each key's requests share cache only among themselves.
    if (opts_.salt_per_api_key && api_key)
      api.cache_salt = TenantCacheSalt(api_keys_[*api_key], api.cache_salt);

    // Tokenize.
    if (endpoint == Endpoint::kChatCompletions) {
      if (!chat_template_) {
        return reject({400, "this model has no chat template; use /v1/completions",
                       "invalid_request_error", "messages", ""},
                      "rejected");
      }
      auto text = RenderChat(*chat_template_, api.messages, api.add_generation_prompt,
                             tokenizer_->bos_token(), tokenizer_->eos_token());
      if (!text.ok()) {
        return reject({400, "the chat template rejected the messages: " + text.status().message(),
                       "invalid_request_error", "messages", ""},
                      "rejected");
      }
      r->prompt_text = *text;
      r->prompt_ids = tokenizer_->Encode(*text, /*add_special_tokens=*/false);
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
    const int64_t prompt_len = static_cast<int64_t>(r->prompt_ids.size());
    const char* prompt_param = endpoint == Endpoint::kChatCompletions ? "messages" : "prompt";
    if (prompt_len == 0) {
      return reject({400, "the prompt is empty after tokenization", "invalid_request_error",
                     prompt_param, ""},
                    "rejected");
    }
    if (prompt_len >= max_context_) {
      return reject(
          {400,
           "This model's maximum context length is " + std::to_string(max_context_) +
               " tokens. However, your prompt has " + std::to_string(prompt_len) + " tokens.",
           "invalid_request_error", prompt_param, "context_length_exceeded"},
          "rejected");
    }
    const int64_t room = max_context_ - prompt_len;
    int64_t max_tokens =
        api.max_tokens ? *api.max_tokens : (endpoint == Endpoint::kCompletions ? 16 : room);
    if (api.max_tokens && max_tokens > room) {
      return reject(
          {400,
           "This model's maximum context length is " + std::to_string(max_context_) +
               " tokens. However, you requested " + std::to_string(prompt_len + max_tokens) +
               " tokens (" + std::to_string(prompt_len) + " in the prompt, " +
               std::to_string(max_tokens) + " for the completion).",
           "invalid_request_error", "max_tokens", "context_length_exceeded"},
          "rejected");
    }
    max_tokens = std::min(max_tokens, room);
    api.sampling.max_tokens = static_cast<int>(max_tokens);
    if (Status st = ValidateSamplingParams(api.sampling, tokenizer_->vocab_size()); !st.ok()) {
      return reject({400, st.message(), "invalid_request_error", "", ""}, "rejected");
    }
    const BlockHash seed = BlockHashSeed(model_id_, api.cache_salt);
    r->hashes = HashPrompt(seed, r->prompt_ids, static_cast<size_t>(opts_.block_size));
    r->formatter = std::make_unique<ResponseFormatter>(api, r->request_id, UnixSeconds());
    metrics_.route_seconds.Observe(SecondsSince(arrived));

    const uint64_t id = r->id;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_)
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
      auto decision = core_->Route(rr);
      if (!decision.ok()) {
        return FailLocked(id, 503, "no decode worker is available: " + decision.status().message(),
                          "server_error", /*retry_after=*/true, "unavailable");
      }
      auto decode_link = LinkOf(decision->decode);
      if (!decode_link) {
        core_->OnRequestFinished(id);
        continue;
      }
      SetWireIdLocked(r, NewUnguessableId());
      proto::Envelope env;
      proto::Generate* g = env.mutable_generate();
      g->set_request_id(r.wire_id);
      for (TokenId t : r.prompt_ids) g->add_prompt_token_ids(t);
      ToProto(r.api->sampling, g->mutable_sampling());
      g->set_cache_salt(r.api->cache_salt);
      if (decision->prefill) {
        if (auto p = LinkOf(*decision->prefill)) {
          g->set_prefill_worker_id(p->name);
          g->set_prefill_address(p->control_address);
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
      r.decode = decision->decode;
      r.decode_conn = decode_link->conn->id();
      r.prefill = decision->prefill;
      metrics_.prompt_tokens.Increment(static_cast<double>(r.prompt_ids.size()));
      const int64_t overlap =
          decision->prefill ? decision->prefill_overlap_blocks : decision->decode_overlap_blocks;
      metrics_.predicted_hit_tokens.Increment(static_cast<double>(overlap * opts_.block_size));
      metrics_.decisions.Add({{"kind", decision->prefill ? "remote_prefill" : "local_prefill"}})
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
        if (s.chunk_index() == 0) {
          snapshot_pending_bytes_ -= link.snapshot.size() * sizeof(BlockHash);
          link.snapshot.clear();
        }
        // A worker cannot cache more blocks than it has; a snapshot that
        // claims more is a fault, and must not grow the router without bound.
        const size_t limit = static_cast<size_t>(
            std::min<int64_t>(opts_.max_snapshot_blocks, link.kv_capacity_blocks));
        if (link.snapshot.size() + static_cast<size_t>(s.block_hashes_size()) > limit) {
          metrics_.control_rejected.Add({{"reason", "snapshot_too_large"}}).Increment();
          return RefuseLocked(link, "KV snapshot of more than " + std::to_string(limit) +
                                        " blocks (registered capacity " +
                                        std::to_string(link.kv_capacity_blocks) + ")");
        }
        link.snapshot.insert(link.snapshot.end(), s.block_hashes().begin(), s.block_hashes().end());
        snapshot_pending_bytes_ += static_cast<size_t>(s.block_hashes_size()) * sizeof(BlockHash);
        if (s.last_chunk()) {
          Status st = core_->OnSnapshot(*link.id, s.sequence(), link.snapshot);
          if (!st.ok())
            PDSERVE_LOG(WARN) << "worker " << link.name << ": snapshot refused: " << st.message();
          link.synced = st.ok();
          PDSERVE_LOG(INFO) << "worker " << link.name << " synced: " << link.snapshot.size()
                            << " cached blocks at sequence " << s.sequence();
          snapshot_pending_bytes_ -= link.snapshot.size() * sizeof(BlockHash);
          link.snapshot.clear();
          link.snapshot.shrink_to_fit();
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
          link.synced = false;  // no new requests; running ones finish
          link.draining = true;
          if (link.id) core_->SetDraining(*link.id, true);
          if (link.id && link.role == WorkerRole::kPrefill) BroadcastPrefillWorkersLocked();
          UpdateWorkerGaugesLocked();
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

  // The prefill workers a decode worker may be told to use: registered,
  // prefill role, not draining.
  proto::Envelope PrefillWorkersLocked() {
    proto::Envelope env;
    auto* list = env.mutable_prefill_workers();
    for (auto& [_, l] : links_) {
      if (!l.id || l.role != WorkerRole::kPrefill || l.draining) continue;
      auto* w = list->add_workers();
      w->set_worker_id(l.name);
      w->set_control_address(l.control_address);
    }
    return env;
  }

  void BroadcastPrefillWorkersLocked() {
    const proto::Envelope env = PrefillWorkersLocked();
    for (auto& [_, l] : links_) {
      if (l.id && l.role != WorkerRole::kPrefill) (void)l.conn->Send(env);
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
    auto role = FromProtoRole(reg.role());
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
    if (reg.kv_capacity_blocks() == 0 ||
        reg.kv_capacity_blocks() > static_cast<uint64_t>(opts_.max_snapshot_blocks)) {
      metrics_.control_rejected.Add({{"reason", "registration_invalid"}}).Increment();
      return RefuseLocked(link, "kv_capacity_blocks " + std::to_string(reg.kv_capacity_blocks()) +
                                    " is outside [1, " + std::to_string(opts_.max_snapshot_blocks) +
                                    "] (router --max-snapshot-blocks)");
    }
    auto id = core_->AddWorker(reg.worker_id(), *role);
    if (!id.ok()) {
      // The live worker of that name keeps its place: a second connection
      // claiming it never evicts the first.
      metrics_.control_rejected.Add({{"reason", "duplicate_worker"}}).Increment();
      return RefuseLocked(link, id.status().message());
    }
    link.id = *id;
    link.role = *role;
    link.control_address = reg.control_address();
    link.kv_capacity_blocks = static_cast<int64_t>(reg.kv_capacity_blocks());
    by_worker_[*id] = link.conn->id();
    PDSERVE_LOG(INFO) << "worker " << link.name << " registered: role " << WorkerRoleName(*role)
                      << ", " << reg.kv_capacity_blocks() << " KV blocks, control "
                      << reg.control_address();
    proto::Envelope env;
    env.mutable_resync()->set_reason("new connection");
    (void)link.conn->Send(std::move(env));
    if (*role == WorkerRole::kPrefill) {
      BroadcastPrefillWorkersLocked();  // re-admitted: decode workers reconnect at once
    } else {
      (void)link.conn->Send(PrefillWorkersLocked());
    }
    UpdateWorkerGaugesLocked();
  }

  void OnKvEventsLocked(WorkerLink& link, const proto::KvEvents& ev) {
    if (!link.id) return;
    KvEventBatch batch;
    batch.seq = ev.sequence();
    batch.events.reserve(static_cast<size_t>(ev.events_size()));
    for (const auto& pe : ev.events()) {
      KvEvent k;
      switch (pe.kind_case()) {
        case proto::KvEvent::kStored:
          k.kind = KvEvent::Kind::kStored;
          k.hashes.assign(pe.stored().block_hashes().begin(), pe.stored().block_hashes().end());
          if (pe.stored().has_parent_hash()) k.parent = pe.stored().parent_hash();
          break;
        case proto::KvEvent::kRemoved:
          k.kind = KvEvent::Kind::kRemoved;
          k.hashes.assign(pe.removed().block_hashes().begin(), pe.removed().block_hashes().end());
          break;
        case proto::KvEvent::kCleared:
          k.kind = KvEvent::Kind::kCleared;
          break;
        default:
          continue;
      }
      batch.events.push_back(std::move(k));
    }
    const ApplyOutcome out = core_->OnKvEvents(*link.id, batch);
    if (out == ApplyOutcome::kNeedsResync && link.synced) {
      link.synced = false;
      metrics_.event_gaps.Increment();
      PDSERVE_LOG(WARN) << "worker " << link.name << ": KV event gap at sequence " << batch.seq
                        << "; resyncing";
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
    snapshot_pending_bytes_ -= link.snapshot.size() * sizeof(BlockHash);
    if (!link.id) return;
    by_worker_.erase(*link.id);
    if (link.role == WorkerRole::kPrefill) BroadcastPrefillWorkersLocked();
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
    if (!r.first_token_seen && !stopping_) {
      PDSERVE_LOG(INFO) << "request " << r.http_request_id << ": " << why
                        << " before the first token; retrying";
      r.decode.reset();
      r.prefill.reset();
      return DispatchLocked(id);
    }
    FailLocked(id, 503, why + " during generation", "server_error");
  }

  void OnTokenLocked(WorkerLink& link, const proto::Token& t) {
    Inflight* found = DispatchedOnLocked(link, t.request_id(), "Token");
    if (!found) return;  // cancelled or finished meanwhile, or not this worker's
    Inflight& r = *found;
    if (!r.first_token_seen) {
      r.first_token_seen = true;
      r.ttft_s = SecondsSince(r.arrived);
      metrics_.ttft.Observe(r.ttft_s);
      core_->OnPrefillDone(r.id);
      if (r.api->stream) {
        r.exchange->BeginStream(200, "text/event-stream", {{"x-request-id", r.http_request_id}});
        r.started_stream = true;
        r.exchange->Write(r.formatter->StreamStart());
      }
    }
    std::vector<TokenPiece> pieces;
    for (int i = 0; i < t.token_ids_size(); ++i) {
      TokenPiece p;
      p.token = t.token_ids(i);
      if (r.api->sampling.logprobs) {
        p.token_text = tokenizer_->Decode(std::span<const TokenId>(&p.token, 1), false);
        if (i < t.logprobs_size()) p.logprob = t.logprobs(i);
        if (i < t.top_logprobs_size()) {
          const auto& top = t.top_logprobs(i);
          for (int k = 0; k < top.token_ids_size() && k < top.logprobs_size(); ++k) {
            TokenId tid = top.token_ids(k);
            p.top_logprobs.emplace_back(
                tokenizer_->Decode(std::span<const TokenId>(&tid, 1), false), top.logprobs(k));
          }
        }
      }
      if (!t.has_text()) {
        if (!r.detok) r.detok = std::make_unique<IncrementalDetokenizer>(*tokenizer_, true);
        p.text = r.detok->Push(p.token);
      }
      pieces.push_back(std::move(p));
    }
    if (t.has_text() && !pieces.empty()) pieces.back().text = t.text();
    r.completion_tokens += pieces.size();
    if (r.api->stream) {
      std::string event = r.formatter->StreamDelta(pieces);
      if (!event.empty()) r.exchange->Write(std::move(event));
    } else {
      for (auto& p : pieces) r.pieces.push_back(std::move(p));
    }
  }

  void OnFinishedLocked(WorkerLink& link, const proto::Finished& f) {
    Inflight* found = DispatchedOnLocked(link, f.request_id(), "Finished");
    if (!found) return;
    Inflight& r = *found;
    if (f.reason() == proto::FINISH_REASON_CANCELLED) return;  // our own Cancel echoed back
    Usage usage;
    usage.prompt_tokens = f.usage().prompt_tokens();
    usage.completion_tokens = f.usage().completion_tokens();
    usage.cached_tokens = f.usage().cached_tokens();
    const char* finish = FinishName(f.reason());
    if (r.detok) {
      // Text held back by the router-side detokenizer ends the output.
      std::string tail = r.detok->Flush();
      if (!tail.empty()) {
        TokenPiece p;
        p.text = std::move(tail);
        if (r.api->stream) {
          r.exchange->Write(r.formatter->StreamDelta({p}));
        } else {
          r.pieces.push_back(std::move(p));
        }
      }
    }
    if (r.api->stream) {
      if (!r.started_stream) {
        r.exchange->BeginStream(200, "text/event-stream", {{"x-request-id", r.http_request_id}});
        r.exchange->Write(r.formatter->StreamStart());
      }
      r.exchange->Write(r.formatter->StreamFinish(finish, usage));
      r.exchange->End();
    } else {
      http::Response resp;
      resp.body = r.formatter->Complete(r.prompt_text, r.pieces, finish, usage).dump();
      resp.headers.emplace_back("x-request-id", r.http_request_id);
      r.exchange->Reply(std::move(resp));
    }
    PDSERVE_LOG(INFO) << "request " << r.http_request_id << " ok: prompt " << usage.prompt_tokens
                      << " (cached " << usage.cached_tokens << "), completion "
                      << usage.completion_tokens << ", finish " << finish << ", decode "
                      << WorkerName(r.decode)
                      << (r.prefill ? ", prefill " + WorkerName(r.prefill)
                                    : std::string(", local prefill"))
                      << ", ttft " << r.ttft_s << "s, total " << SecondsSince(r.arrived)
                      << "s, attempts " << r.attempts;
    FinishLocked(r.id, "ok");
  }

  void OnRequestErrorLocked(WorkerLink& link, const proto::Error& e) {
    Inflight* found = DispatchedOnLocked(link, e.request_id(), "Error");
    if (!found) return;
    const uint64_t id = found->id;
    PDSERVE_LOG(WARN) << "worker " << link.name << " failed request " << found->http_request_id
                      << ": " << e.message();
    core_->OnRequestFinished(id);
    if (e.retryable()) return RetryOrFailLocked(id, "worker " + link.name + ": " + e.message());
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
      r.exchange->Write(ResponseFormatter::StreamError(err));
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
        FailLocked(id, 504, "the request exceeded its deadline", "timeout");
      const RouterStats s = core_->stats();
      metrics_.index_blocks.Set(static_cast<double>(s.index.entries));
      metrics_.index_bytes.Set(static_cast<double>(s.index.bytes));
      metrics_.snapshot_pending_bytes.Set(static_cast<double>(snapshot_pending_bytes_));
      if (control_)
        metrics_.control_buffered_bytes.Set(static_cast<double>(control_->buffered_bytes()));
    }
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
      if (l.id && l.synced && (l.role == WorkerRole::kPrefill) == prefill) ++n;
    }
    return n;
  }

  void UpdateWorkerGaugesLocked() {
    for (const char* role : {"prefill", "decode", "both"}) {
      for (const char* state : {"ready", "syncing"})
        metrics_.workers.Add({{"role", role}, {"state", state}}).Set(0);
    }
    for (auto& [_, l] : links_) {
      if (!l.id) continue;
      metrics_.workers
          .Add({{"role", WorkerRoleName(l.role)}, {"state", l.synced ? "ready" : "syncing"}})
          .Increment();
    }
  }

  void CountRequest(const char* status) { metrics_.requests.Add({{"status", status}}).Increment(); }

  RouterServiceOptions opts_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  int64_t max_context_ = 0;
  std::string model_id_;
  std::vector<std::string> api_keys_;
  std::vector<std::string> metrics_keys_;  // empty: /metrics is open
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

  std::mutex mu_;  // everything below
  bool stopping_ = false;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, WorkerLink> links_;    // by connection id
  std::unordered_map<WorkerId, uint64_t> by_worker_;  // worker → connection id
  std::unordered_map<uint64_t, std::unique_ptr<Inflight>> inflight_;
  std::unordered_map<std::string, uint64_t> wire_ids_;  // Inflight::wire_id → id
  size_t snapshot_pending_bytes_ = 0;
};

}  // namespace

StatusOr<std::unique_ptr<RouterService>> RouterService::Create(RouterServiceOptions options) {
  auto service = std::make_unique<RouterServiceImpl>(std::move(options));
  PDSERVE_RETURN_IF_ERROR(service->Init());
  return std::unique_ptr<RouterService>(std::move(service));
}

}  // namespace pdserve::router
