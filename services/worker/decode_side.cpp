#include "services/worker/decode_side.h"

#include <algorithm>
#include <optional>
#include <set>
#include <unordered_set>

#include "common/logging.h"
#include "common/random_id.h"
#include "services/protocol/sampling.h"
#include "services/worker/host_port.h"

namespace pdserve::worker {
namespace {

using control::ConnectionPtr;

// The prefill peer's transfer deadline runs from when its Prefill message
// arrives, ours from when we sent it: the margin covers that message's time
// on a live control connection (one silent for peer_timeout is closed, and
// a closed one delivers nothing more) and clock granularity.
WorkerClock::duration RemoteWriteGrace(const control::ConnectionOptions& control) {
  return control.peer_timeout + std::chrono::milliseconds(2000);
}

// Prefill messages queued for a peer whose handshake is not done yet.
constexpr size_t kMaxPendingPrefills = 4096;

// Sequences one Generate may ask for (Generate.n).
constexpr uint32_t kMaxSequences = 128;
// A router's list of prefill workers: each becomes a connection of ours, so
// a list past any real cluster, or an address past any host:port, is a
// broken or hostile router's and is ignored whole.
constexpr int kMaxPrefillWorkers = 4096;
constexpr size_t kMaxControlAddressBytes = 512;
// Prompt scores sent in one Token (services/router reassembles them).
constexpr size_t kPromptScoresPerMessage = 8192;

// What the request's log lines call it: the router's trace id (the
// client's x-request-id), or the wire id when the router sent none usable.
std::string TraceIdOf(const proto::Generate& g) {
  return IsPlainTraceId(g.trace_id()) ? g.trace_id() : g.request_id();
}

}  // namespace

// A request this worker decodes.
struct DecodeSide::Request {
  RequestId id = 0;
  // Generate.n > 1: which sequence, and the group's first (its id names the
  // group, by_router_rid_ and groups_); 0 for a single sequence.
  uint32_t index = 0;
  RequestId leader = 0;
  // Scoring alone (max_tokens 0) with n > 1: one sequence stands for all n,
  // whose answers are the same; it finishes each of them.
  uint32_t finishes = 1;
  std::string router_rid;
  std::string trace_id;  // for log lines (TraceIdOf)
  ConnectionPtr router;
  WorkerClock::time_point arrived;
  WorkerClock::time_point last_token;
  bool first_token_sent = false;
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t completion_tokens = 0;
  bool prefilled_remotely = false;

  // The remote hand-off, while `remote` holds.
  bool remote = false;
  std::string prefill_address;
  std::string prefill_rid;                  // id used with the prefill peer
  WorkerClock::time_point remote_give_up;   // transfer deadline + grace
  std::vector<BlockId> to_fill;             // reserved blocks the peer must write, in order
  int64_t snapkv_dropped_tokens = 0;        // the compression the peer must send (SnapKV)
  std::unordered_set<BlockId> unannounced;  // of to_fill, not yet in a KvWrite of the peer
  int pending_receives = 0;
  std::string failure;                     // first reason the hand-off cannot succeed
  std::optional<proto::PrefillDone> done;  // the peer's report (or a give-up standing for it)
  bool writer_settled = false;             // the peer writes no more (its report came, ...)
  bool reported = false;                   // the peer's report came
  bool cancel_after_remote = false;        // cancelled while the peer may still write
};

// Our client connection to one prefill worker.
struct DecodeSide::PrefillPeer {
  std::unique_ptr<control::Client> client;
  bool ready = false;            // transfer handshake done
  bool descriptor_sent = false;  // step 2 answered on this connection (once)
  bool forgotten = false;        // no router lists it: dropped when its connection closes
  PeerId transfer_peer = 0;
  std::deque<PendingPrefill> pending;  // Prefill messages waiting for the handshake
  std::string last_error;
};

DecodeSide::DecodeSide(WorkerContext* ctx) : ctx_(ctx) {}
DecodeSide::~DecodeSide() = default;

// ------------------------------------------------------------- requests

void DecodeSide::OnGenerate(const ConnectionPtr& router, proto::Generate g) {
  if (ctx_->draining->load()) return Refuse(router, g, Status::Unavailable("worker is draining"));
  if (ctx_->opts->role == Role::kPrefill) {
    return Refuse(
        router, g,
        Status::Unsupported("this is a prefill worker; send Generate to a decode worker"));
  }
  const std::pair<uint64_t, std::string> key{router->id(), g.request_id()};
  if (by_router_rid_.count(key) || compiling_.count(key)) {
    return Refuse(router, g, Status::InvalidArgument("duplicate request id " + g.request_id()));
  }
  if (!g.sampling().has_constraint()) return Admit(router, std::move(g), nullptr);
  // Structured outputs: the grammar first, off the engine thread; the
  // request is admitted once it is there (unless cancelled meanwhile).
  Compiling& compiling = compiling_[key];
  compiling.trace_id = TraceIdOf(g);
  const OutputConstraint constraint = FromProto(g.sampling()).constraint.value();
  ctx_->grammars->Compile(
      constraint,
      [this, router, key, g = std::move(g)](GrammarCompiler::Result grammar) mutable {
        ctx_->post([this, router, key, g = std::move(g), grammar = std::move(grammar)]() mutable {
          if (compiling_.erase(key) == 0) return;  // cancelled while compiling
          if (!grammar.ok()) {
            const Status& st = grammar.status();
            return Refuse(router, g,
                          Status(st.code() == StatusCode::kCancelled ? StatusCode::kUnavailable
                                                                     : StatusCode::kInvalidArgument,
                                 "constraint: " + st.message()));
          }
          Admit(router, std::move(g), std::move(*grammar));
        });
      },
      compiling.cancelled);
}

void DecodeSide::StopCompiling(std::map<std::pair<uint64_t, std::string>, Compiling>::iterator it) {
  it->second.cancelled->store(true);  // the compiler thread skips it if not started
  compiling_.erase(it);
}

void DecodeSide::Refuse(const ConnectionPtr& router, const proto::Generate& g, const Status& st) {
  PDSERVE_LOG(INFO) << "request " << TraceIdOf(g) << " refused: " << st.message();
  const bool retryable =
      st.code() == StatusCode::kResourceExhausted || st.code() == StatusCode::kUnavailable;
  (void)router->Send(RequestError(g.request_id(), st.code(), st.message(), retryable));
  ctx_->metrics->CountRequest("decode", "refused");
}

void DecodeSide::Admit(const ConnectionPtr& router, proto::Generate g,
                       std::shared_ptr<const structured::CompiledGrammar> grammar) {
  auto reject = [&](const Status& st) { Refuse(router, g, st); };
  const uint32_t n = std::max<uint32_t>(1, g.n());
  if (n > kMaxSequences) {
    return reject(Status::InvalidArgument("n " + std::to_string(n) + " is over " +
                                          std::to_string(kMaxSequences)));
  }
  EngineRequest req;
  req.id = ctx_->next_id++;
  req.prompt.assign(g.prompt_token_ids().begin(), g.prompt_token_ids().end());
  req.params = FromProto(g.sampling());
  // Scoring alone samples nothing: n copies would score the prompt n times
  // (and outside the prefix cache) to the same answer.
  const uint32_t finishes = req.params.max_tokens == 0 ? n : 1;
  const uint32_t sequences = n / finishes;
  req.params.seed = ResolveSeed(req.params);  // the prefill peer must sample with the same seed
  req.cache_salt = g.cache_salt();
  req.priority = g.priority();
  req.grammar = std::move(grammar);
  const EngineRequest base = req;  // n > 1: the other sequences' template
  auto r = std::make_unique<Request>();
  r->id = req.id;
  r->leader = sequences > 1 ? req.id : 0;
  r->finishes = finishes;
  r->router_rid = g.request_id();
  r->trace_id = TraceIdOf(g);
  r->router = router;
  r->arrived = WorkerClock::now();
  r->prompt_tokens = static_cast<int64_t>(req.prompt.size());

  // The router decided: a named prefill worker means remote prefill; but a
  // prompt to score is computed here, where its logits are.
  std::optional<proto::Envelope> prefill;
  bool remote = !g.prefill_address().empty() && !req.params.prompt_logprobs;
  if (remote && !ListedBy(router, g.prefill_address())) {
    // Only a worker the router listed (PrefillWorkers) is dialled: an
    // address from nowhere would start a client that reconnects forever.
    PDSERVE_LOG(WARN) << "request " << r->trace_id << ": the router named a prefill worker ("
                      << g.prefill_address().size()
                      << "-byte address) that is not on its list (never, or no longer: removed "
                         "since); prefilling here";
    remote = false;
  }
  if (remote) {
    EngineRequest copy = req;
    copy.snapkv_dense = g.prefix_copy();  // cached here, as on the holder
    auto plan = ctx_->engine->AddRemotePrefillRequest(std::move(copy));
    if (!plan.ok()) return reject(plan.status());
    r->remote = true;
    r->prefill_address = g.prefill_address();
    r->cached_tokens = plan->num_cached_tokens;
    r->snapkv_dropped_tokens = plan->snapkv_dropped_tokens;
    r->prefill_rid = NewUnguessableId();
    const int64_t timeout_ms = ctx_->opts->prefill_timeout_ms;
    r->remote_give_up = WorkerClock::now() + std::chrono::milliseconds(timeout_ms) +
                        RemoteWriteGrace(ctx_->control);
    proto::Envelope env;
    auto* p = env.mutable_prefill();
    p->set_request_id(r->prefill_rid);
    for (TokenId t : req.prompt) p->add_prompt_token_ids(t);
    ToProto(req.params, p->mutable_sampling());
    p->set_cache_salt(req.cache_salt);
    p->set_priority(req.priority);
    // Every layer group's blocks the engine reserved to be written (a
    // windowed group's only within the first decode query's reach).
    for (const BlockSlot& slot : plan->fill) {
      auto* w = p->add_blocks();
      w->set_prompt_block_index(static_cast<uint32_t>(slot.index));
      w->set_remote_block_id(slot.block);
      w->set_kv_group(slot.group);
      r->to_fill.push_back(slot.block);
      r->unannounced.insert(slot.block);
    }
    p->set_decode_worker_id(ctx_->opts->worker_id);
    p->set_prefix_copy(g.prefix_copy());
    p->set_trace_id(r->trace_id);
    p->set_deadline_ms(static_cast<uint32_t>(timeout_ms));
    prefill = std::move(env);
    by_prefill_rid_[r->prefill_rid] = r->id;
  } else if (Status st = ctx_->engine->AddRequest(std::move(req)); !st.ok()) {
    return reject(st);
  }
  ctx_->metrics->prefill_tokens.Increment(static_cast<double>(r->prompt_tokens));
  by_router_rid_[{router->id(), r->router_rid}] = r->id;
  const RequestId id = r->id;
  const std::string trace_id = r->trace_id;
  const std::string address = r->prefill_address;
  requests_.emplace(id, std::move(r));
  ctx_->busy->fetch_add(1);
  if (sequences > 1) {
    // The other sequences: the same prompt, seeds seed + i, admitted once
    // the first one's prompt KV is computed (here or by the prefill peer),
    // sharing its blocks.
    Group& group = groups_[id];
    group.sequences = sequences;
    std::vector<RequestId>& members = group.live;
    members.push_back(id);
    for (uint32_t i = 1; i < sequences; ++i) {
      EngineRequest sib = base;
      sib.id = ctx_->next_id++;
      sib.params.seed = *base.params.seed + i;
      sib.share_prompt_with = id;
      // The prompt is scored once, by the first sequence (the router gives
      // every choice its scores); the others take its KV from the cache.
      // (Scoring alone runs one sequence: no others.)
      sib.params.prompt_logprobs.reset();
      auto sr = std::make_unique<Request>();
      sr->id = sib.id;
      sr->index = i;
      sr->leader = id;
      sr->router_rid = g.request_id();
      sr->trace_id = trace_id;
      sr->router = router;
      sr->arrived = requests_.at(id)->arrived;
      sr->prompt_tokens = static_cast<int64_t>(sib.prompt.size());
      if (Status st = ctx_->engine->AddRequest(std::move(sib)); !st.ok()) {
        if (prefill) {
          // Its Prefill was never sent: no peer writes its blocks, which
          // go back now rather than when a remote request gives up.
          Request& leader = *requests_.at(id);
          leader.remote = false;
          by_prefill_rid_.erase(leader.prefill_rid);
        }
        CancelGroup(id, "a sequence could not be added: " + st.message());
        (void)router->Send(RequestError(g.request_id(), st.code(), st.message(), false));
        return;
      }
      members.push_back(sr->id);
      requests_.emplace(sr->id, std::move(sr));
      ctx_->busy->fetch_add(1);
    }
  }
  if (prefill) {
    const auto send_by = requests_.at(id)->remote_give_up - RemoteWriteGrace(ctx_->control);
    SendToPrefillPeer(address, std::move(*prefill), id, send_by);
  }
}

void DecodeSide::OnRouterCancel(const ConnectionPtr& router, const std::string& rid) {
  if (auto c = compiling_.find({router->id(), rid}); c != compiling_.end()) {
    PDSERVE_LOG(INFO) << "request " << c->second.trace_id
                      << " cancelled while its grammar compiled";
    StopCompiling(c);
    ctx_->metrics->CountRequest("decode", "cancelled");
    return;
  }
  auto it = by_router_rid_.find({router->id(), rid});
  if (it != by_router_rid_.end()) CancelGroup(it->second, "cancelled by the router");
}

void DecodeSide::CancelGroup(RequestId leader, const std::string& why) {
  auto g = groups_.find(leader);
  if (g == groups_.end()) return CancelRequest(leader, why);
  // One line for the group (its first sequence may have finished already).
  const std::vector<RequestId> members = g->second.live;
  int64_t tokens = g->second.completion_tokens;
  std::string trace_id;
  for (RequestId id : members) {
    if (auto m = requests_.find(id); m != requests_.end()) {
      tokens += m->second->completion_tokens;
      trace_id = m->second->trace_id;
    }
  }
  PDSERVE_LOG(INFO) << "request " << trace_id << " cancelled: " << why << " (n "
                    << g->second.sequences << ", " << members.size() << " sequences running) after "
                    << tokens << " tokens";
  for (RequestId id : members) CancelRequest(id, why, /*log=*/false);
}

void DecodeSide::OnRouterGone(const ConnectionPtr& router) {
  for (auto it = compiling_.lower_bound({router->id(), std::string()});
       it != compiling_.end() && it->first.first == router->id();) {
    StopCompiling(it++);
  }
  std::vector<RequestId> orphans;
  for (auto it = by_router_rid_.lower_bound({router->id(), std::string()});
       it != by_router_rid_.end() && it->first.first == router->id(); ++it) {
    orphans.push_back(it->second);
  }
  for (RequestId id : orphans) CancelGroup(id, "router connection lost");
}

void DecodeSide::CancelAll(const std::string& why) {
  while (!compiling_.empty()) StopCompiling(compiling_.begin());
  std::vector<RequestId> ids;
  for (auto& [id, _] : requests_) ids.push_back(id);
  for (RequestId id : ids) {
    // The transport is about to go away with the worker: nothing writes after it.
    if (requests_.at(id)->remote) requests_.at(id)->remote = false;
    CancelRequest(id, why);
  }
  for (auto& [rid, held] : held_for_peers_) (void)ctx_->engine->ReleaseKvBlocks(held.pin);
  held_for_peers_.clear();
  held_blocks_.store(0);
}

void DecodeSide::FailComputing(const Status& st) {
  std::vector<RequestId> ids;
  for (auto& [id, r] : requests_) {
    if (!r->remote) ids.push_back(id);
  }
  for (RequestId id : ids) {
    Request& r = *requests_.at(id);
    (void)ctx_->engine->Cancel(id);
    PDSERVE_LOG(WARN) << "request " << r.trace_id << " failed: " << st.message();
    (void)r.router->Send(RequestError(r.router_rid, st.code(), st.message(), !r.first_token_sent));
    EraseRequest(id, "failed");
  }
}

// Frees everything a request holds (deferred while a peer may write).
void DecodeSide::CancelRequest(RequestId id, const std::string& why, bool log) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request& r = *it->second;
  if (r.remote && !r.done && DropPendingPrefill(r)) {
    // Its Prefill still waited for the handshake: the peer never heard of
    // it and cannot write, so everything goes now.
    r.remote = false;
    by_prefill_rid_.erase(r.prefill_rid);
    (void)ctx_->engine->Cancel(id);
    if (log) {
      PDSERVE_LOG(INFO) << "request " << r.trace_id << " cancelled: " << why
                        << " before its prefill worker was asked";
    }
    return EraseRequest(id, "cancelled");
  }
  if (r.remote) {
    r.cancel_after_remote = true;  // released when the peer is done with its blocks
    StopPrefillPeer(r);            // which it reports at once if still computing
    if (log) {
      PDSERVE_LOG(INFO) << "request " << r.trace_id << " cancelled (" << why
                        << "); its blocks are released once the prefill peer is done with them";
    }
    return;
  }
  (void)ctx_->engine->Cancel(id);
  if (log) {
    PDSERVE_LOG(INFO) << "request " << r.trace_id << " cancelled: " << why << " after "
                      << r.completion_tokens << " tokens";
  }
  EraseRequest(id, "cancelled");
}

void DecodeSide::EraseRequest(RequestId id, const char* outcome) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return;
  Request& r = *it->second;
  if (outcome) ctx_->metrics->CountRequest("decode", outcome);
  auto g = r.leader ? groups_.find(r.leader) : groups_.end();
  if (g != groups_.end()) {
    std::erase(g->second.live, id);
    if (g->second.live.empty()) {
      groups_.erase(g);
      by_router_rid_.erase({r.router->id(), r.router_rid});
    }
  } else {
    by_router_rid_.erase({r.router->id(), r.router_rid});
  }
  if (!r.prefill_rid.empty()) by_prefill_rid_.erase(r.prefill_rid);
  requests_.erase(it);
  ctx_->busy->fetch_sub(1);
}

namespace {
void AddTopLogprobs(const SampledToken& token, proto::TopLogprobs* top) {
  for (const auto& alt : token.top_logprobs) {
    top->add_token_ids(alt.token);
    top->add_logprobs(alt.logprob);
  }
}
}  // namespace

bool DecodeSide::HandleOutput(RequestOutput& out) {
  auto it = requests_.find(out.id);
  if (it == requests_.end()) return false;
  Request& r = *it->second;
  const auto now = WorkerClock::now();
  // The prompt's scores, in order, over as many Tokens as keep each well
  // under the control plane's message limit (20 alternatives a position:
  // about 300 bytes).
  for (size_t from = 0; from < out.prompt_logprobs.size(); from += kPromptScoresPerMessage) {
    proto::Envelope env;
    auto* t = env.mutable_token();
    t->set_request_id(r.router_rid);
    t->set_index(r.index);
    const size_t to = std::min(out.prompt_logprobs.size(), from + kPromptScoresPerMessage);
    for (size_t i = from; i < to; ++i) {
      t->add_prompt_logprobs(out.prompt_logprobs[i].logprob);
      AddTopLogprobs(out.prompt_logprobs[i], t->add_prompt_top_logprobs());
    }
    (void)r.router->Send(std::move(env));
  }
  // Ended before its first token (masks allowing none, the pool outgrown):
  // its usage still counts the prefix it found cached.
  if (out.new_token_ids.empty() && out.finished && !r.first_token_sent && !r.prefilled_remotely)
    r.cached_tokens = out.num_cached_tokens;
  if (!out.new_token_ids.empty()) {
    const bool first = !r.first_token_sent;
    if (first) {
      r.first_token_sent = true;
      ctx_->metrics->ttft.Observe(Seconds(now - r.arrived));
      if (!r.prefilled_remotely) r.cached_tokens = out.num_cached_tokens;
    } else {
      const double gap =
          Seconds(now - r.last_token) / static_cast<double>(out.new_token_ids.size());
      for (size_t i = 0; i < out.new_token_ids.size(); ++i) ctx_->metrics->itl.Observe(gap);
    }
    r.last_token = now;
    r.completion_tokens += static_cast<int64_t>(out.new_token_ids.size());
    ctx_->metrics->generation_tokens.Increment(static_cast<double>(out.new_token_ids.size()));
    proto::Envelope env;
    auto* t = env.mutable_token();
    t->set_request_id(r.router_rid);
    t->set_index(r.index);
    if (first) t->set_prefilled_remotely(r.prefilled_remotely);
    for (TokenId id : out.new_token_ids) t->add_token_ids(id);
    for (const auto& lp : out.logprobs) {
      t->add_logprobs(lp.logprob);
      AddTopLogprobs(lp, t->add_top_logprobs());
    }
    t->set_text(out.text);
    (void)r.router->Send(std::move(env));
  } else if (!out.text.empty()) {
    // Text without a token: what the stop check held back, released as the
    // sequence ends without a new token (pdserve.proto, Token.text).
    proto::Envelope env;
    auto* t = env.mutable_token();
    t->set_request_id(r.router_rid);
    t->set_index(r.index);
    t->set_text(out.text);
    (void)r.router->Send(std::move(env));
  }
  if (out.finished) {
    ctx_->metrics->blocks_saved.Observe(static_cast<double>(out.kv_blocks_released));
    for (uint32_t k = 0; k < r.finishes; ++k) {
      proto::Envelope env;
      auto* f = env.mutable_finished();
      f->set_request_id(r.router_rid);
      f->set_index(r.index + k);
      f->set_reason(out.finish_reason == FinishReason::kLength ? proto::FINISH_REASON_LENGTH
                                                               : proto::FINISH_REASON_STOP);
      f->mutable_usage()->set_prompt_tokens(static_cast<uint32_t>(r.prompt_tokens));
      f->mutable_usage()->set_completion_tokens(static_cast<uint32_t>(r.completion_tokens));
      f->mutable_usage()->set_cached_tokens(static_cast<uint32_t>(r.cached_tokens));
      (void)r.router->Send(std::move(env));
    }
    LogFinished(r, out.finish_reason, now);
    EraseRequest(out.id, "ok");
  }
  return true;
}

// One line per request: a group (n > 1) logs when its last sequence ends,
// with the sequences' tokens summed.
void DecodeSide::LogFinished(const Request& r, FinishReason reason, WorkerClock::time_point now) {
  auto g = r.leader ? groups_.find(r.leader) : groups_.end();
  if (g == groups_.end()) {
    PDSERVE_LOG(INFO) << "request " << r.trace_id << " done: prompt " << r.prompt_tokens
                      << " (cached " << r.cached_tokens << "), completion " << r.completion_tokens
                      << ", " << (r.prefilled_remotely ? "remote" : "local") << " prefill, "
                      << FinishReasonName(reason) << ", " << Seconds(now - r.arrived) << "s";
    return;
  }
  Group& group = g->second;
  group.finished += 1;
  if (reason == FinishReason::kLength) group.finished_by_length += 1;
  group.completion_tokens += r.completion_tokens;
  if (r.index == 0) {
    group.cached_tokens = r.cached_tokens;
    group.prefilled_remotely = r.prefilled_remotely;
  }
  if (group.live.size() > 1) return;  // not the last one
  PDSERVE_LOG(INFO) << "request " << r.trace_id << " done: n " << group.sequences << ", prompt "
                    << r.prompt_tokens << " (cached " << group.cached_tokens << "), completion "
                    << group.completion_tokens << ", "
                    << (group.prefilled_remotely ? "remote" : "local") << " prefill, "
                    << group.finished_by_length << " length, "
                    << group.finished - group.finished_by_length << " stop, "
                    << Seconds(now - r.arrived) << "s";
}

// ------------------------------------------------------- remote hand-off

RequestId DecodeSide::FindByPrefillRid(const std::string& address, const std::string& rid) const {
  auto it = by_prefill_rid_.find(rid);
  if (it == by_prefill_rid_.end()) return 0;
  auto r = requests_.find(it->second);
  // Accepted only from the prefill worker the request was sent to.
  if (r == requests_.end() || !r->second->remote || r->second->prefill_address != address) return 0;
  return it->second;
}

void DecodeSide::OnKvWrite(const std::string& address, PeerId transfer_peer,
                           const proto::KvWrite& w) {
  const RequestId id = FindByPrefillRid(address, w.request_id());
  if (id == 0) return;
  Request& r = *requests_.at(id);
  std::vector<BlockCopy> pairs;
  for (const auto& p : w.pairs()) {
    const BlockId remote = p.remote_block_id();
    if (r.unannounced.erase(remote) == 0) {
      // Not ours to fill, or announced twice: the hand-off cannot succeed.
      // It is settled when the peer reports, closes or times out, as it may
      // still be writing.
      if (r.failure.empty()) {
        r.failure = "prefill worker announced block " + std::to_string(remote) +
                    ", which is not a block reserved for it (or announced twice)";
      }
      return;
    }
    pairs.push_back({p.local_block_id(), remote});
  }
  if (pairs.empty()) return;
  if (transfer_peer == 0) {
    // The connection closed meanwhile; its close settles the hand-off.
    if (r.failure.empty()) r.failure = "no transfer connection to the prefill worker";
    return;
  }
  ++r.pending_receives;
  ctx_->transfer->Receive(transfer_peer, std::move(pairs),
                          r.remote_give_up - RemoteWriteGrace(ctx_->control),
                          [this, id, rid = r.prefill_rid](Status st) {
                            ctx_->post([this, id, rid, st] { OnReceiveDone(id, rid, st); });
                          });
}

void DecodeSide::OnReceiveDone(RequestId id, const std::string& prefill_rid, const Status& st) {
  auto it = requests_.find(id);
  if (it == requests_.end() || it->second->prefill_rid != prefill_rid) return;
  Request& r = *it->second;
  --r.pending_receives;
  if (!st.ok() && r.failure.empty()) r.failure = "receiving KV failed: " + st.message();
  TrySettleRemote(id);
}

void DecodeSide::OnPrefillDone(const std::string& address, const proto::PrefillDone& done) {
  const RequestId id = FindByPrefillRid(address, done.request_id());
  if (id == 0) {
    // A hand-off given up on before its report: the peer writes no more.
    // A failed write's bytes may still land: those stay held to the end.
    auto held = held_for_peers_.find(done.request_id());
    if (held == held_for_peers_.end() || held->second.address != address) return;
    if (!done.writes_may_land()) return ReleaseHeldBlocks(held, "its prefill worker reported");
    HeldForPeer& h = held->second;
    h.awaiting_report = false;
    h.until = std::max(h.give_up, WorkerClock::now() + RemoteWriteGrace(ctx_->control));
    return;
  }
  Request& r = *requests_.at(id);
  if (r.writer_settled || r.reported) return;  // one report per hand-off
  r.reported = true;
  // A report settles the writer unless a failed write's bytes may still
  // land: then the blocks stay held until the give-up time.
  r.writer_settled = done.ok() || !done.writes_may_land();
  r.done = done;
  if (!done.ok() && r.failure.empty()) r.failure = "prefill failed: " + done.failure_reason();
  if (done.ok()) {
    ctx_->metrics->transfer_bytes.Add({{"direction", "in"}})
        .Increment(static_cast<double>(done.bytes_written()));
  }
  TrySettleRemote(id);
}

void DecodeSide::GiveUpRemote(RequestId id, const std::string& why) {
  auto it = requests_.find(id);
  if (it == requests_.end() || !it->second->remote) return;
  Request& r = *it->second;
  if (r.failure.empty()) r.failure = why;
  if (!r.writer_settled) StopPrefillPeer(r);
  // The peer may still be writing: FallBackToLocal holds the blocks it was
  // to fill until it cannot any more.
  if (!r.done) r.done.emplace();  // counts as a (failed) report
  TrySettleRemote(id);
}

void DecodeSide::TrySettleRemote(RequestId id) {
  Request& r = *requests_.at(id);
  if (!r.remote || !r.done || r.pending_receives > 0) return;
  if (r.failure.empty() && !r.unannounced.empty()) {
    r.failure = "prefill worker wrote " + std::to_string(r.to_fill.size() - r.unannounced.size()) +
                " of " + std::to_string(r.to_fill.size()) + " blocks";
  }
  // SnapKV: the blocks reserved hold the compressed prompt only; a peer that
  // could not compress (no blocks free) sent something else.
  if (r.failure.empty() && r.done->ok() &&
      static_cast<int64_t>(r.done->snapkv_dropped_tokens()) != r.snapkv_dropped_tokens) {
    r.failure = "prefill worker dropped " + std::to_string(r.done->snapkv_dropped_tokens()) +
                " prompt tokens (SnapKV), " + std::to_string(r.snapkv_dropped_tokens) + " expected";
  }
  if (r.failure.empty() && r.done->ok()) return CompleteRemote(id);
  FallBackToLocal(id);
}

void DecodeSide::CompleteRemote(RequestId id) {
  Request& r = *requests_.at(id);
  r.remote = false;
  r.prefilled_remotely = true;
  by_prefill_rid_.erase(r.prefill_rid);
  if (r.cancel_after_remote) {
    (void)ctx_->engine->Cancel(id);
    return EraseRequest(id, "cancelled");
  }
  if (Status st = ctx_->transfer->FinishReceive(r.to_fill); !st.ok()) {
    r.remote = true;
    r.failure = "receiving KV failed: " + st.message();
    return FallBackToLocal(id);
  }
  const proto::PrefillDone& done = *r.done;
  r.cached_tokens = std::min<int64_t>(done.cached_tokens(), r.prompt_tokens);  // the peer's word
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
  auto first = ctx_->engine->CompleteRemotePrefill(id, done.first_token_id(), sampled);
  if (!first.ok()) {
    PDSERVE_LOG(ERROR) << "request " << r.trace_id << ": " << first.status().message();
    r.remote = true;
    r.failure = first.status().message();
    return FallBackToLocal(id);
  }
  // Sent now, not with the next engine step: when this token ends the
  // request (max_tokens 1, a stop, EOS) there is no next step for it.
  HandleOutput(*first);
}

// The hand-off did not happen: prefill locally (or finish a pending cancel).
// Unless the peer reported, it may still be writing into the blocks it was
// to fill (it may not know yet that we gave up: a partition, a frozen
// process, a transfer in flight); those stay out of use until its transfer
// deadline has passed or its late report comes, and the request prefills
// into other blocks.
void DecodeSide::FallBackToLocal(RequestId id) {
  Request& r = *requests_.at(id);
  if (!r.writer_settled && DropPendingPrefill(r)) r.writer_settled = true;  // never sent
  r.remote = false;
  r.prefilled_remotely = false;
  by_prefill_rid_.erase(r.prefill_rid);
  if (!r.cancel_after_remote) ctx_->metrics->transfer_failures.Increment();
  // Held until the peer's deadline, which runs from the Prefill's arrival
  // there, cannot have passed. Its report says when; with none yet over a
  // live connection, the Prefill may still be on its way, so that time is
  // unknown: held until the report comes or the connection closes (capped
  // a deadline and a grace after the give-up, when the connection is
  // closed). A peer gone (or a failed write's bytes) leaves the give-up
  // time, or a grace from now.
  const auto now = WorkerClock::now();
  const auto grace = RemoteWriteGrace(ctx_->control);
  HeldForPeer held;
  held.give_up = r.remote_give_up;
  held.address = r.prefill_address;
  held.until = std::max(r.remote_give_up, now + grace);
  const bool hold = !r.writer_settled;
  if (hold && !r.reported && PrefillPeerConnected(r.prefill_address)) {
    held.awaiting_report = true;
    held.until = std::max(r.remote_give_up, now) +
                 std::chrono::milliseconds(ctx_->opts->prefill_timeout_ms) + grace;
  }
  auto failed = ctx_->engine->FailRemotePrefill(id, hold);
  if (failed.ok() && failed->has_value()) {
    held.pin = **failed;
    held.blocks = ctx_->engine->block_manager().PinnedBlocks(held.pin).size();
    held_blocks_.fetch_add(held.blocks);
    held_for_peers_[r.prefill_rid] = std::move(held);
  }
  if (r.cancel_after_remote) {
    (void)ctx_->engine->Cancel(id);
    return EraseRequest(id, "cancelled");
  }
  PDSERVE_LOG(WARN) << "request " << r.trace_id << ": " << r.failure << "; prefilling locally";
  if (!failed.ok()) {
    const Status& st = failed.status();
    (void)r.router->Send(RequestError(r.router_rid, st.code(), st.message(), !r.first_token_sent));
    EraseRequest(id, "failed");
  }
}

void DecodeSide::ReleaseHeldBlocks(HeldBlocksMap::iterator it, const char* why) {
  PDSERVE_LOG(INFO) << it->second.blocks << " KV block(s) held for prefill worker "
                    << it->second.address << " released: " << why;
  (void)ctx_->engine->ReleaseKvBlocks(it->second.pin);
  held_blocks_.fetch_sub(it->second.blocks);
  held_for_peers_.erase(it);
}

void DecodeSide::CheckDeadlines() {
  const auto now = WorkerClock::now();
  std::vector<RequestId> late;
  for (auto& [id, r] : requests_) {
    if (r->remote && now > r->remote_give_up) late.push_back(id);
  }
  for (RequestId id : late) GiveUpRemote(id, "prefill worker timed out");
  std::set<std::string> silent;  // peers that never reported a hand-off given up on
  for (auto it = held_for_peers_.begin(); it != held_for_peers_.end();) {
    auto next = std::next(it);
    HeldForPeer& h = it->second;
    if (now >= h.until && h.awaiting_report) {
      // Its connection is closed, which stops its writes; a grace more for
      // bytes already under way.
      silent.insert(h.address);
      h.awaiting_report = false;
      h.until = now + RemoteWriteGrace(ctx_->control);
    } else if (now >= h.until) {
      ReleaseHeldBlocks(it, "its transfer deadline has passed");
    }
    it = next;
  }
  for (const std::string& address : silent) {
    PDSERVE_LOG(ERROR) << "prefill worker " << address
                       << " never reported hand-offs given up on long ago; closing its connection";
    ClosePrefillPeer(address, "it never reported hand-offs given up on");
  }
}

void DecodeSide::StopAwaitingReportsOf(const std::string& address) {
  const auto until = WorkerClock::now() + RemoteWriteGrace(ctx_->control);
  for (auto& [rid, h] : held_for_peers_) {
    if (h.address != address || !h.awaiting_report) continue;
    h.awaiting_report = false;
    h.until = std::max(h.give_up, until);
  }
}

bool DecodeSide::PrefillPeerConnected(const std::string& address) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto it = prefill_peers_.find(address);
  return it != prefill_peers_.end() && it->second->ready;
}

void DecodeSide::ClosePrefillPeer(const std::string& address, const std::string& why) {
  ConnectionPtr connection;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = prefill_peers_.find(address);
    if (it != prefill_peers_.end() && it->second->client)
      connection = it->second->client->connection();
  }
  if (connection) connection->Close(why);
}

// Requests waiting on prefill peers that are gone (or whose connection
// closed: they write nothing more).
void DecodeSide::FallBackRequestsOf(const std::vector<std::string>& addresses,
                                    const std::string& why) {
  if (addresses.empty()) return;
  ctx_->post([this, addresses, why] {
    std::vector<RequestId> ids;
    for (auto& [id, r] : requests_) {
      if (r->remote &&
          std::find(addresses.begin(), addresses.end(), r->prefill_address) != addresses.end()) {
        ids.push_back(id);
      }
    }
    if (!ids.empty()) {
      PDSERVE_LOG(WARN) << ids.size() << " request(s) fall back to local prefill: " << why;
    }
    for (RequestId id : ids) GiveUpRemote(id, why);
  });
}

// Hand-offs whose Prefill message was dropped unsent (its peer's connection
// closed, or its handshake ended after the message's time was up): nothing
// can write into their blocks, so they fall back without holding any.
// Posted before any FallBackRequestsOf of the same event, which holds the
// blocks of those that were sent.
void DecodeSide::GiveUpUnsent(std::vector<std::string> prefill_rids, const std::string& why) {
  if (prefill_rids.empty()) return;
  ctx_->post([this, prefill_rids = std::move(prefill_rids), why] {
    for (const std::string& rid : prefill_rids) {
      auto it = by_prefill_rid_.find(rid);
      if (it == by_prefill_rid_.end()) continue;
      auto r = requests_.find(it->second);
      if (r == requests_.end() || !r->second->remote) continue;
      r->second->writer_settled = true;
      GiveUpRemote(r->first, why);
    }
  });
}

void DecodeSide::StopPrefillPeer(const Request& r) {
  proto::Envelope cancel;
  cancel.mutable_cancel()->set_request_id(r.prefill_rid);
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto peer = prefill_peers_.find(r.prefill_address);
  if (peer == prefill_peers_.end() || !peer->second->ready) return;
  (void)peer->second->client->Send(std::move(cancel));
}

bool DecodeSide::DropPendingPrefill(const Request& r) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto peer = prefill_peers_.find(r.prefill_address);
  if (peer == prefill_peers_.end()) return false;
  std::deque<PendingPrefill>& pending = peer->second->pending;
  auto it = std::find_if(pending.begin(), pending.end(), [&](const PendingPrefill& p) {
    return p.prefill.prefill().request_id() == r.prefill_rid;
  });
  if (it == pending.end()) return false;
  pending.erase(it);
  return true;
}

std::vector<std::string> DecodeSide::PrefillRids(const std::deque<PendingPrefill>& pending) {
  std::vector<std::string> rids;
  for (const PendingPrefill& p : pending) rids.push_back(p.prefill.prefill().request_id());
  return rids;
}

// ---------------------------------------------------------- prefill peers

DecodeSide::PrefillPeer& DecodeSide::EnsurePrefillPeerLocked(const std::string& address) {
  auto it = prefill_peers_.find(address);
  if (it != prefill_peers_.end()) return *it->second;
  auto [host, port] = SplitHostPort(address);
  control::ClientOptions co;
  co.connection = ctx_->control;
  co.connect_timeout = std::chrono::milliseconds(2000);
  control::ConnectionHandlers h;
  h.on_open = [this, address](const ConnectionPtr& c) { OnPrefillPeerOpen(address, c); };
  h.on_message = [this, address](const ConnectionPtr& c, proto::Envelope& e) {
    OnPrefillPeerMessage(address, c, e);
  };
  h.on_close = [this, address](const ConnectionPtr&, const Status& s) {
    OnPrefillPeerClosed(address, s);
  };
  auto peer = std::make_unique<PrefillPeer>();
  peer->client = std::make_unique<control::Client>(ctx_->loop, host, port, co, h);
  peer->client->Start();
  return *prefill_peers_.emplace(address, std::move(peer)).first->second;
}

void DecodeSide::SendToPrefillPeer(const std::string& address, proto::Envelope prefill,
                                   RequestId id, WorkerClock::time_point send_by) {
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    PrefillPeer& peer = EnsurePrefillPeerLocked(address);
    peer.forgotten = false;  // a router just named it
    if (peer.ready && peer.client->Send(prefill).ok()) return;
    if (!peer.ready && peer.pending.size() < kMaxPendingPrefills) {
      peer.pending.push_back({std::move(prefill), send_by});
      return;
    }
  }
  // Nothing was sent: nothing can write, so the fallback is immediate.
  requests_.at(id)->writer_settled = true;
  GiveUpRemote(id, "prefill peer " + address + " unavailable");
}

bool DecodeSide::ListedBy(const ConnectionPtr& router, const std::string& address) {
  std::lock_guard<std::mutex> lock(peers_mu_);
  auto view = router_prefill_views_.find(router->id());
  return view != router_prefill_views_.end() && view->second.count(address) > 0;
}

// A router's list of the prefill workers it admits (see the header).
void DecodeSide::OnPrefillWorkers(const ConnectionPtr& router, const proto::PrefillWorkers& list) {
  if (list.workers_size() > kMaxPrefillWorkers) {
    PDSERVE_LOG(WARN) << "router " << router->id() << " listed " << list.workers_size()
                      << " prefill workers (at most " << kMaxPrefillWorkers << "); list ignored";
    return;
  }
  std::set<std::string> announced;
  for (const auto& w : list.workers()) {
    if (w.control_address().size() > kMaxControlAddressBytes) {
      PDSERVE_LOG(WARN) << "router " << router->id() << " listed a prefill worker address of "
                        << w.control_address().size() << " bytes; list ignored";
      return;
    }
    if (!w.control_address().empty()) announced.insert(w.control_address());
  }
  std::vector<std::string> dropped, unsent;
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
    dropped = ReconcilePrefillPeersLocked(&unsent);
  }
  StopRetiredClients();
  GiveUpUnsent(std::move(unsent), "prefill worker removed by the router");
  FallBackRequestsOf(dropped, "prefill worker removed by the router");
}

void DecodeSide::ForgetRouterView(const ConnectionPtr& router) {
  std::vector<std::string> dropped, unsent;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (router_prefill_views_.erase(router->id()) == 0) return;
    dropped = ReconcilePrefillPeersLocked(&unsent);
  }
  StopRetiredClients();
  GiveUpUnsent(std::move(unsent), "prefill worker no longer listed by any router");
  FallBackRequestsOf(dropped, "prefill worker no longer listed by any router");
}

// Stops reconnecting to prefill workers no router lists. A peer with an open
// connection is only marked: it may still hold hand-offs, and goes when that
// connection closes. Returns the addresses dropped now; the ids of their
// Prefill messages that waited for a handshake go to `unsent`.
std::vector<std::string> DecodeSide::ReconcilePrefillPeersLocked(std::vector<std::string>* unsent) {
  std::set<std::string> listed;
  for (const auto& [_, view] : router_prefill_views_) listed.insert(view.begin(), view.end());
  std::vector<std::string> dropped;
  for (auto it = prefill_peers_.begin(); it != prefill_peers_.end();) {
    if (listed.count(it->first)) {
      ++it;
      continue;
    }
    if (it->second->ready) {
      it->second->forgotten = true;
      ++it;
      continue;
    }
    PDSERVE_LOG(INFO) << "prefill worker " << it->first << " is no longer listed by a router; "
                      << "not reconnecting";
    retired_clients_.push_back(std::move(it->second->client));
    for (std::string& rid : PrefillRids(it->second->pending)) unsent->push_back(std::move(rid));
    dropped.push_back(it->first);
    it = prefill_peers_.erase(it);
  }
  return dropped;
}

// Called without peers_mu_ (a client's close may run its on_close inline,
// which takes that lock); from the loop thread Stop() does not wait, so this
// is safe inside a client's own callbacks too.
void DecodeSide::StopRetiredClients() {
  std::vector<std::unique_ptr<control::Client>> retired;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    retired.swap(retired_clients_);
  }
  for (auto& c : retired) c->Stop("prefill worker no longer listed by a router");
}

void DecodeSide::StopClients(const std::string& why) {
  std::map<std::string, std::unique_ptr<PrefillPeer>> peers;
  std::vector<std::unique_ptr<control::Client>> retired;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    peers.swap(prefill_peers_);
    retired.swap(retired_clients_);
  }
  for (auto& [_, p] : peers) p->client->Stop(why);
  for (auto& c : retired) c->Stop(why);
}

size_t DecodeSide::ControlBufferedBytes() {
  size_t total = 0;
  std::lock_guard<std::mutex> lock(peers_mu_);
  for (auto& [_, p] : prefill_peers_) {
    if (auto conn = p->client->connection()) total += conn->buffered_bytes();
  }
  return total;
}

// Step 1 of the transfer handshake (pdserve.proto, TransferHello): our layout
// only; the descriptor follows once the peer accepted it.
void DecodeSide::OnPrefillPeerOpen(const std::string& address, const ConnectionPtr& c) {
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    if (auto it = prefill_peers_.find(address); it != prefill_peers_.end()) {
      it->second->descriptor_sent = false;  // a fresh handshake on a fresh connection
    }
  }
  (void)c->Send(LayoutHello(*ctx_));
  PDSERVE_LOG(INFO) << "connected to prefill worker " << address << "; transfer handshake sent";
}

void DecodeSide::OnPrefillPeerMessage(const std::string& address, const ConnectionPtr& c,
                                      proto::Envelope& e) {
  if (e.has_transfer_hello()) {
    const proto::TransferHello& hello = e.transfer_hello();
    auto refuse = [&](const std::string& why) {
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        if (auto it = prefill_peers_.find(address); it != prefill_peers_.end())
          it->second->last_error = why;
      }
      PDSERVE_LOG(ERROR) << "prefill worker " << address << ": transfer handshake failed: " << why;
      c->Close("transfer handshake failed: " + why);
    };
    if (hello.transfer_descriptor().empty()) {
      // Step 2: the peer accepted our layout and shows its own. Our
      // descriptor is minted for this connection alone (NCCL bootstraps one
      // pair from it).
      if (Status st = CheckPeerLayout(*ctx_, hello); !st.ok()) return refuse(st.message());
      // Once a connection: each export mints a pair's resources (an NCCL
      // bootstrap thread and socket), which a peer repeating this would pile up.
      {
        std::lock_guard<std::mutex> lock(peers_mu_);
        auto it = prefill_peers_.find(address);
        if (it == prefill_peers_.end()) return;  // forgotten meanwhile
        if (std::exchange(it->second->descriptor_sent, true)) {
          return refuse("the writer's layout came twice");
        }
      }
      auto descriptor = ctx_->transfer->ExportDescriptor();
      if (!descriptor.ok()) return refuse(descriptor.status().message());
      proto::Envelope offer;
      offer.mutable_transfer_hello()->set_worker_id(ctx_->opts->worker_id);
      offer.mutable_transfer_hello()->set_transfer_descriptor(std::move(*descriptor));
      (void)c->Send(std::move(offer));
      return;
    }
    // Step 4: the writer's reply to our descriptor, once, after it.
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = prefill_peers_.find(address);
      if (it == prefill_peers_.end()) return;  // forgotten meanwhile
      if (!it->second->descriptor_sent || it->second->ready) {
        return refuse("the writer's reply came out of order (after our descriptor, once)");
      }
    }
    auto peer = ctx_->transfer->Accept(hello.transfer_descriptor());
    if (!peer.ok()) return refuse(peer.status().message());
    std::deque<PendingPrefill> flush;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      auto it = prefill_peers_.find(address);
      if (it == prefill_peers_.end()) return;  // forgotten meanwhile
      it->second->ready = true;
      it->second->transfer_peer = *peer;
      flush.swap(it->second->pending);
    }
    // The peer's deadline must not outlast ours: it gets the time left, and
    // a request whose time is up is not sent (it falls back now).
    const auto now = WorkerClock::now();
    std::vector<std::string> expired, unsent;
    for (auto& p : flush) {
      std::string rid = p.prefill.prefill().request_id();
      if (now >= p.send_by) {
        expired.push_back(std::move(rid));
        continue;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(p.send_by - now);
      p.prefill.mutable_prefill()->set_deadline_ms(
          static_cast<uint32_t>(std::max<int64_t>(1, left.count())));
      if (!c->Send(std::move(p.prefill)).ok()) unsent.push_back(std::move(rid));
    }
    GiveUpUnsent(std::move(expired), "the transfer handshake with prefill worker " + address +
                                         " ended after the request's deadline");
    GiveUpUnsent(std::move(unsent), "prefill peer " + address + " unavailable");
    return;
  }
  if (e.has_kv_write()) {
    PeerId transfer_peer = 0;
    {
      std::lock_guard<std::mutex> lock(peers_mu_);
      if (auto it = prefill_peers_.find(address); it != prefill_peers_.end())
        transfer_peer = it->second->transfer_peer;
    }
    ctx_->post([this, address, transfer_peer, w = std::move(*e.mutable_kv_write())] {
      OnKvWrite(address, transfer_peer, w);
    });
    return;
  }
  if (e.has_prefill_done()) {
    ctx_->post([this, address, done = std::move(*e.mutable_prefill_done())] {
      OnPrefillDone(address, done);
    });
    return;
  }
  if (e.has_error()) {
    PDSERVE_LOG(WARN) << "prefill worker " << address << ": " << e.error().message();
    return;
  }
}

void DecodeSide::OnPrefillPeerClosed(const std::string& address, const Status& why) {
  std::deque<PendingPrefill> dropped;
  PeerId transfer_peer = 0;
  {
    std::lock_guard<std::mutex> lock(peers_mu_);
    auto it = prefill_peers_.find(address);
    if (it != prefill_peers_.end()) {
      PrefillPeer& peer = *it->second;
      peer.ready = false;
      peer.descriptor_sent = false;
      transfer_peer = std::exchange(peer.transfer_peer, 0);
      dropped.swap(peer.pending);
      if (!why.ok() && peer.last_error.empty()) peer.last_error = why.message();
      if (peer.forgotten) {
        PDSERVE_LOG(INFO) << "prefill worker " << address
                          << " closed and no router lists it; not reconnecting";
        retired_clients_.push_back(std::move(peer.client));
        prefill_peers_.erase(it);
      }
    }
  }
  StopRetiredClients();
  GiveUpUnsent(PrefillRids(dropped), "prefill worker lost: " + why.message());
  // Its transfer pair goes too, which ends every Receive pending on it, and
  // every hand-off it held falls back. The peer itself may not have noticed
  // yet (a partition, a frozen process): FallBackToLocal holds the blocks
  // it may still write into.
  if (transfer_peer) ctx_->transfer->Disconnect(transfer_peer);
  FallBackRequestsOf({address}, "prefill worker lost: " + why.message());
  // After those fall back (posted in order): no report comes on this
  // connection any more.
  ctx_->post([this, address] { StopAwaitingReportsOf(address); });
}

}  // namespace pdserve::worker
