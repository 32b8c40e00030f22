#include "services/worker/worker_service.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "common/block_hash.h"
#include "common/http/bearer_auth.h"
#include "common/http/http_server.h"
#include "common/logging.h"
#include "common/model_id.h"
#include "common/proto/pdserve.pb.h"
#include "common/proto/protocol.h"
#include "common/tokenizer/tokenizer.h"
#include "engine/engine.h"
#include "engine/model.h"
#include "engine/model_config.h"
#include "engine/model_fingerprint.h"
#include "engine/model_group.h"
#include "services/protocol/kv_events.h"
#include "services/worker/decode_side.h"
#include "services/worker/host_port.h"
#include "services/worker/prefill_side.h"
#include "services/worker/worker_context.h"
#include "transport/control/connection.h"
#include "transport/ranked_transfer.h"

namespace pdserve::worker {

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

proto::Envelope LayoutHello(const WorkerContext& ctx) {
  proto::Envelope e;
  auto* h = e.mutable_transfer_hello();
  h->set_worker_id(ctx.opts->worker_id);
  h->set_backend(std::string(ctx.transfer->backend()));
  h->set_kv_layout(ctx.layout->Encode());
  h->set_layout_hash(ctx.layout->Hash());
  return e;
}

Status CheckPeerLayout(const WorkerContext& ctx, const proto::TransferHello& hello) {
  auto peer_layout = KvLayout::Decode(hello.kv_layout());
  if (!peer_layout.ok())
    return Status::InvalidArgument("bad KV layout from peer: " + peer_layout.status().message());
  // Workers of other tensor-parallel sizes exchange blocks head range by
  // head range (transport/ranked_transfer.h); all else must match.
  return CheckLayoutsMatchExceptSplit(*ctx.layout, *peer_layout);
}

namespace {

using control::ConnectionPtr;
using Clock = WorkerClock;

// The device index of a resolved "cuda:N" (0 for anything else).
int CudaIndex(const std::string& device) {
  return device.rfind("cuda:", 0) == 0 ? std::atoi(device.c_str() + 5) : 0;
}

class WorkerServiceImpl : public WorkerService {
 public:
  explicit WorkerServiceImpl(WorkerOptions o) : opts_(std::move(o)) {}

  ~WorkerServiceImpl() override { Stop(); }

  Status Init() {
    auto metrics_keys = http::ReloadingKeys::LoadFlag("--metrics-key-file", opts_.metrics_key_file);
    if (!metrics_keys.ok()) return metrics_keys.status();
    metrics_keys_ = std::move(*metrics_keys);
    // /metrics (and /live, /health saying "loading the model", 503) from
    // the start: loading a large model takes minutes, and a process that
    // answers nothing meanwhile looks down to Prometheus (its "down" alerts
    // fired on every rollout).
    if (opts_.metrics_port >= 0) {
      http::ServerOptions ho;
      ho.host = opts_.host;
      ho.port = opts_.metrics_port;
      ho.threads = 1;
      metrics_http_ = std::make_unique<http::Server>(
          ho, [this](const http::Request& r, std::shared_ptr<http::Exchange> ex) {
            if (r.path == "/metrics" && loaded_) RefreshCacheCounters();
            if (!metrics::ServeStandardEndpoints(
                    r, *ex, *registry_, [this] { return Health(); },
                    *http::ReloadingKeys::CurrentOf(metrics_keys_))) {
              ex->Reply(
                  http::ErrorResponse(404, "only /metrics, /health and /live are served here"));
            }
          });
      PDSERVE_RETURN_IF_ERROR(metrics_http_->Start());
    }
    if (opts_.worker_id.empty()) {
      char host[256] = {0};
      gethostname(host, sizeof(host) - 1);
      opts_.worker_id =
          std::string(RoleName(opts_.role)) + "-" + host + "-" + std::to_string(getpid());
    }
    // The ranks' devices: --devices, else --tensor-parallel of --device.
    auto devices = ResolveRankDevices(opts_.device, opts_.devices, opts_.tensor_parallel);
    if (!devices.ok()) return devices.status();
    auto group = LoadModelGroup(opts_.model_dir, *devices, opts_.threads, opts_.load_format,
                                opts_.kv_eviction, opts_.expert_parallel,
                                [this](double s) { metrics_.all_reduce_seconds.Observe(s); });
    if (!group.ok()) return group.status();
    group_ = std::move(*group);
    model_ = group_->models[0].get();
    model_id_ = ServedModelId(opts_.model_dir, model_->config().name_or_path, opts_.model_id);
    auto tok = Tokenizer::Load(opts_.model_dir);
    if (!tok.ok()) return tok.status();
    tokenizer_ = std::move(*tok);
    EngineOptions eo;
    eo.model_id = model_id_;  // seeds the block hashes: must be the id the router hashes with
    eo.block_size = opts_.block_size;
    eo.kv_cache_bytes = opts_.kv_cache_bytes;
    eo.kv_host_cache_bytes = opts_.kv_host_cache_bytes;
    eo.kv_disk_cache_dir = opts_.kv_disk_cache_dir;
    eo.kv_disk_cache_bytes = opts_.kv_disk_cache_bytes;
    eo.kv_disk_write = opts_.kv_disk_write;
    eo.kv_disk_write_queue_blocks = opts_.kv_disk_write_queue_blocks;
    eo.kv_disk_write_bytes_per_second = opts_.kv_disk_write_bytes_per_second;
    // Other weights of the same name and shapes must never meet this
    // worker's KV: the fingerprint keys its disk tier and its transfers.
    auto fingerprint = ModelFingerprint(opts_.model_dir, opts_.load_format);
    if (!fingerprint.ok()) return fingerprint.status();
    eo.model_fingerprint = *fingerprint;
    // Blocks a request waits for came back from a tier: step again now.
    eo.on_tier_ready = [this] {
      { std::lock_guard<std::mutex> lock(cmd_mu_); }
      cv_.notify_all();
    };
    eo.kv_dtype = opts_.kv_dtype;
    eo.kv_scales = opts_.kv_scales;
    eo.max_num_seqs = opts_.max_num_seqs;
    eo.max_num_batched_tokens = opts_.max_num_batched_tokens;
    eo.graphs = opts_.cuda_graphs ? GraphMode::kAuto : GraphMode::kOff;
    eo.record_kv_events = true;
    auto engine = Engine::Create(group_->shards(), eo, tokenizer_.get());
    if (!engine.ok()) return engine.status();
    engine_ = std::move(*engine);
    // Fixed for the engine's life; read by the control thread at Register.
    host_tier_blocks_ = engine_->GetStats().tiers.store.host.capacity_blocks;
    disk_tier_blocks_ = engine_->GetStats().tiers.store.disk.capacity_blocks;

    const KvCachePool& pool = engine_->kv_pool();
    metrics_.capacity.Add({{"kv_dtype", std::string(DTypeName(opts_.kv_dtype))}})
        .Set(static_cast<double>(engine_->ContextCapacityTokens()));
    // Every rank's pool shard has the same blocks of the same size
    // (Engine::Create checks the count; the heads split evenly).
    metrics_.tensor_parallel_size.Set(group_->size());
    for (int r = 0; r < group_->size(); ++r) {
      metrics_.rank_kv_bytes.Add({{"rank", std::to_string(r)}})
          .Set(static_cast<double>(pool.total_bytes()));
      metrics_.rank_kv_usage.Add({{"rank", std::to_string(r)}});
    }
    // The KV transport: one backend transfer per rank, each with its rank's
    // pool shard; rank r's shard of a block goes to the peer's rank r.
    std::vector<std::unique_ptr<KvTransfer>> rank_transfers;
    for (int r = 0; r < group_->size(); ++r) {
      KvTransferOptions to;
      to.kind = opts_.kv_transfer;
      to.pool_memory = pool.memory_type();
      to.cuda_device = CudaIndex((*devices)[static_cast<size_t>(r)]);
      to.staging = opts_.kv_staging;
      to.staging_bytes = static_cast<size_t>(opts_.kv_staging_bytes);
      to.tls = opts_.transfer_tls;
      to.name =
          group_->size() == 1 ? opts_.worker_id : opts_.worker_id + "-rank" + std::to_string(r);
      auto transfer = CreateKvTransfer(to);
      if (!transfer.ok()) return transfer.status();
      rank_transfers.push_back(std::move(*transfer));
    }
    layout_ = pool.TransferLayout(model_id_, model_->matrix_dtype(),
                                  std::string(rank_transfers[0]->backend()));
    layout_.model_fingerprint = engine_->kv_fingerprint();
    layout_.tensor_parallel = group_->size();
    // The model's KV heads, all ranks together: a rank's layout holds its share.
    // (MLA's one latent is on every rank: one head, replicated.)
    int64_t kv_heads = layout_.kv_heads;
    if (group_->size() > 1 && layout_.attention == KvAttention::kGqa) {
      auto config = LoadModelConfig(opts_.model_dir);
      if (!config.ok()) return config.status();
      kv_heads = config->num_kv_heads;
    }
    auto ranked = RankedKvTransfer::Create(std::move(rank_transfers), kv_heads);
    if (!ranked.ok()) return ranked.status();
    for (int r = 0; r < group_->size(); ++r) {
      const KvCachePool& shard = engine_->kv_pool(r);
      MemoryRegion region{shard.base(), static_cast<size_t>(shard.total_bytes()),
                          static_cast<size_t>(shard.bytes_per_block()), shard.memory_type()};
      PDSERVE_RETURN_IF_ERROR((*ranked)->RegisterRankPool(r, region, layout_));
    }
    transfer_ = std::move(*ranked);
    for (const std::string& d : *devices) device_ += (device_.empty() ? "" : ",") + d;

    // Structured outputs: the vocabulary as bytes, and the compiler thread.
    grammars_ = std::make_unique<GrammarCompiler>(
        structured::Vocabulary::FromTokenizer(*tokenizer_, model_->config().eos_token_ids),
        opts_.structured, &metrics_);
    ctx_.grammars = grammars_.get();
    ctx_.opts = &opts_;
    ctx_.engine = engine_.get();
    ctx_.transfer = transfer_.get();
    ctx_.layout = &layout_;
    ctx_.metrics = &metrics_;
    ctx_.control = ControlOptions();
    ctx_.post = [this](std::function<void()> fn) { Post(std::move(fn)); };
    ctx_.busy = &busy_;
    ctx_.draining = &draining_;
    loaded_ = true;
    return Status::Ok();
  }

  Status Start() override {
    loop_ = std::make_unique<control::EventLoop>("worker-control", 1);
    ctx_.loop = loop_.get();
    // Peer server: decode workers connect here to hand us prefills.
    const control::ConnectionOptions co = ControlOptions();
    control::ConnectionHandlers peer_handlers;
    peer_handlers.on_message = [this](const ConnectionPtr& c, proto::Envelope& e) {
      prefill_.OnPeerMessage(c, e);
    };
    peer_handlers.on_close = [this](const ConnectionPtr& c, const Status&) {
      prefill_.OnPeerClosed(c);
    };
    control::ServerLimits limits;
    limits.on_refused = [this](const char* reason) {
      metrics_.control_refused.Add({{"reason", reason}}).Increment();
    };
    peer_server_ =
        std::make_unique<control::Server>(loop_.get(), co, peer_handlers, std::move(limits));
    PDSERVE_RETURN_IF_ERROR(peer_server_->Listen(opts_.host, static_cast<uint16_t>(opts_.port)));
    control_address_ = (opts_.advertise_host.empty() ? "127.0.0.1" : opts_.advertise_host) + ":" +
                       std::to_string(peer_server_->port());

    engine_thread_ = std::thread([this] { EngineLoop(); });
    dns_thread_ = std::thread([this] { DnsLoop(); });
    PDSERVE_LOG(INFO) << "worker " << opts_.worker_id << " (" << RoleName(opts_.role)
                      << ") serving model '" << model_id_
                      << "': " << engine_->kv_pool().num_blocks() << " KV blocks of "
                      << opts_.block_size << " tokens (" << DTypeName(opts_.kv_dtype)
                      << "), peers at " << control_address_ << ", metrics :" << metrics_port()
                      << ", device " << device_ << ", KV layout " << layout_.ToString();
    return Status::Ok();
  }

  void Stop() override {
    if (stopped_.exchange(true)) return;
    if (!engine_thread_.joinable()) {  // never started (Init failed, or no Start)
      if (metrics_http_) metrics_http_->Stop();
      return;
    }
    // Drain: tell the routers, finish what runs, then leave.
    draining_ = true;
    ForEachRouter([](control::Client& c) {
      proto::Envelope e;
      e.mutable_goodbye()->set_reason("worker draining");
      e.mutable_goodbye()->set_drain(true);
      (void)c.Send(std::move(e));
    });
    const auto give_up = Clock::now() + std::chrono::milliseconds(opts_.drain_timeout_ms);
    // Every role lingers: a decode-only worker too may be asked for prefix
    // copies (its hot prompts pushed to survivors) right after its goodbye.
    const auto linger_until = Clock::now() + std::chrono::milliseconds(opts_.drain_linger_ms);
    while (Clock::now() < give_up && (busy_.load() > 0 || Clock::now() < linger_until))
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (busy_.load() > 0)
      PDSERVE_LOG(WARN) << "worker: drain timeout; cancelling " << busy_.load() << " request(s)";
    stop_engine_ = true;
    cv_.notify_all();
    engine_thread_.join();
    FlushTiers();
    dns_cv_.notify_all();
    if (dns_thread_.joinable()) dns_thread_.join();
    // Clients are stopped outside the locks: Stop() waits for their close
    // callbacks, which take these same locks on the loop thread.
    std::map<std::string, std::unique_ptr<control::Client>> routers;
    {
      std::lock_guard<std::mutex> lock(routers_mu_);
      routers.swap(routers_);
    }
    for (auto& [_, c] : routers) c->Stop("worker stopping");
    decode_.StopClients("worker stopping");
    if (peer_server_) peer_server_->Stop("worker stopping");
    peer_server_.reset();
    if (metrics_http_) metrics_http_->Stop();
    prefill_.StopHandshakes();  // a Connect under way uses the transfer and the loop
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
    // Not live either: the startup probe reads /live, and its failures are
    // what bounds a load that hangs. /metrics answers meanwhile.
    if (!loaded_) return {false, "loading the model", /*live=*/false};
    if (stopped_) return {false, "stopping"};
    if (routers_connected_.load() == 0) return {false, "no router connection"};
    if (const int64_t started = step_started_ns_.load();
        started != 0 && opts_.engine_stall_timeout_ms > 0) {
      const auto running =
          WorkerClock::now() - WorkerClock::time_point(WorkerClock::duration(started));
      if (running > std::chrono::milliseconds(opts_.engine_stall_timeout_ms)) {
        return {
            false,
            "an engine step has run for " +
                std::to_string(std::chrono::duration_cast<std::chrono::seconds>(running).count()) +
                " s",
            /*live=*/false};
      }
    }
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
      // A DNS blip keeps every connection (or one would cut every worker
      // off every router at once): only an answer drops an address.
      const std::set<std::string> want = RouterAddresses(opts_.routers, ResolveIp, &resolved_);
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
    r->set_host_tier_capacity_blocks(static_cast<uint64_t>(host_tier_blocks_));
    r->set_disk_tier_capacity_blocks(static_cast<uint64_t>(disk_tier_blocks_));
    r->set_transfer_backend(std::string(transfer_->backend()));
    r->set_layout_hash(layout_.Hash());
    r->set_control_address(control_address_);
    r->set_metrics_port(static_cast<uint32_t>(std::max(0, metrics_port())));
    r->set_max_model_len(static_cast<uint64_t>(engine_->max_model_len()));
    // The KV layer groups, when the model has windows (the router predicts
    // prefixes by them).
    if (const auto& groups = engine_->kv_pool().groups();
        groups.size() > 1 || groups.any_windowed()) {
      for (int64_t w : groups.windows) r->add_kv_group_windows(static_cast<uint32_t>(w));
      r->set_kv_sink_tokens(static_cast<uint32_t>(groups.sink_tokens));
    }
    if (opts_.kv_eviction.mode == KvEviction::Mode::kSnapKv) {
      r->set_kv_snapkv_budget_tokens(static_cast<uint32_t>(opts_.kv_eviction.budget_tokens));
      r->set_kv_snapkv_observation_window(
          static_cast<uint32_t>(opts_.kv_eviction.observation_window));
    }
    r->set_structured_outputs(true);
    r->set_parallel_sampling(true);
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
          decode_.OnGenerate(c, std::move(g));
        });
        return;
      case proto::Envelope::kCancel:
        Post([this, c, rid = e.cancel().request_id()] { decode_.OnRouterCancel(c, rid); });
        return;
      case proto::Envelope::kResync:
        Post([this, c] { SendSnapshot(c); });
        return;
      case proto::Envelope::kPrefillWorkers:
        if (opts_.role != Role::kPrefill) decode_.OnPrefillWorkers(c, e.prefill_workers());
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
    if (opts_.role != Role::kPrefill) decode_.ForgetRouterView(c);
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
      decode_.OnRouterGone(c);
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
        // A stalled step (EngineStats::num_stalled_steps) waits like an idle
        // loop: what unblocks it arrives as a command (a remote prefill's
        // completion, a cancel) or at a deadline checked each turn.
        if (commands_.empty() && (!HasRunnableWork() || last_step_stalled_) && !stop_engine_) {
          cv_.wait_for(lock, std::chrono::milliseconds(20));
        }
        cmds.swap(commands_);
      }
      for (auto& fn : cmds) fn();
      if (stop_engine_) break;
      decode_.CheckDeadlines();
      prefill_.CheckDeadlines();
      last_step_stalled_ = false;
      if (HasRunnableWork()) {
        const uint64_t stalled_before = engine_->num_stalled_steps();
        step_started_ns_ = WorkerClock::now().time_since_epoch().count();
        if (test_step_delay_ms_ > 0) {  // tests: a step that hangs for a while
          std::this_thread::sleep_for(std::chrono::milliseconds(test_step_delay_ms_));
        }
        auto outputs = engine_->Step();
        step_started_ns_ = 0;
        last_step_stalled_ = engine_->num_stalled_steps() != stalled_before;
        if (!outputs.ok() && engine_->ranks_failed()) {
          // A tensor-parallel rank failed and the group is aborted: the
          // worker goes down as a whole, and the routers fail its requests
          // over as a dead worker's.
          PDSERVE_LOG(ERROR) << "worker " << opts_.worker_id << ": " << outputs.status().message()
                             << "; exiting";
          std::fflush(stderr);
          std::_Exit(1);
        }
        if (!outputs.ok()) {
          // The next step would most likely fail the same way and the
          // requests would never answer: every request the engine schedules
          // fails now (the router retries elsewhere those with no token out;
          // a prefill job's decode worker prefills locally).
          PDSERVE_LOG(ERROR) << "engine step failed: " << outputs.status().message()
                             << "; failing the requests it holds";
          const Status failed =
              Status::Internal("engine step failed: " + outputs.status().message());
          decode_.FailComputing(failed);
          prefill_.FailComputing(failed.message());
        } else {
          for (auto& out : *outputs) {
            if (!prefill_.HandleOutput(out)) decode_.HandleOutput(out);
          }
        }
      } else {
        // The tiers' threads go on after the last step (offloads landing,
        // write-through copies, disk evictions): their changes go out now.
        engine_->RecordTierChanges();
      }
      PublishEvents();
      if (Clock::now() >= next_load) {
        SendLoad();
        next_load = Clock::now() + std::chrono::milliseconds(opts_.load_interval_ms);
      }
    }
    // Shutdown: cancel whatever is left so no block stays held.
    decode_.CancelAll("worker stopping");
    prefill_.CancelAll();
  }

  // After the drain, with the engine thread gone: what the device pool and
  // the host tier hold goes to disk, for a warm restart.
  void FlushTiers() {
    if (opts_.kv_disk_cache_dir.empty()) return;
    const auto start = Clock::now();
    auto flushed =
        engine_->FlushTiersToDisk(std::chrono::steady_clock::now() +
                                  std::chrono::milliseconds(opts_.kv_disk_flush_timeout_ms));
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    if (!flushed.ok()) {
      PDSERVE_LOG(WARN) << "worker: KV tiers: flush to disk failed after " << seconds
                        << " s: " << flushed.status().message();
      return;
    }
    PDSERVE_LOG(INFO) << "worker: KV tiers: " << flushed->evicted << " device blocks handed down, "
                      << flushed->written << " blocks written to disk in " << seconds << " s"
                      << (flushed->left > 0 ? ", " + std::to_string(flushed->left) +
                                                  " left unwritten (--kv-disk-flush-timeout)"
                                            : std::string());
  }

  // Requests parked for lower-tier blocks do not count: the tier thread
  // wakes the loop when they are back (on_tier_ready). One onload done is
  // enough to step: its request must not wait for another's disk read.
  bool HasRunnableWork() const {
    const auto s = engine_->GetStats();
    return s.num_running - s.num_loading + s.num_waiting > 0 ||
           (s.tiers.enabled && s.num_loading > 0 &&
            (s.tiers.onloads_in_flight == 0 || s.tiers.onloads_ready > 0));
  }

  // ------------------------------------------------------ events and load
  void PublishEvents() {
    auto batches = engine_->block_manager().DrainEvents();
    std::lock_guard<std::mutex> lock(pub_mu_);
    if (batches.empty() || router_conns_.empty()) return;
    for (const auto& b : batches) {
      proto::Envelope env;
      ToProto(b, env.mutable_kv_events());
      for (const auto& c : router_conns_) (void)c->Send(env);
    }
  }

  void SendSnapshot(const ConnectionPtr& c) {
    PublishEvents();  // everything up to now goes out first, so the snapshot follows it
    KvCacheSnapshot snap = engine_->block_manager().Snapshot();
    // Chunks of at most kChunk hashes: the device pool's, then the host
    // tier's, then the disk tier's, each into its own field.
    constexpr size_t kChunk = 64 * 1024;
    const std::vector<BlockHash>* tiers[] = {&snap.block_hashes, &snap.host_block_hashes,
                                             &snap.disk_block_hashes};
    size_t tier = 0, i = 0;
    uint32_t chunk = 0;
    bool last = false;
    while (!last) {
      proto::Envelope env;
      auto* s = env.mutable_kv_snapshot();
      s->set_sequence(snap.last_sequence_number);
      s->set_chunk_index(chunk++);
      for (size_t room = kChunk; room > 0 && tier < 3;) {
        const std::vector<BlockHash>& hashes = *tiers[tier];
        auto* field = tier == 0   ? s->mutable_block_hashes()
                      : tier == 1 ? s->mutable_host_block_hashes()
                                  : s->mutable_disk_block_hashes();
        const size_t n = std::min(room, hashes.size() - i);
        field->Add(hashes.begin() + static_cast<ptrdiff_t>(i),
                   hashes.begin() + static_cast<ptrdiff_t>(i + n));
        i += n;
        room -= n;
        if (i == hashes.size()) {
          ++tier;
          i = 0;
        }
      }
      last = tier == 3;
      s->set_last_chunk(last);
      (void)c->Send(std::move(env));
    }
  }

  void SendLoad() {
    const EngineStats s = engine_->GetStats();
    proto::Envelope env;
    auto* l = env.mutable_load();
    l->set_queued_prefill_tokens(static_cast<uint64_t>(s.queued_prefill_tokens));
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
    const KvTransferStats ts = transfer_->stats();
    metrics_.staging_bytes_in_use.Set(static_cast<double>(ts.staging_bytes_in_use));
    metrics_.staging_bytes_reserved.Set(static_cast<double>(ts.staging_bytes_reserved));
    metrics_.transfer_network_writes.Increment(
        static_cast<double>(ts.network_writes - reported_network_writes_));
    reported_network_writes_ = ts.network_writes;
    metrics_.blocks_held_for_peers.Set(static_cast<double>(decode_.HeldBlocks()));
    metrics_.usage.Set(s.blocks.usage_ratio);
    for (int r = 0; r < group_->size(); ++r)
      metrics_.rank_kv_usage.Add({{"rank", std::to_string(r)}}).Set(s.blocks.usage_ratio);
    metrics_.running.Set(static_cast<double>(s.num_running));
    metrics_.waiting.Set(static_cast<double>(s.num_waiting + s.num_remote_waiting));
    RefreshCacheCounters();
    if (s.tiers.enabled) RefreshTierMetrics(s.tiers);
    std::lock_guard<std::mutex> lock(counters_mu_);
    if (s.num_preemptions > last_preemptions_) {
      metrics_.preemptions.Increment(static_cast<double>(s.num_preemptions - last_preemptions_));
    }
    last_preemptions_ = s.num_preemptions;
    if (s.snapkv_evicted_tokens > last_snapkv_evicted_) {
      metrics_.evicted_tokens.Add({{"mode", "snapkv"}})
          .Increment(static_cast<double>(s.snapkv_evicted_tokens - last_snapkv_evicted_));
      last_snapkv_evicted_ = s.snapkv_evicted_tokens;
    }
    if (const uint64_t released = s.blocks.released_out_of_reach_blocks_total;
        released > last_released_ && opts_.kv_eviction.mode != KvEviction::Mode::kSnapKv) {
      const char* mode =
          opts_.kv_eviction.mode == KvEviction::Mode::kStreaming ? "streaming" : "window";
      metrics_.evicted_tokens.Add({{"mode", mode}})
          .Increment(static_cast<double>((released - last_released_) * opts_.block_size));
      last_released_ = released;
    }
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
    return total + decode_.ControlBufferedBytes();
  }

  // Prefix-cache counters straight from the block manager (safe from any
  // thread), so a scrape sees every admission up to now.
  // Engine thread (it takes the engine's onload records).
  void RefreshTierMetrics(const EngineTierStats& t) {
    const struct {
      const char* name;
      const KvTierStats::Tier& tier;
      int64_t hit_tokens;
      LastTier& last;
    } tiers[] = {{"host", t.store.host, t.host_hit_tokens, last_host_},
                 {"disk", t.store.disk, t.disk_hit_tokens, last_disk_}};
    for (const auto& x : tiers) {
      if (x.tier.capacity_blocks == 0) continue;
      const prometheus::Labels label = {{"tier", x.name}};
      metrics_.tier_blocks.Add(label).Set(static_cast<double>(x.tier.blocks));
      metrics_.tier_capacity.Add(label).Set(static_cast<double>(x.tier.capacity_blocks));
      // From the first refresh on, as the counters: rate() and quantiles
      // over it are defined before the first onload.
      metrics_.tier_onload_seconds.Add(label, metrics::KvTransferBuckets());
      auto bump = [&](prometheus::Family<prometheus::Counter>& f, int64_t now, int64_t& last) {
        f.Add(label).Increment(static_cast<double>(std::max<int64_t>(0, now - last)));
        last = std::max(last, now);
      };
      bump(metrics_.tier_hit_tokens, x.hit_tokens, x.last.hit_tokens);
      bump(metrics_.tier_offload_bytes, x.tier.bytes_written, x.last.written);
      bump(metrics_.tier_onload_bytes, x.tier.bytes_read, x.last.read);
    }
    if (t.store.corrupt_dropped > last_corrupt_) {
      metrics_.tier_corrupt.Increment(static_cast<double>(t.store.corrupt_dropped - last_corrupt_));
      last_corrupt_ = t.store.corrupt_dropped;
    }
    if (t.store.disk.capacity_blocks > 0) {
      auto bump = [](prometheus::Counter& c, int64_t now, int64_t& last) {
        c.Increment(static_cast<double>(std::max<int64_t>(0, now - last)));
        last = std::max(last, now);
      };
      metrics_.disk_write_queue.Set(static_cast<double>(t.store.write_queue_blocks));
      bump(metrics_.disk_writes.Add({{"cause", "through"}}), t.store.disk_writes_through,
           last_disk_writes_.through);
      bump(metrics_.disk_writes.Add({{"cause", "evict"}}), t.store.disk_writes_evict,
           last_disk_writes_.evict);
      bump(metrics_.disk_writes.Add({{"cause", "flush"}}), t.store.disk_writes_flush,
           last_disk_writes_.flush);
      bump(metrics_.disk_writes_dropped, t.store.write_dropped, last_disk_writes_.dropped);
      bump(metrics_.disk_write_errors, t.store.disk_write_errors, last_disk_writes_.errors);
      bump(metrics_.disk_discarded, t.store.discarded_at_open, last_disk_writes_.discarded);
    }
    for (const TierOnload& o : engine_->TakeTierOnloads()) {
      metrics_.tier_onload_seconds
          .Add({{"tier", o.tier == KvTier::kDisk ? "disk" : "host"}}, metrics::KvTransferBuckets())
          .Observe(o.seconds);
    }
  }

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

  struct LastTier {
    int64_t hit_tokens = 0, written = 0, read = 0;
  };
  LastTier last_host_, last_disk_;  // engine thread
  struct {
    int64_t through = 0, evict = 0, flush = 0, dropped = 0, errors = 0, discarded = 0;
  } last_disk_writes_;  // engine thread
  int64_t host_tier_blocks_ = 0, disk_tier_blocks_ = 0;
  uint64_t reported_network_writes_ = 0;  // of transfer_->stats(), on the metrics
  int64_t last_corrupt_ = 0;
  WorkerOptions opts_;
  std::unique_ptr<ModelGroup> group_;  // a shard, backend and communicator per rank
  Model* model_ = nullptr;             // rank 0's shard
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<RankedKvTransfer> transfer_;
  KvLayout layout_;
  std::string device_;
  std::string model_id_;
  std::string control_address_;

  std::shared_ptr<prometheus::Registry> registry_ = std::make_shared<prometheus::Registry>();
  WorkerMetrics metrics_{*registry_};
  std::mutex counters_mu_;
  uint64_t last_queries_ = 0, last_hits_ = 0, last_preemptions_ = 0, last_released_ = 0;
  uint64_t last_snapkv_evicted_ = 0;

  std::unique_ptr<control::EventLoop> loop_;
  std::unique_ptr<control::Server> peer_server_;
  // null: /metrics is open (reread as it changes). Before the server that
  // reads it.
  std::shared_ptr<http::ReloadingKeys> metrics_keys_;
  std::unique_ptr<http::Server> metrics_http_;
  std::atomic<bool> loaded_{false};  // Init finished: the engine exists

  std::thread engine_thread_;
  std::mutex cmd_mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> commands_;
  std::atomic<bool> stop_engine_{false};
  bool last_step_stalled_ = false;  // engine thread only
  std::atomic<bool> stopped_{false};
  std::atomic<bool> draining_{false};
  std::atomic<int> busy_{0};  // decode requests + prefill jobs in flight

  // The two sides of the KV hand-off.
  WorkerContext ctx_;
  DecodeSide decode_{&ctx_};
  PrefillSide prefill_{&ctx_};

  // Routers.
  std::thread dns_thread_;
  std::mutex dns_mu_;
  std::condition_variable dns_cv_;
  // DnsLoop's own: each --router spec's addresses at its last answer.
  std::map<std::string, std::vector<std::string>> resolved_;
  std::mutex routers_mu_;
  std::map<std::string, std::unique_ptr<control::Client>> routers_;  // by resolved ip:port
  std::atomic<int> routers_connected_{0};
  // When the engine step under way began (WorkerClock ticks; 0: none runs),
  // for Health. Tests stretch each step by PDSERVE_TEST_STEP_DELAY_MS.
  std::atomic<int64_t> step_started_ns_{0};
  const int64_t test_step_delay_ms_ = [] {
    const char* v = std::getenv("PDSERVE_TEST_STEP_DELAY_MS");
    return v != nullptr ? std::atoll(v) : 0;
  }();
  std::mutex pub_mu_;
  std::set<ConnectionPtr> router_conns_;
  // Last: destroyed first, answering queued compilations (their callbacks
  // post to the engine queue, which is still there).
  std::unique_ptr<GrammarCompiler> grammars_;
};

}  // namespace

StatusOr<std::unique_ptr<WorkerService>> WorkerService::Create(WorkerOptions options) {
  auto w = std::make_unique<WorkerServiceImpl>(std::move(options));
  PDSERVE_RETURN_IF_ERROR(w->Init());
  return std::unique_ptr<WorkerService>(std::move(w));
}

}  // namespace pdserve::worker
