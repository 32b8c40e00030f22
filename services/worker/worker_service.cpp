#include "services/worker/worker_service.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <unistd.h>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include "common/block_hash.h"
#include "common/http/bearer_auth.h"
#include "common/http/http_server.h"
#include "common/logging.h"
#include "common/metrics/metrics.h"
#include "common/proto/pdserve.pb.h"
#include "common/proto/protocol.h"
#include "common/random_id.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_id.h"
#include "kernels/cpu/cpu_backend.h"
#include "services/protocol/sampling.h"
#include "transport/control/connection.h"
#include "transport/kv_layout.h"
#include "transport/kv_transfer.h"
#include "transport/ucx/ucx_transfer.h"

namespace pdserve::worker {
namespace {

using Clock = std::chrono::steady_clock;
using control::ConnectionPtr;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Past a prefill peer's transfer deadline, its transport has given up; this
// margin covers clock granularity and bytes already on the wire.
constexpr auto kRemoteWriteGrace = std::chrono::milliseconds(2000);

proto::Role ToProto(Role r) {
  switch (r) {
    case Role::kPrefill:
      return proto::ROLE_PREFILL;
    case Role::kDecode:
      return proto::ROLE_DECODE;
    case Role::kBoth:
      return proto::ROLE_BOTH;
  }
  return proto::ROLE_UNSPECIFIED;
}

const char* RoleName(Role r) {
  switch (r) {
    case Role::kPrefill:
      return "prefill";
    case Role::kDecode:
      return "decode";
    case Role::kBoth:
      return "both";
  }
  return "?";
}

proto::Envelope RequestError(const std::string& rid, StatusCode code, const std::string& msg,
                             bool retryable) {
  proto::Envelope e;
  auto* err = e.mutable_error();
  err->set_request_id(rid);
  err->set_code(static_cast<proto::ErrorCode>(static_cast<int>(code)));
  err->set_message(msg);
  err->set_retryable(retryable);
  return e;
}

std::pair<std::string, uint16_t> SplitHostPort(const std::string& s) {
  auto colon = s.rfind(':');
  if (colon == std::string::npos) return {s, 0};
  int port = std::atoi(s.c_str() + colon + 1);
  return {s.substr(0, colon), static_cast<uint16_t>(port)};
}

// All IPv4 addresses of `host` (an address resolves to itself).
std::vector<std::string> Resolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  std::vector<std::string> out;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* p = res; p; p = p->ai_next) {
    char buf[64];
    auto* sin = reinterpret_cast<sockaddr_in*>(p->ai_addr);
    if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof(buf))) out.emplace_back(buf);
  }
  freeaddrinfo(res);
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

struct WorkerMetrics {
  explicit WorkerMetrics(prometheus::Registry& r)
      : queries(metrics::AddCounter(
            r, "pdserve_prefix_cache_queries_tokens_total",
            "Prompt tokens looked up in the prefix cache for prefill computation")),
        hits(metrics::AddCounter(
            r, "pdserve_prefix_cache_hits_tokens_total",
            "Prompt tokens found in the prefix cache (blocks received by transfer are "
            "not hits)")),
        usage(metrics::AddGauge(r, "pdserve_kv_cache_usage_ratio",
                                "Fraction of KV blocks held by requests")),
        running(metrics::AddGauge(r, "pdserve_requests_running",
                                  "Requests being prefilled or decoded")),
        waiting(metrics::AddGauge(r, "pdserve_requests_waiting",
                                  "Requests queued, including those waiting for remote KV")),
        ttft(metrics::AddHistogram(r, "pdserve_time_to_first_token_seconds",
                                   "Time from Generate to the first token",
                                   metrics::TimeToFirstTokenBuckets())),
        itl(metrics::AddHistogram(r, "pdserve_inter_token_latency_seconds",
                                  "Time between consecutive output tokens of a request",
                                  metrics::InterTokenLatencyBuckets())),
        transfer_seconds(metrics::AddHistogram(
            r, "pdserve_kv_transfer_seconds",
            "Time to write a prompt's KV blocks to a decode worker", metrics::KvTransferBuckets())),
        transfer_bytes(metrics::AddCounterFamily(r, "pdserve_kv_transfer_bytes_total",
                                                 "KV bytes moved between workers")),
        transfer_failures(
            metrics::AddCounter(r, "pdserve_kv_transfer_failures_total",
                                "KV hand-offs that failed (transfer error, timeout, lost peer)")),
        preemptions(
            metrics::AddCounter(r, "pdserve_preemptions_total",
                                "Sequences preempted for lack of KV blocks (recomputed later)")),
        requests(metrics::AddCounterFamily(
            r, "pdserve_requests_total", "Requests finished by this worker, by kind and outcome")),
        prefill_tokens(metrics::AddCounter(r, "pdserve_prompt_tokens_total",
                                           "Prompt tokens of requests admitted")),
        generation_tokens(
            metrics::AddCounter(r, "pdserve_generation_tokens_total", "Output tokens produced")),
        control_buffered_bytes(metrics::AddGauge(
            r, "pdserve_control_buffered_bytes",
            "Bytes held for control connections (routers and peer workers): incomplete "
            "received frames and queued sends")) {
    // Both directions exist from the start at 0: throughput panels and
    // alerts see a series on every worker before the first hand-off.
    for (const char* direction : {"in", "out"}) transfer_bytes.Add({{"direction", direction}});
  }

  prometheus::Counter& queries;
  prometheus::Counter& hits;
  prometheus::Gauge& usage;
  prometheus::Gauge& running;
  prometheus::Gauge& waiting;
  prometheus::Histogram& ttft;
  prometheus::Histogram& itl;
  prometheus::Histogram& transfer_seconds;
  prometheus::Family<prometheus::Counter>& transfer_bytes;
  prometheus::Counter& transfer_failures;
  prometheus::Counter& preemptions;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Counter& prefill_tokens;
  prometheus::Counter& generation_tokens;
  prometheus::Gauge& control_buffered_bytes;
};

// A request this worker decodes (decode/both roles).
struct DecodeRequest {
  RequestId id = 0;
  std::string router_rid;
  ConnectionPtr router;
  Clock::time_point arrived;
  Clock::time_point last_token;
  bool first_token_sent = false;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t completion_tokens = 0;
  // Remote prefill in progress.
  bool remote = false;  // waiting for a prefill peer
  bool prefilled_remotely = false;
  std::string prefill_address;
  Clock::time_point remote_give_up;  // transfer deadline + grace
  std::vector<BlockId> remote_blocks;
  bool cancel_after_remote = false;  // cancelled while the peer may still write
  std::string prefill_rid;           // id used with the prefill peer
};

// A prompt this worker prefills for a decode worker (prefill/both roles).
struct PrefillJob {
  RequestId id = 0;
  std::string decode_rid;
  ConnectionPtr decode;
  PeerId transfer_peer = 0;
  std::vector<std::pair<uint32_t, uint32_t>> writes;  // (prompt block index, remote block id)
  Clock::time_point arrived;
  Clock::time_point deadline;
};

// A decode worker connected to us for hand-offs (prefill side).
struct DecodePeer {
  bool layout_accepted = false;  // step 1 of the transfer handshake passed
  PeerId transfer_peer = 0;      // after step 3; 0 before
};

// Our client connection to one prefill worker.
struct PrefillPeer {
  std::unique_ptr<control::Client> client;
  bool ready = false;      // transfer handshake done
  bool forgotten = false;  // no router lists it: dropped when its connection closes
  PeerId transfer_peer = 0;
  std::deque<proto::Envelope> pending;  // Prefill messages waiting for the handshake
  std::string last_error;
};

class WorkerServiceImpl : public WorkerService {
 public:
  explicit WorkerServiceImpl(WorkerOptions o) : opts_(std::move(o)) {}

  ~WorkerServiceImpl() override { Stop(); }

  Status Init() {
    if (!opts_.metrics_key_file.empty()) {
      auto keys = http::LoadApiKeys(opts_.metrics_key_file);
      if (!keys.ok()) return keys.status();
      metrics_keys_ = std::move(*keys);
    }
    if (opts_.worker_id.empty()) {
      char host[256] = {0};
      gethostname(host, sizeof(host) - 1);
      opts_.worker_id =
          std::string(RoleName(opts_.role)) + "-" + host + "-" + std::to_string(getpid());
    }
    backend_ = std::make_unique<kernels::CpuBackend>(opts_.threads);
    auto model = Model::Load(opts_.model_dir, backend_.get());
    if (!model.ok()) return model.status();
    model_ = std::move(*model);
    model_id_ = ServedModelId(opts_.model_dir, model_->config(), opts_.model_id);
    auto tok = Tokenizer::Load(opts_.model_dir);
    if (!tok.ok()) return tok.status();
    tokenizer_ = std::move(*tok);
    EngineOptions eo;
    eo.model_id = model_id_;  // seeds the block hashes: must be the id the router hashes with
    eo.block_size = opts_.block_size;
    eo.kv_cache_bytes = opts_.kv_cache_bytes;
    eo.kv_dtype = opts_.kv_dtype;
    eo.max_num_seqs = opts_.max_num_seqs;
    eo.max_num_batched_tokens = opts_.max_num_batched_tokens;
    eo.record_kv_events = true;
    auto engine = Engine::Create(model_.get(), eo, tokenizer_.get());
    if (!engine.ok()) return engine.status();
    engine_ = std::move(*engine);

    // The KV transport: the whole pool, registered once.
    UcxTransferOptions uo;
    uo.tls = opts_.transfer_tls;
    uo.name = opts_.worker_id;
    auto transfer = CreateUcxTransfer(uo);
    if (!transfer.ok()) return transfer.status();
    transfer_ = std::move(*transfer);
    const KvCachePool& pool = engine_->kv_pool();
    layout_.model_id = model_id_;
    layout_.weight_dtype = DType::kF32;
    layout_.kv_dtype = opts_.kv_dtype;
    layout_.layers = model_->config().num_layers;
    layout_.kv_heads = model_->config().num_kv_heads;
    layout_.head_dim = model_->config().head_dim;
    layout_.block_tokens = opts_.block_size;
    layout_.bytes_per_block = pool.bytes_per_block();
    MemoryRegion region{pool.base(), static_cast<size_t>(pool.total_bytes()),
                        static_cast<size_t>(pool.bytes_per_block()), MemoryType::kHost};
    PDSERVE_RETURN_IF_ERROR(transfer_->RegisterPool(region, layout_));
    auto desc = transfer_->ExportDescriptor();
    if (!desc.ok()) return desc.status();
    descriptor_ = std::move(*desc);
    return Status::Ok();
  }

  Status Start() override {
    loop_ = std::make_unique<control::EventLoop>("worker-control", 1);
    // Peer server: decode workers connect here to hand us prefills.
    const control::ConnectionOptions co = ControlOptions();
    control::ConnectionHandlers peer_handlers;
    peer_handlers.on_message = [this](const ConnectionPtr& c, proto::Envelope& e) {
      OnPeerMessage(c, e);
    };
    peer_handlers.on_close = [this](const ConnectionPtr& c, const Status& s) {
      OnPeerClosed(c, s);
    };
    peer_server_ = std::make_unique<control::Server>(loop_.get(), co, peer_handlers);
    PDSERVE_RETURN_IF_ERROR(peer_server_->Listen(opts_.host, static_cast<uint16_t>(opts_.port)));
    control_address_ = (opts_.advertise_host.empty() ? "127.0.0.1" : opts_.advertise_host) + ":" +
                       std::to_string(peer_server_->port());

    if (opts_.metrics_port >= 0) {
      http::ServerOptions ho;
      ho.host = opts_.host;
      ho.port = opts_.metrics_port;
      ho.threads = 1;
      metrics_http_ = std::make_unique<http::Server>(
          ho, [this](const http::Request& r, std::shared_ptr<http::Exchange> ex) {
            if (r.path == "/metrics") RefreshCacheCounters();
            if (!metrics::ServeStandardEndpoints(
                    r, *ex, *registry_, [this] { return Health(); }, metrics_keys_)) {
              ex->Reply(http::ErrorResponse(404, "only /metrics and /health are served here"));
            }
          });
      PDSERVE_RETURN_IF_ERROR(metrics_http_->Start());
    }
    engine_thread_ = std::thread([this] { EngineLoop(); });
    dns_thread_ = std::thread([this] { DnsLoop(); });
    PDSERVE_LOG(INFO) << "worker " << opts_.worker_id << " (" << RoleName(opts_.role)
                      << ") serving model '" << model_id_
                      << "': " << engine_->kv_pool().num_blocks() << " KV blocks of "
                      << opts_.block_size << " tokens (" << DTypeName(opts_.kv_dtype)
                      << "), peers at " << control_address_ << ", metrics :" << metrics_port();
    return Status::Ok();
  }

  void Stop() override {
    if (stopped_.exchange(true)) return;
    if (!engine_thread_.joinable()) return;
    // Drain: tell the routers, finish what runs, then leave.
    draining_ = true;
    ForEachRouter([](control::Client& c) {
      proto::Envelope e;
      e.mutable_goodbye()->set_reason("worker draining");
      e.mutable_goodbye()->set_drain(true);
      (void)c.Send(std::move(e));
    });
    const auto give_up = Clock::now() + std::chrono::milliseconds(opts_.drain_timeout_ms);
    while (Clock::now() < give_up && busy_.load() > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (busy_.load() > 0)
      PDSERVE_LOG(WARN) << "worker: drain timeout; cancelling " << busy_.load() << " request(s)";
    stop_engine_ = true;
    cv_.notify_all();
    engine_thread_.join();
    dns_cv_.notify_all();
    if (dns_thread_.joinable()) dns_thread_.join();
    // Clients are stopped outside the locks: Stop() waits for their close
    // callbacks, which take these same locks on the loop thread.
    std::map<std::string, std::unique_ptr<control::Client>> routers;
    std::map<std::string, PrefillPeer> peers;
    {
      std::lock_guard<std::mutex> lock(routers_mu_);
      routers.swap(routers_);
    }
    std::vector<std::unique_ptr<control::Client>> retired;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      peers.swap(prefill_peers_);
      retired.swap(retired_clients_);
    }
    for (auto& [_, c] : routers) c->Stop("worker stopping");
    for (auto& [_, p] : peers) p.client->Stop("worker stopping");
    for (auto& c : retired) c->Stop("worker stopping");
    if (peer_server_) peer_server_->Stop("worker stopping");
    peer_server_.reset();
    if (metrics_http_) metrics_http_->Stop();
    loop_.reset();
    transfer_.reset();  // after every connection that could write
    PDSERVE_LOG(INFO) << "worker " << opts_.worker_id << " stopped";
  }

  int control_port() const override { return peer_server_ ? peer_server_->port() : 0; }
  int metrics_port() const override { return metrics_http_ ? metrics_http_->port() : -1; }
  const std::string& worker_id() const override { return opts_.worker_id; }

 private:
  // Every control connection of this worker, to routers and to peers.
  control::ConnectionOptions ControlOptions() const {
    control::ConnectionOptions co;
    co.role = ToProto(opts_.role);
    co.id = opts_.worker_id;
    co.secret = opts_.cluster_secret;
    co.tls = opts_.control_tls;
    return co;
  }

  // ------------------------------------------------------------- routers
  metrics::Health Health() {
    if (stopped_) return {false, "stopping"};
    if (routers_connected_.load() == 0) return {false, "no router connection"};
    return {true, ""};
  }

  void ForEachRouter(const std::function<void(control::Client&)>& fn) {
    std::lock_guard<std::mutex> lock(routers_mu_);
    for (auto& [_, c] : routers_) fn(*c);
  }

  // Keeps one client per resolved router address.
  void DnsLoop() {
    std::unique_lock<std::mutex> lock(dns_mu_);
    while (!stop_engine_) {
      lock.unlock();
      std::set<std::string> want;
      for (const auto& spec : opts_.routers) {
        auto [host, port] = SplitHostPort(spec);
        for (const auto& ip : Resolve(host)) want.insert(ip + ":" + std::to_string(port));
      }
      {
        std::lock_guard<std::mutex> rl(routers_mu_);
        for (auto it = routers_.begin(); it != routers_.end();) {
          if (!want.count(it->first)) {
            PDSERVE_LOG(INFO) << "router " << it->first << " no longer resolves; disconnecting";
            it->second->Stop("router address gone");
            it = routers_.erase(it);
          } else {
            ++it;
          }
        }
        for (const auto& addr : want) {
          if (routers_.count(addr)) continue;
          auto [host, port] = SplitHostPort(addr);
          control::ClientOptions co;
          co.connection = ControlOptions();
          control::ConnectionHandlers h;
          h.on_open = [this](const ConnectionPtr& c) { OnRouterOpen(c); };
          h.on_message = [this](const ConnectionPtr& c, proto::Envelope& e) {
            OnRouterMessage(c, e);
          };
          h.on_close = [this, addr](const ConnectionPtr& c, const Status& s) {
            OnRouterClosed(addr, c, s);
          };
          auto client = std::make_unique<control::Client>(loop_.get(), host, port, co, h);
          client->Start();
          routers_.emplace(addr, std::move(client));
        }
      }
      lock.lock();
      dns_cv_.wait_for(lock, std::chrono::milliseconds(opts_.dns_refresh_ms),
                       [this] { return stop_engine_.load(); });
    }
  }

  void OnRouterOpen(const ConnectionPtr& c) {
    routers_connected_.fetch_add(1);
    proto::Envelope e;
    auto* r = e.mutable_registration();
    r->set_worker_id(opts_.worker_id);
    r->set_role(ToProto(opts_.role));
    r->set_model_id(model_id_);
    r->set_block_size(static_cast<uint32_t>(opts_.block_size));
    r->set_hash_version(kBlockHashVersion);
    r->set_kv_capacity_blocks(static_cast<uint64_t>(engine_->kv_pool().num_blocks()));
    r->set_transfer_backend(std::string(transfer_->backend()));
    r->set_layout_hash(layout_.Hash());
    r->set_control_address(control_address_);
    r->set_metrics_port(static_cast<uint32_t>(std::max(0, metrics_port())));
    (void)c->Send(std::move(e));
    PDSERVE_LOG(INFO) << "registered with router " << c->remote_address();
    Post([this, c] {
      std::lock_guard<std::mutex> lock(pub_mu_);
      router_conns_.insert(c);
    });
  }

  void OnRouterMessage(const ConnectionPtr& c, proto::Envelope& e) {
    switch (e.body_case()) {
      case proto::Envelope::kGenerate:
        Post([this, c, g = std::move(*e.mutable_generate())]() mutable {
          OnGenerate(c, std::move(g));
        });
        return;
      case proto::Envelope::kCancel:
        Post([this, c, rid = e.cancel().request_id()] { OnRouterCancel(c, rid); });
        return;
      case proto::Envelope::kResync:
        Post([this, c] { SendSnapshot(c); });
        return;
      case proto::Envelope::kPrefillWorkers:
        if (opts_.role != Role::kPrefill) OnPrefillWorkers(c, e.prefill_workers());
        return;
      case proto::Envelope::kGoodbye:
        return;
      default:
        PDSERVE_LOG(WARN) << "router " << c->remote_address()
                          << " sent an unexpected message; ignored";
    }
  }

  void OnRouterClosed(const std::string& addr, const ConnectionPtr& c, const Status& why) {
    (void)addr;
    if (opts_.role != Role::kPrefill) ForgetRouterView(c);
    // on_close also runs for connections that never opened: only opened ones
    // were counted (router_conns_ tells which).
    Post([this, c, why] {
      bool was_open = false;
      {
        std::lock_guard<std::mutex> lock(pub_mu_);
        was_open = router_conns_.erase(c) > 0;
      }
      if (was_open) {
        routers_connected_.fetch_sub(1);
        PDSERVE_LOG(WARN) << "router " << c->remote_address() << " disconnected: " << why.message();
      }
      // Requests of that router cannot be delivered any more.
      std::vector<RequestId> orphans;
      for (auto& [id, r] : decode_) {
        if (r.router == c) orphans.push_back(id);
      }
      for (RequestId id : orphans) CancelDecode(id, "router connection lost");
    });
  }

  // --------------------------------------------------------- engine thread
  void Post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(cmd_mu_);
      commands_.push_back(std::move(fn));
    }
    cv_.notify_one();
  }

  void EngineLoop() {
    auto next_load = Clock::now();
    while (true) {
      std::deque<std::function<void()>> cmds;
      {
        std::unique_lock<std::mutex> lock(cmd_mu_);
        if (commands_.empty() && !HasRunnableWork() && !stop_engine_) {
          cv_.wait_for(lock, std::chrono::milliseconds(20));
        }
        cmds.swap(commands_);
      }
      for (auto& fn : cmds) fn();
      if (stop_engine_) break;
      CheckRemoteDeadlines();
      if (HasRunnableWork()) {
        auto outputs = engine_->Step();
        if (!outputs.ok()) {
          PDSERVE_LOG(ERROR) << "engine step failed: " << outputs.status().message();
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        } else {
          for (auto& out : *outputs) HandleOutput(out);
        }
      }
      PublishEvents();
      if (Clock::now() >= next_load) {
        SendLoad();
        next_load = Clock::now() + std::chrono::milliseconds(opts_.load_interval_ms);
      }
    }
    // Shutdown: cancel whatever is left so no block stays held.
    std::vector<RequestId> left;
    for (auto& [id, _] : decode_) left.push_back(id);
    for (RequestId id : left) CancelDecode(id, "worker stopping");
    for (auto& [id, job] : prefill_) (void)engine_->Cancel(id);
    prefill_.clear();
  }

  bool HasRunnableWork() const {
    const auto s = engine_->GetStats();
    return s.num_running + s.num_waiting > 0;
  }

  void OnGenerate(const ConnectionPtr& router, proto::Generate g) {
    if (draining_) {
      (void)router->Send(
          RequestError(g.request_id(), StatusCode::kUnavailable, "worker is draining", true));
      return;
    }
    if (opts_.role == Role::kPrefill) {
      (void)router->Send(RequestError(g.request_id(), StatusCode::kUnsupported,
                                      "this is a prefill worker; send Generate to a decode worker",
                                      true));
      return;
    }
    EngineRequest req;
    req.id = next_id_++;
    req.prompt.assign(g.prompt_token_ids().begin(), g.prompt_token_ids().end());
    req.params = FromProto(g.sampling());
    req.params.seed = ResolveSeed(req.params);  // the prefill peer must sample with the same seed
    req.cache_salt = g.cache_salt();
    DecodeRequest d;
    d.id = req.id;
    d.router_rid = g.request_id();
    d.router = router;
    d.arrived = Clock::now();
    d.prompt_tokens = static_cast<int64_t>(req.prompt.size());

    const bool can_remote = !g.prefill_address().empty();
    if (can_remote) {
      EngineRequest copy = req;
      auto plan = engine_->AddRemotePrefillRequest(std::move(copy));
      if (!plan.ok()) return RejectGenerate(router, g.request_id(), plan.status());
      const int64_t to_compute = d.prompt_tokens - plan->num_cached_tokens;
      if (to_compute > opts_.max_local_prefill) {
        d.remote = true;
        d.prefill_address = g.prefill_address();
        d.cached_tokens = plan->num_cached_tokens;
        d.prefill_rid = NewUnguessableId();
        const auto deadline = Clock::now() + std::chrono::milliseconds(opts_.prefill_timeout_ms);
        d.remote_give_up = deadline + kRemoteWriteGrace;
        proto::Envelope env;
        auto* p = env.mutable_prefill();
        p->set_request_id(d.prefill_rid);
        for (TokenId t : req.prompt) p->add_prompt_token_ids(t);
        ToProto(req.params, p->mutable_sampling());
        p->set_cache_salt(req.cache_salt);
        for (size_t i = plan->first_block_to_fill; i < plan->block_ids.size(); ++i) {
          auto* w = p->add_blocks();
          w->set_prompt_block_index(static_cast<uint32_t>(i));
          w->set_remote_block_id(plan->block_ids[i]);
          d.remote_blocks.push_back(plan->block_ids[i]);
        }
        p->set_decode_worker_id(opts_.worker_id);
        p->set_deadline_ms(static_cast<uint32_t>(opts_.prefill_timeout_ms));
        metrics_.prefill_tokens.Increment(static_cast<double>(d.prompt_tokens));
        decode_.emplace(d.id, std::move(d));
        busy_.fetch_add(1);
        SendToPrefillPeer(decode_.at(req.id).prefill_address, std::move(env), req.id);
        return;
      }
      // Not worth a hand-off: give the reservation back and prefill here.
      (void)engine_->FailRemotePrefill(req.id);
      d.cached_tokens = plan->num_cached_tokens;
    } else {
      if (Status st = engine_->AddRequest(std::move(req)); !st.ok()) {
        return RejectGenerate(router, g.request_id(), st);
      }
    }
    metrics_.prefill_tokens.Increment(static_cast<double>(d.prompt_tokens));
    decode_.emplace(d.id, std::move(d));
    busy_.fetch_add(1);
  }

  void RejectGenerate(const ConnectionPtr& router, const std::string& rid, const Status& st) {
    PDSERVE_LOG(INFO) << "request " << rid << " refused: " << st.message();
    const bool retryable =
        st.code() == StatusCode::kResourceExhausted || st.code() == StatusCode::kUnavailable;
    (void)router->Send(RequestError(rid, st.code(), st.message(), retryable));
    metrics_.requests.Add({{"kind", "decode"}, {"outcome", "refused"}}).Increment();
  }

  void OnRouterCancel(const ConnectionPtr& router, const std::string& rid) {
    for (auto& [id, r] : decode_) {
      if (r.router == router && r.router_rid == rid)
        return CancelDecode(id, "cancelled by the router");
    }
  }

  // Frees everything a decode request holds (deferred while a peer may write).
  void CancelDecode(RequestId id, const std::string& why) {
    auto it = decode_.find(id);
    if (it == decode_.end()) return;
    DecodeRequest& r = it->second;
    if (r.remote) {
      r.cancel_after_remote = true;  // released when the peer answers, dies or times out
      PDSERVE_LOG(INFO) << "request " << r.router_rid << " cancelled (" << why
                        << "); its blocks are released once the prefill peer is done with them";
      return;
    }
    (void)engine_->Cancel(id);
    PDSERVE_LOG(INFO) << "request " << r.router_rid << " cancelled: " << why << " after "
                      << r.completion_tokens << " tokens";
    metrics_.requests.Add({{"kind", "decode"}, {"outcome", "cancelled"}}).Increment();
    decode_.erase(it);
    busy_.fetch_sub(1);
  }

  void HandleOutput(RequestOutput& out) {
    if (auto pj = prefill_.find(out.id); pj != prefill_.end())
      return OnPrefillComputed(pj->second, out);
    auto it = decode_.find(out.id);
    if (it == decode_.end()) return;
    DecodeRequest& r = it->second;
    const auto now = Clock::now();
    if (!out.new_token_ids.empty()) {
      if (!r.first_token_sent) {
        r.first_token_sent = true;
        metrics_.ttft.Observe(Seconds(now - r.arrived));
        if (!r.remote) r.cached_tokens = out.num_cached_tokens;
      } else {
        const double gap =
            Seconds(now - r.last_token) / static_cast<double>(out.new_token_ids.size());
        for (size_t i = 0; i < out.new_token_ids.size(); ++i) metrics_.itl.Observe(gap);
      }
      r.last_token = now;
      r.completion_tokens += static_cast<int64_t>(out.new_token_ids.size());
      metrics_.generation_tokens.Increment(static_cast<double>(out.new_token_ids.size()));
      proto::Envelope env;
      auto* t = env.mutable_token();
      t->set_request_id(r.router_rid);
      for (TokenId id : out.new_token_ids) t->add_token_ids(id);
      for (const auto& lp : out.logprobs) {
        t->add_logprobs(lp.logprob);
        auto* top = t->add_top_logprobs();
        for (const auto& alt : lp.top_logprobs) {
          top->add_token_ids(alt.token);
          top->add_logprobs(alt.logprob);
        }
      }
      t->set_text(out.text);
      (void)r.router->Send(std::move(env));
    }
    if (out.finished) {
      proto::Envelope env;
      auto* f = env.mutable_finished();
      f->set_request_id(r.router_rid);
      f->set_reason(out.finish_reason == FinishReason::kLength ? proto::FINISH_REASON_LENGTH
                                                               : proto::FINISH_REASON_STOP);
      f->mutable_usage()->set_prompt_tokens(static_cast<uint32_t>(r.prompt_tokens));
      f->mutable_usage()->set_completion_tokens(static_cast<uint32_t>(r.completion_tokens));
      f->mutable_usage()->set_cached_tokens(static_cast<uint32_t>(r.cached_tokens));
      (void)r.router->Send(std::move(env));
      PDSERVE_LOG(INFO) << "request " << r.router_rid << " done: prompt " << r.prompt_tokens
                        << " (cached " << r.cached_tokens << "), completion " << r.completion_tokens
                        << ", " << (r.prefilled_remotely ? "remote" : "local") << " prefill, "
                        << FinishReasonName(out.finish_reason) << ", " << Seconds(now - r.arrived)
                        << "s";
      metrics_.requests.Add({{"kind", "decode"}, {"outcome", "ok"}}).Increment();
      decode_.erase(it);
      busy_.fetch_sub(1);
    }
  }

  // ------------------------------------------------- decode side of hand-off
  // A client to the prefill worker at `address`, started. Requires peers_mu_.
  PrefillPeer& EnsurePrefillPeerLocked(const std::string& address) {
    auto it = prefill_peers_.find(address);
    if (it != prefill_peers_.end()) return it->second;
    auto [host, port] = SplitHostPort(address);
    control::ClientOptions co;
    co.connection = ControlOptions();
    co.connect_timeout = std::chrono::milliseconds(2000);
    control::ConnectionHandlers h;
    h.on_open = [this, address](const ConnectionPtr& c) { OnPrefillPeerOpen(address, c); };
    h.on_message = [this, address](const ConnectionPtr& c, proto::Envelope& e) {
      OnPrefillPeerMessage(address, c, e);
    };
    h.on_close = [this, address](const ConnectionPtr& c, const Status& s) {
      OnPrefillPeerClosed(address, c, s);
    };
    PrefillPeer peer;
    peer.client = std::make_unique<control::Client>(loop_.get(), host, port, co, h);
    peer.client->Start();
    return prefill_peers_.emplace(address, std::move(peer)).first->second;
  }

  void SendToPrefillPeer(const std::string& address, proto::Envelope prefill, RequestId id) {
    std::lock_guard<std::mutex> lock(peers_mu_);
    PrefillPeer& peer = EnsurePrefillPeerLocked(address);
    peer.forgotten = false;  // a router just named it
    if (peer.ready && peer.client->Send(prefill).ok()) return;
    if (!peer.ready && peer.pending.size() < 4096) {
      peer.pending.push_back(std::move(prefill));
      return;
    }
    Post(
        [this, id, why = "prefill peer " + address + " unavailable"] { FallBackToLocal(id, why); });
  }

  // A router's list of the prefill workers it admits (see the header).
  void OnPrefillWorkers(const ConnectionPtr& router, const proto::PrefillWorkers& list) {
    std::set<std::string> announced;
    for (const auto& w : list.workers()) {
      if (!w.control_address().empty()) announced.insert(w.control_address());
    }
    std::vector<std::string> dropped;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      std::set<std::string>& view = router_prefill_views_[router->id()];
      for (const auto& address : announced) {
        const bool new_here = !view.count(address);
        PrefillPeer& peer = EnsurePrefillPeerLocked(address);
        peer.forgotten = false;
        // Re-admitted by a router: whatever backoff a failed connection left
        // behind, try now, so its first request does not wait seconds.
        if (new_here && !peer.ready) peer.client->ReconnectNow();
      }
      view = std::move(announced);
      dropped = ReconcilePrefillPeersLocked();
    }
    StopRetiredClients();
    FallBackRequestsOf(dropped, "prefill worker removed by the router");
  }

  void ForgetRouterView(const ConnectionPtr& router) {
    std::vector<std::string> dropped;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      if (router_prefill_views_.erase(router->id()) == 0) return;
      dropped = ReconcilePrefillPeersLocked();
    }
    StopRetiredClients();
    FallBackRequestsOf(dropped, "prefill worker no longer listed by any router");
  }

  // Stops reconnecting to prefill workers no router lists. A peer with an
  // open connection is only marked: it may still hold hand-offs, and goes
  // when that connection closes. Returns the addresses dropped now. Requires
  // peers_mu_.
  std::vector<std::string> ReconcilePrefillPeersLocked() {
    std::set<std::string> listed;
    for (const auto& [_, view] : router_prefill_views_) listed.insert(view.begin(), view.end());
    std::vector<std::string> dropped;
    for (auto it = prefill_peers_.begin(); it != prefill_peers_.end();) {
      if (listed.count(it->first)) {
        ++it;
        continue;
      }
      if (it->second.ready) {
        it->second.forgotten = true;
        ++it;
        continue;
      }
      PDSERVE_LOG(INFO) << "prefill worker " << it->first << " is no longer listed by a router; "
                        << "not reconnecting";
      retired_clients_.push_back(std::move(it->second.client));
      dropped.push_back(it->first);
      it = prefill_peers_.erase(it);
    }
    return dropped;
  }

  // Stops the clients of forgotten prefill peers. Called without peers_mu_
  // (a client's close may run its on_close inline, which takes that lock);
  // from the loop thread, Stop() does not wait, so this is safe inside a
  // client's own callbacks too.
  void StopRetiredClients() {
    std::vector<std::unique_ptr<control::Client>> retired;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      retired.swap(retired_clients_);
    }
    for (auto& c : retired) c->Stop("prefill worker no longer listed by a router");
  }

  // Requests waiting on a prefill peer that is gone before anything was sent
  // to it (or whose connection closed: it writes nothing more).
  void FallBackRequestsOf(const std::vector<std::string>& addresses, const std::string& why) {
    if (addresses.empty()) return;
    Post([this, addresses, why] {
      std::vector<RequestId> ids;
      for (auto& [id, r] : decode_) {
        if (r.remote &&
            std::find(addresses.begin(), addresses.end(), r.prefill_address) != addresses.end()) {
          ids.push_back(id);
        }
      }
      for (RequestId id : ids) FallBackToLocal(id, why);
    });
  }

  // Step 1 of the transfer handshake (pdserve.proto, TransferHello): our
  // layout only; the descriptor follows once the peer accepted it.
  void OnPrefillPeerOpen(const std::string& address, const ConnectionPtr& c) {
    proto::Envelope e;
    auto* h = e.mutable_transfer_hello();
    h->set_worker_id(opts_.worker_id);
    h->set_backend(std::string(transfer_->backend()));
    h->set_kv_layout(layout_.Encode());
    h->set_layout_hash(layout_.Hash());
    (void)c->Send(std::move(e));
    PDSERVE_LOG(INFO) << "connected to prefill worker " << address << "; transfer handshake sent";
  }

  void OnPrefillPeerMessage(const std::string& address, const ConnectionPtr& c,
                            proto::Envelope& e) {
    if (e.has_transfer_hello()) {
      const proto::TransferHello& hello = e.transfer_hello();
      auto refuse = [&](const std::string& why) {
        {
          std::lock_guard<std::mutex> lock(peers_mu_);
          if (auto it = prefill_peers_.find(address); it != prefill_peers_.end())
            it->second.last_error = why;
        }
        PDSERVE_LOG(ERROR) << "prefill worker " << address
                           << ": transfer handshake failed: " << why;
        c->Close("transfer handshake failed: " + why);
      };
      if (hello.transfer_descriptor().empty()) {
        // Step 2: the peer accepted our layout and shows its own.
        if (Status st = CheckPeerLayout(hello); !st.ok()) return refuse(st.message());
        proto::Envelope offer;
        offer.mutable_transfer_hello()->set_worker_id(opts_.worker_id);
        offer.mutable_transfer_hello()->set_transfer_descriptor(descriptor_);
        (void)c->Send(std::move(offer));
        return;
      }
      // Step 4: the writer's reply to our descriptor.
      auto peer = transfer_->Accept(hello.transfer_descriptor());
      if (!peer.ok()) return refuse(peer.status().message());
      std::deque<proto::Envelope> flush;
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        auto it = prefill_peers_.find(address);
        if (it == prefill_peers_.end()) return;  // forgotten meanwhile
        it->second.ready = true;
        it->second.transfer_peer = *peer;
        flush.swap(it->second.pending);
      }
      for (auto& env : flush) (void)c->Send(std::move(env));
      return;
    }
    if (e.has_prefill_done()) {
      Post([this, address, done = std::move(*e.mutable_prefill_done())] {
        OnPrefillDone(address, done);
      });
      return;
    }
    if (e.has_error()) {
      PDSERVE_LOG(WARN) << "prefill worker " << address << ": " << e.error().message();
      return;
    }
  }

  // The peer's TransferHello layout against ours: OK, or the differences.
  Status CheckPeerLayout(const proto::TransferHello& hello) const {
    auto peer_layout = KvLayout::Decode(hello.kv_layout());
    if (!peer_layout.ok())
      return Status::InvalidArgument("bad KV layout from peer: " + peer_layout.status().message());
    return CheckLayoutsMatch(layout_, *peer_layout);
  }

  void OnPrefillPeerClosed(const std::string& address, const ConnectionPtr& c, const Status& why) {
    (void)c;
    std::deque<proto::Envelope> dropped;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = prefill_peers_.find(address);
      if (it != prefill_peers_.end()) {
        it->second.ready = false;
        dropped.swap(it->second.pending);
        if (!why.ok() && it->second.last_error.empty()) it->second.last_error = why.message();
        if (it->second.forgotten) {
          PDSERVE_LOG(INFO) << "prefill worker " << address
                            << " closed and no router lists it; not reconnecting";
          retired_clients_.push_back(std::move(it->second.client));
          prefill_peers_.erase(it);
        }
      }
    }
    StopRetiredClients();
    // A closed peer writes nothing more: every hand-off it held falls back now.
    Post([this, address, why] {
      std::vector<RequestId> ids;
      for (auto& [id, r] : decode_) {
        if (r.remote && r.prefill_address == address) ids.push_back(id);
      }
      if (!ids.empty()) {
        PDSERVE_LOG(WARN) << "prefill worker " << address << " lost (" << why.message() << "); "
                          << ids.size() << " request(s) fall back to local prefill";
      }
      for (RequestId id : ids) FallBackToLocal(id, "prefill worker lost: " + why.message());
    });
  }

  // Accepted only from the prefill worker the request was sent to.
  void OnPrefillDone(const std::string& address, const proto::PrefillDone& done) {
    RequestId id = 0;
    for (auto& [rid, r] : decode_) {
      if (r.remote && r.prefill_rid == done.request_id() && r.prefill_address == address) id = rid;
    }
    if (id == 0) return;
    DecodeRequest& r = decode_.at(id);
    if (!done.ok()) return FallBackToLocal(id, "prefill failed: " + done.failure_reason());
    r.remote = false;
    r.prefilled_remotely = true;
    metrics_.transfer_bytes.Add({{"direction", "in"}})
        .Increment(static_cast<double>(done.bytes_written()));
    if (r.cancel_after_remote) {
      (void)engine_->Cancel(id);
      metrics_.requests.Add({{"kind", "decode"}, {"outcome", "cancelled"}}).Increment();
      decode_.erase(id);
      busy_.fetch_sub(1);
      return;
    }
    if (Status st = transfer_->FinishReceive(r.remote_blocks); !st.ok()) {
      return FallBackToLocal(id, "receiving KV failed: " + st.message());
    }
    r.cached_tokens = done.cached_tokens();
    std::optional<SampledToken> sampled;
    if (done.has_first_token_top_logprobs() || done.first_token_logprob() != 0) {
      SampledToken s;
      s.token = done.first_token_id();
      s.logprob = done.first_token_logprob();
      const auto& top = done.first_token_top_logprobs();
      for (int k = 0; k < top.token_ids_size() && k < top.logprobs_size(); ++k) {
        s.top_logprobs.push_back({top.token_ids(k), top.logprobs(k)});
      }
      sampled = std::move(s);
    }
    if (Status st = engine_->CompleteRemotePrefill(id, done.first_token_id(), sampled); !st.ok()) {
      PDSERVE_LOG(ERROR) << "request " << r.router_rid << ": " << st.message();
      FallBackToLocal(id, st.message());
    }
  }

  // The hand-off did not happen: prefill locally (or finish a pending cancel).
  void FallBackToLocal(RequestId id, const std::string& why) {
    auto it = decode_.find(id);
    if (it == decode_.end() || !it->second.remote) return;
    DecodeRequest& r = it->second;
    r.remote = false;
    metrics_.transfer_failures.Increment();
    if (r.cancel_after_remote) {
      (void)engine_->Cancel(id);
      metrics_.requests.Add({{"kind", "decode"}, {"outcome", "cancelled"}}).Increment();
      decode_.erase(it);
      busy_.fetch_sub(1);
      return;
    }
    PDSERVE_LOG(WARN) << "request " << r.router_rid << ": " << why << "; prefilling locally";
    if (Status st = engine_->FailRemotePrefill(id); !st.ok()) {
      (void)r.router->Send(
          RequestError(r.router_rid, st.code(), st.message(), !r.first_token_sent));
      decode_.erase(it);
      busy_.fetch_sub(1);
    }
  }

  void CheckRemoteDeadlines() {
    const auto now = Clock::now();
    std::vector<RequestId> late;
    for (auto& [id, r] : decode_) {
      if (r.remote && now > r.remote_give_up) late.push_back(id);
    }
    for (RequestId id : late) FallBackToLocal(id, "prefill worker timed out");
  }

  // ------------------------------------------------ prefill side of hand-off
  void OnPeerMessage(const ConnectionPtr& c, proto::Envelope& e) {
    if (e.has_transfer_hello()) return OnPeerTransferHello(c, e.transfer_hello());
    if (e.has_prefill()) {
      PeerId peer = 0;
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        auto it = decode_peers_.find(c->id());
        if (it != decode_peers_.end()) peer = it->second.transfer_peer;
      }
      Post([this, c, peer, p = std::move(*e.mutable_prefill())]() mutable {
        OnPrefill(c, peer, std::move(p));
      });
      return;
    }
  }

  // The writer's half of the transfer handshake (pdserve.proto, TransferHello).
  void OnPeerTransferHello(const ConnectionPtr& c, const proto::TransferHello& hello) {
    auto refuse = [&](const Status& st) {
      PDSERVE_LOG(ERROR) << "decode worker " << hello.worker_id() << " from " << c->remote_address()
                         << " refused: " << st.message();
      proto::Envelope err;
      err.mutable_error()->set_code(proto::ToErrorCode(st.code()));
      // The message names the mismatch ("KV layout mismatch: ...").
      err.mutable_error()->set_message(st.message());
      (void)c->Send(std::move(err));
      loop_->Post([c, msg = st.message()] { c->Close(msg); });
    };
    if (hello.transfer_descriptor().empty()) {
      // Step 1: the decode worker's layout. Ours goes back only if they agree.
      if (Status st = CheckPeerLayout(hello); !st.ok()) return refuse(st);
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        decode_peers_[c->id()].layout_accepted = true;
      }
      proto::Envelope reply;
      auto* h = reply.mutable_transfer_hello();
      h->set_worker_id(opts_.worker_id);
      h->set_backend(std::string(transfer_->backend()));
      h->set_kv_layout(layout_.Encode());
      h->set_layout_hash(layout_.Hash());
      (void)c->Send(std::move(reply));
      return;
    }
    // Step 3: the decode worker's descriptor, after the layouts agreed. We
    // write into that pool: we are the transfer's writer.
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = decode_peers_.find(c->id());
      if (it == decode_peers_.end() || !it->second.layout_accepted || it->second.transfer_peer) {
        return refuse(Status::InvalidArgument(
            "transfer descriptor out of order (layout first, descriptor once)"));
      }
    }
    auto conn = transfer_->Connect(hello.transfer_descriptor());
    if (!conn.ok()) return refuse(conn.status());
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      decode_peers_[c->id()].transfer_peer = conn->peer;
    }
    proto::Envelope reply;
    auto* h = reply.mutable_transfer_hello();
    h->set_worker_id(opts_.worker_id);
    h->set_transfer_descriptor(conn->reply);
    (void)c->Send(std::move(reply));
    PDSERVE_LOG(INFO) << "decode worker " << hello.worker_id() << " connected for KV hand-off";
  }

  void OnPeerClosed(const ConnectionPtr& c, const Status&) {
    PeerId peer = 0;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = decode_peers_.find(c->id());
      if (it == decode_peers_.end()) return;
      peer = it->second.transfer_peer;
      decode_peers_.erase(it);
    }
    if (peer) transfer_->Disconnect(peer);
  }

  void OnPrefill(const ConnectionPtr& decode, PeerId peer, proto::Prefill p) {
    auto fail = [&](const std::string& why, bool retryable) {
      proto::Envelope env;
      auto* d = env.mutable_prefill_done();
      d->set_request_id(p.request_id());
      d->set_ok(false);
      d->set_failure_reason(why);
      d->set_retryable(retryable);
      (void)decode->Send(std::move(env));
      metrics_.transfer_failures.Increment();
      metrics_.requests.Add({{"kind", "prefill"}, {"outcome", "failed"}}).Increment();
    };
    if (opts_.role == Role::kDecode) return fail("this is a decode-only worker", false);
    if (draining_) return fail("prefill worker is draining", true);
    if (peer == 0) return fail("no transfer handshake on this connection", false);
    EngineRequest req;
    req.id = next_id_++;
    req.prompt.assign(p.prompt_token_ids().begin(), p.prompt_token_ids().end());
    req.params = FromProto(p.sampling());
    req.params.max_tokens = 1;
    req.cache_salt = p.cache_salt();
    req.prefill_only = true;
    if (Status st = engine_->AddRequest(std::move(req)); !st.ok()) return fail(st.message(), false);
    PrefillJob job;
    job.id = next_id_ - 1;
    job.decode_rid = p.request_id();
    job.decode = decode;
    job.transfer_peer = peer;
    for (const auto& w : p.blocks())
      job.writes.emplace_back(w.prompt_block_index(), w.remote_block_id());
    job.arrived = Clock::now();
    job.deadline =
        job.arrived + std::chrono::milliseconds(p.deadline_ms() ? p.deadline_ms() : 30'000);
    metrics_.prefill_tokens.Increment(static_cast<double>(p.prompt_token_ids_size()));
    prefill_.emplace(job.id, std::move(job));
    busy_.fetch_add(1);
  }

  void OnPrefillComputed(PrefillJob& job, RequestOutput& out) {
    if (!out.finished) return;  // a partial (chunked) prefill step
    PrefillJob j = std::move(job);
    prefill_.erase(out.id);
    const std::optional<PinId> pin = out.kv_pin;
    auto release = [this, pin] {
      if (pin) Post([this, pin] { (void)engine_->ReleaseKvBlocks(*pin); });
    };
    auto fail = [&](const std::string& why) {
      proto::Envelope env;
      auto* d = env.mutable_prefill_done();
      d->set_request_id(j.decode_rid);
      d->set_ok(false);
      d->set_failure_reason(why);
      d->set_retryable(true);
      (void)j.decode->Send(std::move(env));
      metrics_.transfer_failures.Increment();
      metrics_.requests.Add({{"kind", "prefill"}, {"outcome", "failed"}}).Increment();
      release();
      busy_.fetch_sub(1);
    };
    if (out.new_token_ids.empty()) return fail("prefill produced no token");
    std::vector<BlockCopy> copies;
    for (auto [index, remote] : j.writes) {
      if (index >= out.kv_blocks.size())
        return fail("block index " + std::to_string(index) + " beyond the prompt");
      copies.push_back({out.kv_blocks[index], remote});
    }
    proto::Envelope env;
    auto* d = env.mutable_prefill_done();
    d->set_request_id(j.decode_rid);
    d->set_ok(true);
    d->set_first_token_id(out.new_token_ids[0]);
    if (!out.logprobs.empty()) {
      d->set_first_token_logprob(out.logprobs[0].logprob);
      for (const auto& alt : out.logprobs[0].top_logprobs) {
        d->mutable_first_token_top_logprobs()->add_token_ids(alt.token);
        d->mutable_first_token_top_logprobs()->add_logprobs(alt.logprob);
      }
    }
    const uint64_t bytes =
        copies.size() * static_cast<uint64_t>(engine_->kv_pool().bytes_per_block());
    d->set_blocks_written(static_cast<uint32_t>(copies.size()));
    d->set_bytes_written(bytes);
    d->set_cached_tokens(static_cast<uint32_t>(out.num_cached_tokens));
    const auto started = Clock::now();
    auto decode = j.decode;
    auto rid = j.decode_rid;
    const auto arrived = j.arrived;
    const size_t nblocks = copies.size();
    const int64_t cached = out.num_cached_tokens;
    transfer_->Write(
        j.transfer_peer, std::move(copies), j.deadline,
        [this, decode, env = std::move(env), release, started, arrived, bytes, rid, nblocks,
         cached](Status st) mutable {
          if (st.ok()) {
            metrics_.transfer_seconds.Observe(Seconds(Clock::now() - started));
            metrics_.transfer_bytes.Add({{"direction", "out"}})
                .Increment(static_cast<double>(bytes));
            metrics_.requests.Add({{"kind", "prefill"}, {"outcome", "ok"}}).Increment();
            (void)decode->Send(std::move(env));
            PDSERVE_LOG(INFO) << "prefill " << rid << " done: " << nblocks << " blocks (" << bytes
                              << " bytes) written, " << cached << " prompt tokens cached, "
                              << Seconds(Clock::now() - arrived) << "s";
          } else {
            proto::Envelope fail;
            auto* f = fail.mutable_prefill_done();
            f->set_request_id(rid);
            f->set_ok(false);
            f->set_failure_reason("KV transfer failed: " + st.message());
            f->set_retryable(true);
            (void)decode->Send(std::move(fail));
            metrics_.transfer_failures.Increment();
            metrics_.requests.Add({{"kind", "prefill"}, {"outcome", "failed"}}).Increment();
            PDSERVE_LOG(WARN) << "prefill " << rid << ": KV transfer failed: " << st.message();
          }
          release();
          busy_.fetch_sub(1);
        });
  }

  // ------------------------------------------------------ events and load
  void PublishEvents() {
    auto batches = engine_->block_manager().DrainEvents();
    std::lock_guard<std::mutex> lock(pub_mu_);
    if (batches.empty() || router_conns_.empty()) return;
    for (const auto& b : batches) {
      proto::Envelope env;
      auto* ev = env.mutable_kv_events();
      ev->set_sequence(b.sequence_number);
      for (const auto& e : b.events) {
        auto* pe = ev->add_events();
        if (auto* s = std::get_if<KvStored>(&e)) {
          auto* st = pe->mutable_stored();
          for (BlockHash h : s->block_hashes) st->add_block_hashes(h);
          if (s->parent_hash) st->set_parent_hash(*s->parent_hash);
        } else if (auto* r = std::get_if<KvRemoved>(&e)) {
          auto* rm = pe->mutable_removed();
          for (BlockHash h : r->block_hashes) rm->add_block_hashes(h);
        } else {
          pe->mutable_cleared();
        }
      }
      for (const auto& c : router_conns_) (void)c->Send(env);
    }
  }

  void SendSnapshot(const ConnectionPtr& c) {
    PublishEvents();  // everything up to now goes out first, so the snapshot follows it
    KvCacheSnapshot snap = engine_->block_manager().Snapshot();
    constexpr size_t kChunk = 64 * 1024;
    size_t i = 0;
    uint32_t chunk = 0;
    do {
      proto::Envelope env;
      auto* s = env.mutable_kv_snapshot();
      s->set_sequence(snap.last_sequence_number);
      s->set_chunk_index(chunk++);
      const size_t end = std::min(snap.block_hashes.size(), i + kChunk);
      for (; i < end; ++i) s->add_block_hashes(snap.block_hashes[i]);
      s->set_last_chunk(i >= snap.block_hashes.size());
      (void)c->Send(std::move(env));
    } while (i < snap.block_hashes.size());
  }

  void SendLoad() {
    const EngineStats s = engine_->GetStats();
    int64_t queued_tokens = 0;
    for (auto& [_, r] : decode_) {
      if (!r.first_token_sent && !r.remote) queued_tokens += r.prompt_tokens - r.cached_tokens;
    }
    proto::Envelope env;
    auto* l = env.mutable_load();
    l->set_queued_prefill_tokens(static_cast<uint64_t>(std::max<int64_t>(0, queued_tokens)));
    l->set_running_requests(static_cast<uint32_t>(s.num_running));
    l->set_waiting_requests(static_cast<uint32_t>(s.num_waiting + s.num_remote_waiting));
    l->set_free_blocks(s.blocks.allocatable_blocks);
    l->set_total_blocks(s.blocks.num_blocks);
    {
      std::lock_guard<std::mutex> lock(pub_mu_);
      for (const auto& c : router_conns_) (void)c->Send(env);
    }
    // Metrics from the same snapshot.
    metrics_.control_buffered_bytes.Set(static_cast<double>(ControlBufferedBytes()));
    metrics_.usage.Set(s.blocks.usage_ratio);
    metrics_.running.Set(static_cast<double>(s.num_running));
    metrics_.waiting.Set(static_cast<double>(s.num_waiting + s.num_remote_waiting));
    RefreshCacheCounters();
    std::lock_guard<std::mutex> lock(counters_mu_);
    if (s.num_preemptions > last_preemptions_) {
      metrics_.preemptions.Increment(static_cast<double>(s.num_preemptions - last_preemptions_));
    }
    last_preemptions_ = s.num_preemptions;
  }

  size_t ControlBufferedBytes() {
    size_t total = peer_server_ ? peer_server_->buffered_bytes() : 0;
    auto add = [&](const control::Client& c) {
      if (auto conn = c.connection()) total += conn->buffered_bytes();
    };
    {
      std::lock_guard<std::mutex> lock(routers_mu_);
      for (auto& [_, c] : routers_) add(*c);
    }
    std::lock_guard<std::mutex> lock(peers_mu_);
    for (auto& [_, p] : prefill_peers_) add(*p.client);
    return total;
  }

  // Prefix-cache counters straight from the block manager (safe from any
  // thread), so a scrape sees every admission up to now.
  void RefreshCacheCounters() {
    const BlockManagerStats b = engine_->block_manager().GetStats();
    std::lock_guard<std::mutex> lock(counters_mu_);
    if (b.prefix_cache_query_tokens > last_queries_) {
      metrics_.queries.Increment(static_cast<double>(b.prefix_cache_query_tokens - last_queries_));
      last_queries_ = b.prefix_cache_query_tokens;
    }
    if (b.prefix_cache_hit_tokens > last_hits_) {
      metrics_.hits.Increment(static_cast<double>(b.prefix_cache_hit_tokens - last_hits_));
      last_hits_ = b.prefix_cache_hit_tokens;
    }
  }

  WorkerOptions opts_;
  std::unique_ptr<kernels::CpuBackend> backend_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<KvTransfer> transfer_;
  KvLayout layout_;
  std::string descriptor_;
  std::string model_id_;
  std::string control_address_;

  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  WorkerMetrics metrics_{*registry_};
  std::mutex counters_mu_;
  uint64_t last_queries_ = 0, last_hits_ = 0, last_preemptions_ = 0;

  std::unique_ptr<control::EventLoop> loop_;
  std::unique_ptr<control::Server> peer_server_;
  std::unique_ptr<http::Server> metrics_http_;
  std::vector<std::string> metrics_keys_;  // empty: /metrics is open

  std::thread engine_thread_;
  std::mutex cmd_mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  std::atomic<bool> stop_engine_{false};
  std::atomic<bool> stopped_{false};
  std::atomic<bool> draining_{false};
  std::atomic<int> busy_{0};  // decode requests + prefill jobs in flight

  // Engine-thread state.
  RequestId next_id_ = 1;
  std::unordered_map<RequestId, DecodeRequest> decode_;
  std::unordered_map<RequestId, PrefillJob> prefill_;

  // Routers.
  std::thread dns_thread_;
  std::mutex dns_mu_;
  std::condition_variable dns_cv_;
  std::mutex routers_mu_;
  std::map<std::string, std::unique_ptr<control::Client>> routers_;  // by resolved ip:port
  std::atomic<int> routers_connected_{0};
  std::mutex pub_mu_;
  std::set<ConnectionPtr> router_conns_;

  // Peers.
  std::mutex peers_mu_;
  std::map<std::string, PrefillPeer> prefill_peers_;  // by control address (decode side)
  // Each router connection's latest PrefillWorkers, by connection id.
  std::map<uint64_t, std::set<std::string>> router_prefill_views_;
  // Clients of forgotten peers, to stop once peers_mu_ is released.
  std::vector<std::unique_ptr<control::Client>> retired_clients_;
  std::unordered_map<uint64_t, DecodePeer> decode_peers_;  // by connection id (prefill side)
};

}  // namespace

StatusOr<std::unique_ptr<WorkerService>> WorkerService::Create(WorkerOptions options) {
  auto w = std::make_unique<WorkerServiceImpl>(std::move(options));
  PDSERVE_RETURN_IF_ERROR(w->Init());
  return std::unique_ptr<WorkerService>(std::move(w));
}

}  // namespace pdserve::worker
