#include "services/worker/prefill_side.h"

#include <algorithm>
#include <cstdlib>

#include "common/logging.h"
#include "common/proto/protocol.h"
#include "common/random_id.h"
#include "services/protocol/sampling.h"

namespace pdserve::worker {
namespace {

using control::ConnectionPtr;

constexpr uint32_t kDefaultPrefillDeadlineMs = 30'000;
// A peer's deadline past this is cut to it: a job holds pins and staging
// slots until its deadline, so an unbounded one would let a peer that never
// receives starve every other hand-off. The decode side's flag is bounded
// by the same limit, so an honest peer's deadline is never cut.
constexpr uint32_t kMaxPrefillDeadlineMs = WorkerOptions::kMaxPrefillTimeoutMs;
// Jobs one decode worker may have in flight here: a peer flooding Prefills
// would otherwise queue prompts until memory runs out (a decode worker
// holds no more hand-offs pending for one peer itself).
constexpr size_t kMaxJobsPerDecodePeer = 4096;

// `writes_may_land`: a write of the job failed, and bytes the network
// already took may still reach the decode worker's blocks.
proto::Envelope PrefillFailure(const std::string& rid, const std::string& why, bool retryable,
                               bool writes_may_land = false) {
  proto::Envelope env;
  auto* d = env.mutable_prefill_done();
  d->set_request_id(rid);
  d->set_ok(false);
  d->set_failure_reason(why);
  d->set_retryable(retryable);
  d->set_writes_may_land(writes_may_land);
  return env;
}

}  // namespace

// A prompt this worker prefills for a decode worker.
struct PrefillSide::Job {
  RequestId id = 0;
  std::string decode_rid;
  std::string trace_id;  // for log lines
  ConnectionPtr decode;
  PeerId transfer_peer = 0;
  // (prompt block index, layer group) -> the decode worker's block.
  std::map<std::pair<uint32_t, uint32_t>, BlockId> unsent;
  WorkerClock::time_point arrived;
  WorkerClock::time_point deadline;
  WorkerClock::time_point first_write;
  int pending_writes = 0;
  uint32_t blocks_written = 0;
  uint64_t bytes_written = 0;
  bool computed = false;      // the engine is done with it
  bool cancelled = false;     // by its decode worker (Cancel)
  bool write_failed = false;  // bytes of a failed write may still land
  std::string failure;        // first reason the job fails
  proto::Envelope done;       // the success report, filled when computed
};

PrefillSide::PrefillSide(WorkerContext* ctx) : ctx_(ctx) {}
PrefillSide::~PrefillSide() { StopHandshakes(); }

void PrefillSide::StopHandshakes() {
  {
    std::lock_guard<std::mutex> lock(handshake_mu_);
    handshakes_stopped_ = true;
    handshakes_.clear();
  }
  handshake_cv_.notify_all();
  if (handshake_thread_.joinable()) handshake_thread_.join();
}

void PrefillSide::HandshakeLoop() {
  while (true) {
    ConnectJob job;
    {
      std::unique_lock<std::mutex> lock(handshake_mu_);
      handshake_cv_.wait(lock, [this] { return handshakes_stopped_ || !handshakes_.empty(); });
      if (handshakes_stopped_) return;
      job = std::move(handshakes_.front());
      handshakes_.pop_front();
    }
    FinishConnect(job);
  }
}

void PrefillSide::FinishConnect(const ConnectJob& job) {
  const ConnectionPtr& c = job.connection;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (!decode_peers_.count(c->id())) return;  // left while it waited its turn
  }
  auto conn = ctx_->transfer->Connect(job.descriptor);
  bool live = false;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = decode_peers_.find(c->id());
    if (it != decode_peers_.end()) {
      live = true;
      it->second.connecting = false;
      if (conn.ok()) it->second.transfer_peer = conn->peer;
    }
  }
  if (!live) {  // the decode worker left meanwhile
    if (conn.ok()) ctx_->transfer->Disconnect(conn->peer);
    return;
  }
  if (!conn.ok()) {
    PDSERVE_LOG(ERROR) << "decode worker " << job.worker_id << " from " << c->remote_address()
                       << " refused: " << conn.status().message();
    proto::Envelope err;
    err.mutable_error()->set_code(proto::ToErrorCode(conn.status().code()));
    err.mutable_error()->set_message(conn.status().message());
    (void)c->Send(std::move(err));
    c->Close(conn.status().message());
    return;
  }
  proto::Envelope reply;
  auto* h = reply.mutable_transfer_hello();
  h->set_worker_id(ctx_->opts->worker_id);
  h->set_transfer_descriptor(conn->reply);
  (void)c->Send(std::move(reply));
  PDSERVE_LOG(INFO) << "decode worker " << job.worker_id << " connected for KV hand-off";
}

// ------------------------------------------------------------ handshake

void PrefillSide::OnPeerMessage(const ConnectionPtr& c, proto::Envelope& e) {
  if (e.has_transfer_hello()) return OnPeerTransferHello(c, e.transfer_hello());
  if (e.has_cancel()) {
    return Take([this, connection = c->id(), rid = e.cancel().request_id()](auto) {
      OnCancel(connection, rid);
    });
  }
  if (e.has_prefill()) {
    PeerId peer = 0;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = decode_peers_.find(c->id());
      if (it != decode_peers_.end()) peer = it->second.transfer_peer;
    }
    // (A std::function must be copyable: the Prefill goes in a shared_ptr.)
    auto p = std::make_shared<proto::Prefill>(std::move(*e.mutable_prefill()));
    Take([this, c, peer, p](WorkerClock::time_point received) {
      OnPrefill(c, peer, std::move(*p), received);
    });
  }
}

void PrefillSide::Take(std::function<void(WorkerClock::time_point)> handle) {
  static const std::chrono::milliseconds delay = [] {
    const char* v = std::getenv("PDSERVE_TEST_DECODE_LINK_DELAY_MS");
    return std::chrono::milliseconds(v ? std::atoll(v) : 0);
  }();
  const WorkerClock::time_point arrived = WorkerClock::now();
  if (delay.count() <= 0) {
    ctx_->post([handle = std::move(handle), arrived] { handle(arrived); });
    return;
  }
  ctx_->post([this, handle = std::move(handle), due = arrived + delay]() mutable {
    delayed_.emplace_back(due, std::move(handle));
  });
}

// The writer's half of the transfer handshake (pdserve.proto, TransferHello).
void PrefillSide::OnPeerTransferHello(const ConnectionPtr& c, const proto::TransferHello& hello) {
  auto refuse = [&](const Status& st) {
    PDSERVE_LOG(ERROR) << "decode worker " << hello.worker_id() << " from " << c->remote_address()
                       << " refused: " << st.message();
    proto::Envelope err;
    err.mutable_error()->set_code(proto::ToErrorCode(st.code()));
    // The message names the mismatch ("KV layout mismatch: ...").
    err.mutable_error()->set_message(st.message());
    (void)c->Send(std::move(err));
    ctx_->loop->Post([c, msg = st.message()] { c->Close(msg); });
  };
  if (hello.transfer_descriptor().empty()) {
    // Step 1: the decode worker's layout. Ours goes back only if they agree.
    if (Status st = CheckPeerLayout(*ctx_, hello); !st.ok()) return refuse(st);
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      decode_peers_[c->id()].layout_accepted = true;
    }
    (void)c->Send(LayoutHello(*ctx_));
    return;
  }
  // Step 3: the decode worker's descriptor, after the layouts agreed. We
  // write into that pool: we are the transfer's writer.
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = decode_peers_.find(c->id());
    if (it == decode_peers_.end() || !it->second.layout_accepted || it->second.transfer_peer ||
        it->second.connecting) {
      return refuse(Status::InvalidArgument(
          "transfer descriptor out of order (layout first, descriptor once)"));
    }
    it->second.connecting = true;
  }
  std::lock_guard<std::mutex> lock(handshake_mu_);
  if (handshakes_stopped_) return;
  handshakes_.push_back({c, hello.transfer_descriptor(), hello.worker_id()});
  if (!handshake_thread_.joinable()) handshake_thread_ = std::thread([this] { HandshakeLoop(); });
  handshake_cv_.notify_one();
}

void PrefillSide::OnPeerClosed(const ConnectionPtr& c) {
  PeerId peer = 0;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = decode_peers_.find(c->id());
    if (it == decode_peers_.end()) return;
    peer = it->second.transfer_peer;
    decode_peers_.erase(it);
  }
  // Pending writes to that pool end (kCancelled); jobs still computing stop.
  if (peer) ctx_->transfer->Disconnect(peer);
  ctx_->post([this, id = c->id()] { OnDecodeGone(id); });
}

// ----------------------------------------------------------------- jobs

void PrefillSide::Refuse(const ConnectionPtr& decode, const proto::Prefill& p,
                         const std::string& why, bool retryable) {
  PDSERVE_LOG(INFO) << "prefill " << (IsPlainTraceId(p.trace_id()) ? p.trace_id() : p.request_id())
                    << " refused: " << why;
  (void)decode->Send(PrefillFailure(p.request_id(), why, retryable));
  ctx_->metrics->transfer_failures.Increment();
  ctx_->metrics->CountRequest("prefill", "failed");
}

std::optional<std::pair<std::string, bool>> PrefillSide::InFlightRefusal(
    uint64_t connection_id, const std::string& rid) const {
  const auto duplicate = std::pair{"request id " + rid + " is in flight here already", false};
  size_t in_flight = 0;
  for (const auto& [_, job] : jobs_) {
    if (job->decode->id() != connection_id) continue;
    if (job->decode_rid == rid) return duplicate;
    ++in_flight;
  }
  if (compiling_.count({connection_id, rid})) return duplicate;
  for (auto it = compiling_.lower_bound({connection_id, ""});
       it != compiling_.end() && it->first.first == connection_id; ++it) {
    ++in_flight;
  }
  if (in_flight >= kMaxJobsPerDecodePeer) {
    return std::pair{std::to_string(in_flight) + " prefills of this decode worker in flight here",
                     true};
  }
  return std::nullopt;
}

void PrefillSide::OnPrefill(const ConnectionPtr& decode, PeerId peer, proto::Prefill p,
                            WorkerClock::time_point received) {
  if (!p.sampling().has_constraint()) return Start(decode, peer, std::move(p), nullptr, received);
  // Structured outputs: the first token is sampled here, under the
  // request's grammar, compiled off the engine thread. What Start checks
  // of its peer is checked first here too: a peer's compiles are its jobs.
  const std::pair<uint64_t, std::string> key{decode->id(), p.request_id()};
  if (auto refused = InFlightRefusal(decode->id(), p.request_id())) {
    return Refuse(decode, p, refused->first, refused->second);
  }
  const OutputConstraint constraint = FromProto(p.sampling()).constraint.value();
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  compiling_.emplace(key, cancelled);
  ctx_->grammars->Compile(
      constraint,
      [this, decode, peer, received, p = std::move(p)](GrammarCompiler::Result grammar) mutable {
        ctx_->post([this, decode, peer, received, p = std::move(p),
                    grammar = std::move(grammar)]() mutable {
          if (auto it = compiling_.find({decode->id(), p.request_id()}); it != compiling_.end()) {
            const bool cancelled = it->second->load();
            compiling_.erase(it);
            if (cancelled) {
              PDSERVE_LOG(INFO) << "prefill "
                                << (IsPlainTraceId(p.trace_id()) ? p.trace_id() : p.request_id())
                                << " cancelled by its decode worker while its grammar compiled";
              (void)decode->Send(PrefillFailure(p.request_id(), "cancelled", false));
              ctx_->metrics->CountRequest("prefill", "cancelled");
              return;
            }
          }
          if (!grammar.ok()) {
            PDSERVE_LOG(INFO) << "prefill "
                              << (IsPlainTraceId(p.trace_id()) ? p.trace_id() : p.request_id())
                              << " refused: constraint: " << grammar.status().message();
            (void)decode->Send(PrefillFailure(p.request_id(),
                                              "constraint: " + grammar.status().message(),
                                              /*retryable=*/false));
            ctx_->metrics->transfer_failures.Increment();
            ctx_->metrics->CountRequest("prefill", "failed");
            return;
          }
          Start(decode, peer, std::move(p), std::move(*grammar), received);
        });
      },
      cancelled);
}

void PrefillSide::Start(const ConnectionPtr& decode, PeerId peer, proto::Prefill p,
                        std::shared_ptr<const structured::CompiledGrammar> grammar,
                        WorkerClock::time_point received) {
  // Log lines carry the request's trace id (proto Generate.trace_id).
  const std::string trace_id = IsPlainTraceId(p.trace_id()) ? p.trace_id() : p.request_id();
  auto refuse = [&](const std::string& why, bool retryable) { Refuse(decode, p, why, retryable); };
  // The deadline runs from the Prefill's arrival, as the decode worker's
  // give-up does: a job that waited (an engine step, a grammar's compile)
  // past it would write into blocks the decode worker freed and may have
  // given to another request.
  const WorkerClock::time_point deadline =
      received +
      std::chrono::milliseconds(std::min(
          p.deadline_ms() ? p.deadline_ms() : kDefaultPrefillDeadlineMs, kMaxPrefillDeadlineMs));
  if (WorkerClock::now() >= deadline) return refuse("its deadline passed before it started", false);
  // (A compiled Prefill left compiling_ before it got here.)
  if (auto refused = InFlightRefusal(decode->id(), p.request_id())) {
    return refuse(refused->first, refused->second);
  }
  // A decode-only worker prefills for others only prefix copies (a hot
  // prefix it holds, or its own prompts pushed as it drains), whose prompt
  // it has mostly cached.
  if (ctx_->opts->role == Role::kDecode && !p.prefix_copy()) {
    return refuse("this is a decode-only worker (it only copies prefixes)", false);
  }
  // A draining worker still computes and writes prefills: the routers send
  // it no new requests, so what comes is a hand-off that raced the drain or
  // a drain push of its hot prompts to a survivor, and Stop() waits for both.
  if (peer == 0) return refuse("no transfer handshake on this connection", false);
  auto job = std::make_unique<Job>();
  const uint32_t groups = static_cast<uint32_t>(ctx_->engine->block_manager().num_groups());
  // One write per prompt block and layer group at most: a longer list is a
  // broken or hostile peer's, refused before any of it is kept.
  const int64_t block_size = ctx_->engine->options().block_size;
  const int64_t prompt_blocks =
      (static_cast<int64_t>(p.prompt_token_ids_size()) + block_size - 1) / block_size;
  if (static_cast<int64_t>(p.blocks_size()) > prompt_blocks * static_cast<int64_t>(groups)) {
    return refuse(std::to_string(p.blocks_size()) + " block writes for a prompt of " +
                      std::to_string(prompt_blocks) + " blocks in " + std::to_string(groups) +
                      " layer group(s)",
                  false);
  }
  for (const auto& w : p.blocks()) {
    if (w.kv_group() >= groups) {
      return refuse("prompt block " + std::to_string(w.prompt_block_index()) + " of layer group " +
                        std::to_string(w.kv_group()) + ", which this model does not have",
                    false);
    }
    if (!job->unsent.emplace(std::pair{w.prompt_block_index(), w.kv_group()}, w.remote_block_id())
             .second) {
      return refuse("prompt block " + std::to_string(w.prompt_block_index()) + " listed twice",
                    false);
    }
  }
  EngineRequest req;
  req.id = ctx_->next_id++;
  req.prompt.assign(p.prompt_token_ids().begin(), p.prompt_token_ids().end());
  req.params = FromProto(p.sampling());
  req.priority = p.priority();
  req.params.max_tokens = 1;
  // Its one token is the first of the output: min_tokens holds EOS off it
  // (the decode worker holds the rest).
  req.params.min_tokens = std::min(req.params.min_tokens, 1);
  req.cache_salt = p.cache_salt();
  req.prefill_only = true;
  req.snapkv_dense = p.prefix_copy();  // a copy moves the blocks the receiver caches
  req.stream_kv_blocks = ctx_->opts->stream_prefill_chunks;
  req.grammar = std::move(grammar);
  const RequestId id = req.id;
  if (Status st = ctx_->engine->AddRequest(std::move(req)); !st.ok())
    return refuse(st.message(), false);
  job->id = id;
  job->decode_rid = p.request_id();
  job->trace_id = trace_id;
  job->decode = decode;
  job->transfer_peer = peer;
  job->arrived = received;
  job->deadline = deadline;
  ctx_->metrics->prefill_tokens.Increment(static_cast<double>(p.prompt_token_ids_size()));
  jobs_.emplace(id, std::move(job));
  ctx_->busy->fetch_add(1);
}

void PrefillSide::OnCancel(uint64_t connection_id, const std::string& decode_rid) {
  for (auto& [id, job] : jobs_) {
    if (job->decode->id() != connection_id || job->decode_rid != decode_rid) continue;
    // Computed: its writes are under way and end on their own.
    if (job->computed) return;
    job->cancelled = true;
    return FailJobs({id}, "cancelled by its decode worker");
  }
  // Its grammar still compiling: it is refused when that ends. (A Prefill
  // without one starts as it arrives, before any Cancel that follows it.)
  if (auto it = compiling_.find({connection_id, decode_rid}); it != compiling_.end()) {
    it->second->store(true);
  }
}

void PrefillSide::CheckDeadlines() {
  const auto now = WorkerClock::now();
  while (!delayed_.empty() && now >= delayed_.front().first) {
    auto [due, handle] = std::move(delayed_.front());
    delayed_.pop_front();
    handle(due);
  }
  std::vector<RequestId> late;
  for (auto& [id, job] : jobs_) {
    if (!job->computed && now >= job->deadline) late.push_back(id);
  }
  FailJobs(late, "its deadline passed before it was computed");
}

void PrefillSide::OnDecodeGone(uint64_t connection_id) {
  for (auto& [key, cancelled] : compiling_) {
    if (key.first == connection_id) cancelled->store(true);  // nobody to write for
  }
  std::vector<RequestId> orphans;
  for (auto& [id, job] : jobs_) {
    if (job->decode->id() == connection_id && !job->computed) orphans.push_back(id);
  }
  FailJobs(orphans, "decode worker disconnected");
}

void PrefillSide::FailComputing(const std::string& why) {
  std::vector<RequestId> computing;
  for (auto& [id, job] : jobs_) {
    if (!job->computed) computing.push_back(id);
  }
  FailJobs(computing, why);
}

void PrefillSide::FailJobs(const std::vector<RequestId>& ids, const std::string& why) {
  for (RequestId id : ids) {
    Job& job = *jobs_.at(id);
    (void)ctx_->engine->Cancel(id);
    job.computed = true;
    if (job.failure.empty()) job.failure = why;
    TryFinish(id);
  }
}

bool PrefillSide::HandleOutput(RequestOutput& out) {
  auto it = jobs_.find(out.id);
  if (it == jobs_.end()) return false;
  Job& job = *it->second;
  // Too late for its decode worker, which has given up on it or is about to:
  // the transport would refuse the write, and a refused write closes the
  // connection, failing every other hand-off on it (OnWriteDone).
  if (job.failure.empty() && WorkerClock::now() >= job.deadline) {
    job.failure = "its deadline passed before its KV was written";
  }
  if (!out.finished && !job.failure.empty()) {
    ReleasePin(out.kv_pin);
    const std::string why = job.failure;
    FailJobs({out.id}, why);  // stops computing it
    return true;
  }
  if (!out.finished) {
    // A chunk's full blocks (streamed prefill).
    if (job.failure.empty()) {
      WriteBlocks(job, out.kv_slots, out.kv_pin);
    } else {
      ReleasePin(out.kv_pin);
    }
    return true;
  }
  job.computed = true;
  if (out.new_token_ids.empty() && job.failure.empty()) job.failure = "prefill produced no token";
  // Every block asked for must be one this prefill holds.
  for (const auto& [at, remote] : job.unsent) {
    if (!job.failure.empty()) break;
    const bool held = std::any_of(
        out.kv_slots.begin(), out.kv_slots.end(),
        [&](const BlockSlot& s) { return s.index == at.first && s.group == at.second; });
    if (!held) {
      job.failure = "block index " + std::to_string(at.first) +
                    (at.second ? " of layer group " + std::to_string(at.second) : "") +
                    " beyond the prompt";
    }
  }
  if (job.failure.empty()) {
    auto* d = job.done.mutable_prefill_done();
    d->set_request_id(job.decode_rid);
    d->set_ok(true);
    d->set_first_token_id(out.new_token_ids[0]);
    if (!out.logprobs.empty()) {
      d->set_first_token_logprob(out.logprobs[0].logprob);
      for (const auto& alt : out.logprobs[0].top_logprobs) {
        d->mutable_first_token_top_logprobs()->add_token_ids(alt.token);
        d->mutable_first_token_top_logprobs()->add_logprobs(alt.logprob);
      }
    }
    d->set_cached_tokens(static_cast<uint32_t>(out.num_cached_tokens));
    d->set_snapkv_dropped_tokens(static_cast<uint32_t>(out.snapkv_dropped_tokens));
    WriteBlocks(job, out.kv_slots, out.kv_pin);
  } else {
    ReleasePin(out.kv_pin);
  }
  TryFinish(out.id);
  return true;
}

void PrefillSide::WriteBlocks(Job& job, const std::vector<BlockSlot>& kv_slots,
                              std::optional<PinId> pin) {
  std::vector<BlockCopy> copies;
  proto::Envelope announce;
  auto* w = announce.mutable_kv_write();
  w->set_request_id(job.decode_rid);
  for (const BlockSlot& slot : kv_slots) {
    auto it = job.unsent.find({static_cast<uint32_t>(slot.index), slot.group});
    if (it == job.unsent.end()) continue;  // not asked for, or sent with an earlier chunk
    copies.push_back({slot.block, it->second});
    auto* pair = w->add_pairs();
    pair->set_local_block_id(slot.block);
    pair->set_remote_block_id(it->second);
    job.unsent.erase(it);
  }
  if (copies.empty()) return ReleasePin(pin);
  // The receiver posts its Receive from this announcement, before or while
  // the bytes move.
  (void)job.decode->Send(std::move(announce));
  if (job.pending_writes++ == 0 && job.blocks_written == 0) job.first_write = WorkerClock::now();
  // A whole block, every rank's shard (and replicated heads once per
  // receiving rank that holds them).
  const uint64_t bytes = copies.size() * ctx_->transfer->BlockBytesTo(job.transfer_peer);
  job.blocks_written += static_cast<uint32_t>(copies.size());
  ctx_->transfer->Write(
      job.transfer_peer, std::move(copies), job.deadline,
      [this, id = job.id, bytes, pin](Status st) {
        ctx_->post([this, id, st, bytes, pin] { OnWriteDone(id, st, bytes, pin); });
      });
}

void PrefillSide::OnWriteDone(RequestId id, const Status& st, uint64_t bytes,
                              std::optional<PinId> pin) {
  ReleasePin(pin);
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  Job& job = *it->second;
  --job.pending_writes;
  // Tests make a write that landed report failure (a write whose deadline
  // passed while the network still held its bytes cannot be timed here).
  static const bool fail_writes = std::getenv("PDSERVE_TEST_FAIL_KV_WRITES") != nullptr;
  const Status result =
      st.ok() && fail_writes
          ? Status::DeadlineExceeded("injected fault (PDSERVE_TEST_FAIL_KV_WRITES)")
          : st;
  if (result.ok()) {
    job.bytes_written += bytes;
    ctx_->metrics->transfer_bytes.Add({{"direction", "out"}}).Increment(static_cast<double>(bytes));
  } else {
    job.write_failed = true;
    if (job.failure.empty()) {
      job.failure = "KV transfer failed: " + result.message();
      // The pair is unusable now: the decode worker reconnects and handshakes anew.
      ctx_->loop->Post([c = job.decode, why = job.failure] { c->Close(why); });
    }
  }
  TryFinish(id);
}

void PrefillSide::TryFinish(RequestId id) {
  Job& job = *jobs_.at(id);
  if (!job.computed || job.pending_writes > 0) return;
  const auto now = WorkerClock::now();
  if (job.failure.empty()) {
    auto* d = job.done.mutable_prefill_done();
    d->set_blocks_written(job.blocks_written);
    d->set_bytes_written(job.bytes_written);
    (void)job.decode->Send(std::move(job.done));
    if (job.blocks_written > 0)
      ctx_->metrics->transfer_seconds.Observe(Seconds(now - job.first_write));
    ctx_->metrics->CountRequest("prefill", "ok");
    PDSERVE_LOG(INFO) << "prefill " << job.trace_id << " done: " << job.blocks_written
                      << " blocks (" << job.bytes_written << " bytes) written, "
                      << Seconds(now - job.arrived) << "s";
  } else if (job.cancelled) {
    (void)job.decode->Send(PrefillFailure(job.decode_rid, job.failure, false, job.write_failed));
    ctx_->metrics->CountRequest("prefill", "cancelled");
    PDSERVE_LOG(INFO) << "prefill " << job.trace_id << " cancelled by its decode worker after "
                      << Seconds(now - job.arrived) << "s";
  } else {
    (void)job.decode->Send(PrefillFailure(job.decode_rid, job.failure, true, job.write_failed));
    ctx_->metrics->transfer_failures.Increment();
    ctx_->metrics->CountRequest("prefill", "failed");
    PDSERVE_LOG(WARN) << "prefill " << job.trace_id << " failed: " << job.failure;
  }
  jobs_.erase(id);
  ctx_->busy->fetch_sub(1);
}

void PrefillSide::ReleasePin(std::optional<PinId> pin) {
  if (pin) (void)ctx_->engine->ReleaseKvBlocks(*pin);
}

void PrefillSide::CancelAll() {
  for (auto& [id, job] : jobs_) {
    if (!job->computed) (void)ctx_->engine->Cancel(id);
  }
  // Pins held by writes still pending go with the engine; the transport is
  // destroyed after the engine thread, which cancels those writes.
  jobs_.clear();
}

}  // namespace pdserve::worker
