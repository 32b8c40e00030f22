#include "services/router/router_core.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <deque>
#include <limits>

#include "common/kv_groups.h"
#include "services/router/detail/block_table.h"

namespace pdserve::router {

// What every decision reads of every worker comes first, in two cache lines
// (a decision builds 64 candidates: a third line each cost about 0.1 us).
struct alignas(64) RouterCore::Worker {
  WorkerId id = 0;
  Role role = Role::kBoth;
  bool has_report = false;
  bool draining = false;
  int64_t max_model_len = 0;       // 0: unknown
  int64_t kv_capacity_blocks = 0;  // 0: unknown
  int64_t last_report_us = 0;
  WorkerLoad reported;
  int64_t inflight_requests = 0;
  int64_t inflight_prefill_tokens = 0;    // charged to the prefilling worker
  int64_t inflight_prefill_requests = 0;  // requests it has not prefilled yet
  int64_t inflight_decode_tokens = 0;     // charged to the decode worker
  std::string name;
  std::deque<int64_t> routed_at_us;  // within the QPS window (production-stack)
};

RouterCore::RouterCore(RouterOptions options)
    : options_(std::move(options)),
      index_(options_.index),
      track_qps_(options_.policy == "production-stack"),
      workers_(options_.index.max_workers) {}

RouterCore::~RouterCore() = default;

StatusOr<std::unique_ptr<RouterCore>> RouterCore::Create(RouterOptions options) {
  if (options.block_tokens <= 0) return Status::InvalidArgument("block_tokens must be positive");
  if (options.max_local_prefill < 0) {
    return Status::InvalidArgument("max_local_prefill must not be negative");
  }
  if (options.max_prefill_queue_tokens < 0) {
    return Status::InvalidArgument("max_prefill_queue_tokens must not be negative");
  }
  if (!(options.copy_cost >= 0) || !std::isfinite(options.copy_cost)) {
    return Status::InvalidArgument("copy_cost must be finite and non-negative");
  }
  if (options.copy_min_requests < 1 || options.copy_min_requests > kMaxCopyMinRequests) {
    return Status::InvalidArgument("copy_min_requests must be in [1, " +
                                   std::to_string(kMaxCopyMinRequests) + "]");
  }
  if (options.copy_window_us <= 0) return Status::InvalidArgument("copy window must be positive");
  if (options.pending_ttl_us < 0)
    return Status::InvalidArgument("pending TTL must not be negative");
  if (options.worker_stall_us < 0)
    return Status::InvalidArgument("worker stall timeout must not be negative");
  if (options.index.max_workers == 0)
    return Status::InvalidArgument("max_workers must be positive");
  if (!options.clock_us) {
    options.clock_us = [] {
      return std::chrono::duration_cast<std::chrono::microseconds>(
                 std::chrono::steady_clock::now().time_since_epoch())
          .count();
    };
  }
  options.policy_options.block_tokens = options.block_tokens;
  const bool kv = options.policy == "kv";
  const PolicyOptions configured = options.policy_options;
  // kv: affinity weights, relief weights per decision (WithKvWeights). The
  // others read only the decode weight (least_loaded's own default).
  PolicyOptions base = configured;
  if (!kv && !base.decode_weight) base.decode_weight = kLeastLoadedDecodeWeight;
  options.policy_options = WithKvWeights(base, false);
  PolicyOptions prefill_options = options.policy_options;
  prefill_options.seed = options.policy_options.seed * 0x9E3779B97F4A7C15ull + 1;
  auto decode_policy = MakePolicy(options.policy, options.policy_options);
  if (!decode_policy.ok()) return decode_policy.status();
  auto prefill_policy = MakePolicy(options.policy, prefill_options);
  if (!prefill_policy.ok()) return prefill_policy.status();
  // Only when they differ (weights set by the caller are kept): relief
  // decisions then need their own pair of policies.
  const PolicyOptions relief = WithKvWeights(configured, true);
  std::unique_ptr<RoutingPolicy> decode_relief, prefill_relief;
  if (kv && (*relief.load_weight != *options.policy_options.load_weight ||
             *relief.decode_weight != *options.policy_options.decode_weight)) {
    PolicyOptions prefill_relief_options = relief;
    prefill_relief_options.seed = prefill_options.seed;
    auto d = MakePolicy(options.policy, relief);
    if (!d.ok()) return d.status();
    auto p = MakePolicy(options.policy, prefill_relief_options);
    if (!p.ok()) return p.status();
    decode_relief = std::move(*d);
    prefill_relief = std::move(*p);
  }
  if (options.copy_max_inflight < 0 || !(options.copy_max_tokens_per_s >= 0) ||
      !std::isfinite(options.copy_max_tokens_per_s) || options.copy_reuse_window_us <= 0) {
    return Status::InvalidArgument(
        "copy budgets must not be negative and the reuse window must be positive");
  }
  std::unique_ptr<RouterCore> core(new RouterCore(std::move(options)));
  core->decode_policy_ = std::move(*decode_policy);
  core->prefill_policy_ = std::move(*prefill_policy);
  core->decode_relief_policy_ = std::move(decode_relief);
  core->prefill_relief_policy_ = std::move(prefill_relief);
  core->relief_weights_ = relief;
  core->weights_ = &core->options_.policy_options;
  const RouterOptions& o = core->options_;
  if ((o.copy_cost > 0 && o.copy_cost < 1) || o.drain_push) {
    CopyGovernorOptions g;
    g.copy_cost = o.copy_cost;
    g.block_tokens = o.block_tokens;
    g.max_inflight = o.copy_max_inflight;
    g.max_tokens_per_s = o.copy_max_tokens_per_s;
    g.cooldown_us = o.copy_window_us;
    g.reuse_window_us = o.copy_reuse_window_us;
    core->governor_ = std::make_unique<CopyGovernor>(g);
  }
  if (core->governor_ || core->decode_relief_policy_) {
    // Allocated once (lazily zeroed): no rehash on the routing path.
    core->prefix_reach_ = std::make_unique<detail::BlockTable>(
        kReachTimes + static_cast<size_t>(core->options_.copy_min_requests), kMaxTrackedPrefixes);
    core->prefix_reach_->Reserve(kMaxTrackedPrefixes);
  }
  return core;
}

StatusOr<WorkerId> RouterCore::AddWorker(const std::string& name, Role role, int64_t max_model_len,
                                         int64_t kv_capacity_blocks) {
  if (max_model_len < 0) return Status::InvalidArgument("max_model_len must not be negative");
  if (kv_capacity_blocks < 0) {
    return Status::InvalidArgument("kv_capacity_blocks must not be negative");
  }
  std::lock_guard lock(mu_);
  FlushPendingLocked();  // a reused slot must not inherit the last holder's entries
  std::optional<WorkerId> free_slot;
  for (WorkerId i = 0; i < workers_.size(); ++i) {
    if (!workers_[i]) {
      if (!free_slot) free_slot = i;
    } else if (workers_[i]->name == name) {
      return Status::InvalidArgument("worker '" + name + "' is already registered");
    }
  }
  if (!free_slot) {
    return Status::ResourceExhausted("all " + std::to_string(workers_.size()) +
                                     " worker slots are in use");
  }
  PDSERVE_RETURN_IF_ERROR(index_.AddWorker(*free_slot));
  auto w = std::make_unique<Worker>();
  w->id = *free_slot;
  w->name = name;
  w->role = role;
  w->max_model_len = max_model_len;
  w->kv_capacity_blocks = kv_capacity_blocks;
  workers_[*free_slot] = std::move(w);
  if (governor_) {
    governor_->AddWorker(*free_slot);
    governor_->SetWorkerCount(DecodeWorkerCountLocked());
  }
  return *free_slot;
}

std::vector<uint64_t> RouterCore::RemoveWorker(WorkerId worker) {
  std::vector<uint64_t> orphans;
  std::lock_guard lock(mu_);
  if (worker >= workers_.size() || !workers_[worker]) return orphans;
  FlushPendingLocked();
  for (auto it = inflight_.begin(); it != inflight_.end();) {
    Inflight& r = it->second;
    if (r.decode == worker) {
      ReleaseLocked(r, /*prefill_only=*/false);
      orphans.push_back(it->first);
      it = inflight_.erase(it);
      continue;
    }
    if (r.prefiller == worker) {
      // Only its prefill is lost: the decode worker computes the prompt
      // itself, and the request stays in flight there until it finishes.
      ReleaseLocked(r, /*prefill_only=*/true);
      r.prefiller = r.decode;
    }
    ++it;
  }
  workers_[worker].reset();
  index_.RemoveWorker(worker);
  if (governor_) {
    governor_->RemoveWorker(worker);
    governor_->SetWorkerCount(DecodeWorkerCountLocked());
  }
  std::sort(orphans.begin(), orphans.end());
  return orphans;
}

void RouterCore::SetDraining(WorkerId worker, bool draining) {
  std::lock_guard lock(mu_);
  if (worker < workers_.size() && workers_[worker]) workers_[worker]->draining = draining;
}

int64_t RouterCore::DecodeWorkerCountLocked() const {
  int64_t n = 0;
  for (const auto& w : workers_) n += w && w->role != Role::kPrefill;
  return n;
}

ApplyOutcome RouterCore::OnKvEvents(WorkerId worker, const KvEventBatch& batch) {
  // A Stored event supersedes the pending entry of its block: the entries
  // of earlier decisions must be in before it.
  if (has_deferred_.load(std::memory_order_acquire)) FlushPending();
  const ApplyOutcome out = index_.ApplyEvents(worker, batch);
  if (governor_ && out == ApplyOutcome::kApplied) {
    governor_->OnKvEvents(worker, batch, options_.clock_us());
  }
  return out;
}

Status RouterCore::OnSnapshot(WorkerId worker, uint64_t seq, std::span<const BlockHash> hashes,
                              std::span<const BlockHash> host, std::span<const BlockHash> disk) {
  if (has_deferred_.load(std::memory_order_acquire)) FlushPending();
  return index_.ApplySnapshot(worker, seq, hashes, host, disk);
}

Status RouterCore::OnLoad(WorkerId worker, const WorkerLoad& load) {
  std::lock_guard lock(mu_);
  if (worker >= workers_.size() || !workers_[worker]) {
    return Status::NotFound("load report for unknown worker slot " + std::to_string(worker));
  }
  workers_[worker]->reported = load;
  workers_[worker]->has_report = true;
  workers_[worker]->last_report_us = options_.clock_us();
  if (governor_ && load.total_blocks > 0) governor_->SetCapacity(worker, load.total_blocks);
  return Status::Ok();
}

void RouterCore::SetKvGroupWindows(std::vector<int64_t> windows, int64_t sink_tokens) {
  std::lock_guard lock(mu_);
  FlushPendingLocked();  // written under the groups they were decided with
  group_windows_ = std::move(windows);
  sink_tokens_ = sink_tokens;
}

int64_t RouterCore::KvSinkTokens() const {
  std::lock_guard lock(mu_);
  return sink_tokens_;
}

void RouterCore::SetSnapKv(int64_t budget_tokens, int64_t observation_window) {
  std::lock_guard lock(mu_);
  snapkv_budget_ = budget_tokens;
  snapkv_window_ = observation_window;
}

std::pair<int64_t, int64_t> RouterCore::SnapKv() const {
  std::lock_guard lock(mu_);
  return {snapkv_budget_, snapkv_window_};
}

std::vector<int64_t> RouterCore::KvGroupWindows() const {
  std::lock_guard lock(mu_);
  return group_windows_;
}

void RouterCore::Overlap(std::span<const BlockHash> hashes, int64_t now_us,
                         std::vector<uint32_t>* out) {
  std::lock_guard lock(mu_);
  FlushPendingLocked();
  OverlapLocked(hashes, now_us, out);
}

void RouterCore::OverlapLocked(std::span<const BlockHash> hashes, int64_t now_us,
                               std::vector<uint32_t>* out) const {
  if (!GroupedLocked()) return index_.LeadingOverlap(hashes, now_us, out);
  index_.GroupedOverlap(hashes, group_windows_, static_cast<size_t>(options_.block_tokens), now_us,
                        out, sink_tokens_);
}

void RouterCore::AddPendingLocked(WorkerId worker, std::span<const BlockHash> hashes,
                                  int64_t now_us, int64_t expires_us) {
  if (!GroupedLocked()) return index_.AddPending(worker, hashes, now_us, expires_us);
  // The worker will hold every group's block of each of them.
  pending_keys_.clear();
  for (BlockHash h : hashes) {
    for (size_t g = 0; g < group_windows_.size(); ++g) {
      pending_keys_.push_back(GroupBlockKey(h, static_cast<uint32_t>(g)));
    }
  }
  index_.AddPending(worker, pending_keys_, now_us, expires_us);
}

void RouterCore::DeferPendingLocked(WorkerId worker, std::span<const BlockHash> prompt,
                                    int64_t held, int64_t now_us, int64_t expires_us) {
  if (prompt.empty()) return;
  deferred_.push_back({worker, deferred_hashes_.size(), prompt.size(), static_cast<size_t>(held),
                       now_us, expires_us});
  deferred_hashes_.insert(deferred_hashes_.end(), prompt.begin(), prompt.end());
  has_deferred_.store(true, std::memory_order_release);
}

void RouterCore::FlushPendingLocked() {
  if (deferred_.empty()) return;
  for (const DeferredPending& d : deferred_) {
    const auto prompt = std::span(deferred_hashes_).subspan(d.first, d.count);
    AddPendingLocked(d.worker, prompt.subspan(d.held), d.now_us, d.expires_us);
    // Group keys are not chained by the prompt's hashes alone.
    if (d.held > 0 && !GroupedLocked()) index_.AdoptHeldPrefix(d.worker, prompt.first(d.held));
  }
  deferred_.clear();
  deferred_hashes_.clear();
  has_deferred_.store(false, std::memory_order_release);
}

void RouterCore::FlushPending() {
  std::lock_guard lock(mu_);
  FlushPendingLocked();
}

Candidate RouterCore::MakeCandidateLocked(Worker& w, int64_t overlap_blocks,
                                          const RouteRequest& request, int64_t now_us) {
  const int64_t prompt_tokens = request.prompt_tokens;
  Candidate c;
  c.worker = w.id;
  c.prompt_tokens = prompt_tokens;
  c.overlap_blocks = overlap_blocks;
  const TierRun run = match_[w.id].lower;
  c.host_blocks = run.host_blocks;
  c.disk_blocks = run.disk_blocks;
  c.uncached_tokens =
      std::max<int64_t>(0, prompt_tokens - (overlap_blocks + run.span()) * options_.block_tokens);
  c.queued_prefill_tokens = w.inflight_prefill_tokens;
  c.decode_tokens = w.inflight_decode_tokens;
  c.waiting_requests = w.inflight_prefill_requests;
  c.inflight_requests =
      w.role == Role::kPrefill ? w.inflight_prefill_requests : w.inflight_requests;
  if (w.has_report) {
    c.queued_prefill_tokens = std::max(c.queued_prefill_tokens, w.reported.queued_prefill_tokens);
    c.waiting_requests = std::max(c.waiting_requests, w.reported.waiting);
    c.inflight_requests = std::max(c.inflight_requests, w.reported.running + w.reported.waiting);
    if (w.reported.total_blocks > 0) {
      const int64_t used = std::max<int64_t>(0, w.reported.total_blocks - w.reported.free_blocks);
      c.decode_tokens = std::max(c.decode_tokens, used * options_.block_tokens);
      c.kv_usage =
          std::min(1.0, static_cast<double>(c.decode_tokens) /
                            static_cast<double>(w.reported.total_blocks * options_.block_tokens));
    }
  }
  if (track_qps_) {
    const auto window_us = static_cast<int64_t>(options_.policy_options.qps_window_s * 1e6);
    while (!w.routed_at_us.empty() && w.routed_at_us.front() <= now_us - window_us) {
      w.routed_at_us.pop_front();
    }
    c.recent_requests = static_cast<int64_t>(w.routed_at_us.size());
  }
  c.cached_blocks = static_cast<int64_t>(match_[w.id].blocks);
  return c;
}

StatusOr<RouteDecision> RouterCore::Route(const RouteRequest& request) {
  const int64_t blocks = static_cast<int64_t>(request.block_hashes.size());
  if (request.prompt_tokens < blocks * options_.block_tokens || request.max_new_tokens < 0) {
    return Status::InvalidArgument("route: " + std::to_string(blocks) + " blocks of " +
                                   std::to_string(options_.block_tokens) + " tokens exceed the " +
                                   std::to_string(request.prompt_tokens) + "-token prompt");
  }
  const int64_t now = options_.clock_us();

  std::lock_guard lock(mu_);
  FlushPendingLocked();  // the earlier decisions' entries, if their callers did not
  if (inflight_.contains(request.request_id)) {
    return Status::InvalidArgument("request id " + std::to_string(request.request_id) +
                                   " is already in flight");
  }
  // What a worker can reuse: the blocks before the last token's (see
  // RouterOptions), and under SnapKV, for a prompt over the budget, those
  // before its observation window: the window's queries are computed
  // whatever is cached, and the decode worker of a remote prefill receives
  // the compressed prompt into blocks of the request's own, which it never
  // caches.
  std::span<const BlockHash> reusable = request.block_hashes;
  if (options_.reuse_stops_before_last_token) {
    const auto before_last = static_cast<size_t>(std::max<int64_t>(0, request.prompt_tokens - 1) /
                                                 options_.block_tokens);
    reusable = reusable.first(std::min(reusable.size(), before_last));
  }
  const bool compresses = snapkv_budget_ > 0 && request.prompt_tokens > snapkv_budget_;
  if (compresses) {
    const auto cap =
        static_cast<size_t>((request.prompt_tokens - snapkv_window_) / options_.block_tokens);
    reusable = reusable.first(std::min(reusable.size(), cap));
  }
  if (GroupedLocked()) {
    // Layer groups (windows, sinks): the overlap is by group keys
    // (OverlapLocked), and a worker's lower-tier run by the same rule.
    index_.Match({}, now, &overlap_, &match_);
    OverlapLocked(reusable, now, &overlap_);
    index_.GroupedTierRuns(reusable, group_windows_, static_cast<size_t>(options_.block_tokens),
                           overlap_, sink_tokens_, &match_);
  } else {
    index_.Match(reusable, now, &overlap_, &match_);
  }

  // Whether a worker's context holds `tokens` (an unknown one is assumed to).
  auto holds = [](const Worker& w, int64_t tokens) {
    return w.max_model_len == 0 || tokens <= w.max_model_len;
  };
  // Whether a worker's whole KV pool is too small for the prompt and its
  // first token (a prompt scored alone has none), as its engine refuses
  // them (without windows, whose groups need fewer blocks than the sequence
  // has).
  const int64_t first_token = request.max_new_tokens == 0 ? 0 : 1;
  const int64_t prompt_blocks =
      (request.prompt_tokens + first_token + options_.block_tokens - 1) / options_.block_tokens;
  auto pool_too_small = [&](const Worker& w) {
    return !GroupedLocked() && w.kv_capacity_blocks > 0 && prompt_blocks > w.kv_capacity_blocks;
  };
  auto avoided = [&](const Worker& w) {
    return std::find(request.avoid.begin(), request.avoid.end(), w.id) != request.avoid.end();
  };
  // How far down a worker comes: one that failed the request already or
  // whose pool cannot hold it only when no other can decode (a retry goes
  // elsewhere: the same worker would most likely fail it again), and a
  // stalled one (load reports stopped) after those: a long step is then
  // waited for, as before the check, not refused.
  auto rank = [&](const Worker& w) {
    return (StalledLocked(w, now) ? 2 : 0) + (avoided(w) || pool_too_small(w) ? 1 : 0);
  };
  const int64_t sequence_tokens = request.prompt_tokens + request.max_new_tokens;
  candidates_.clear();
  bool too_short = false;
  for (int take_rank = 0; take_rank < 4 && candidates_.empty(); ++take_rank) {
    for (const auto& w : workers_) {
      if (w && !w->draining && w->role != Role::kPrefill && rank(*w) == take_rank) {
        if (!holds(*w, sequence_tokens)) {
          too_short = true;
          continue;
        }
        candidates_.push_back(MakeCandidateLocked(*w, overlap_[w->id], request, now));
      }
    }
  }
  if (candidates_.empty()) {
    return Status::Unavailable(
        too_short ? "no decode worker accepting requests runs sequences of " +
                        std::to_string(sequence_tokens) + " tokens"
                  : std::string("no decode worker is registered and accepting requests"));
  }
  weights_ = &options_.policy_options;
  OfferCopiesLocked(request, now);
  // Relief (WithKvWeights): the prefix needs more holders, so load
  // balancing spreads it, unless a copy spreads it at no more delay.
  std::optional<size_t> copy_pick;
  if (relief_ && !copy_blocks_.empty()) copy_pick = ChooseCopyLocked();
  const bool relief = relief_ && decode_relief_policy_ && !copy_pick;
  if (relief) weights_ = &relief_weights_;
  RoutingPolicy& decode_policy = relief ? *decode_relief_policy_ : *decode_policy_;
  RoutingPolicy& prefill_policy = relief ? *prefill_relief_policy_ : *prefill_policy_;
  const size_t d_index = copy_pick ? *copy_pick : decode_policy.Pick(candidates_);
  const Candidate d = candidates_[d_index];
  if (!price_decline_.empty()) CountDeclineLocked(d_index);

  RouteDecision decision;
  decision.decode = d.worker;
  decision.decode_overlap_blocks = d.overlap_blocks;
  decision.prefill_overlap_blocks = d.overlap_blocks;
  decision.prefill_host_blocks = d.host_blocks;
  decision.prefill_disk_blocks = d.disk_blocks;
  decision.prefill_tokens = d.uncached_tokens;
  if (!copy_blocks_.empty() && copy_blocks_[d_index] > 0) {
    decision.copy_from = copy_source_;
    decision.copy_blocks = copy_blocks_[d_index];
    decision.prefill_tokens =
        std::max<int64_t>(0, request.prompt_tokens -
                                 (d.overlap_blocks + decision.copy_blocks) * options_.block_tokens);
  }
  if (decision.prefill_tokens > options_.max_local_prefill) {
    candidates_.clear();
    // Not a prefill worker that failed the request, whose pool is too
    // small or whose queue is past the bound: without another, the decode
    // worker prefills it.
    auto queue_full = [&](const Worker& w) {
      const int64_t queued =
          std::max(w.inflight_prefill_tokens, w.has_report ? w.reported.queued_prefill_tokens : 0);
      return options_.max_prefill_queue_tokens > 0 && queued > options_.max_prefill_queue_tokens;
    };
    for (const auto& w : workers_) {
      if (w && !w->draining && w->role == Role::kPrefill && !StalledLocked(*w, now) &&
          holds(*w, request.prompt_tokens + 1) && !avoided(*w) && !pool_too_small(*w) &&
          !queue_full(*w)) {
        candidates_.push_back(MakeCandidateLocked(*w, overlap_[w->id], request, now));
      }
    }
    if (!candidates_.empty()) {
      const Candidate p = candidates_[prefill_policy.Pick(candidates_)];
      decision.copy_from.reset();  // the prefill worker writes every missing block
      decision.copy_blocks = 0;
      decision.prefill = p.worker;
      decision.prefill_overlap_blocks = p.overlap_blocks;
      decision.prefill_host_blocks = p.host_blocks;
      decision.prefill_disk_blocks = p.disk_blocks;
      decision.prefill_tokens = p.uncached_tokens;
    }
  }

  Inflight r;
  r.decode = decision.decode;
  r.prefiller = decision.prefill.value_or(decision.decode);
  r.prefill_tokens = decision.prefill_tokens;
  r.decode_tokens = request.prompt_tokens + request.max_new_tokens;
  Worker& dw = *workers_[r.decode];
  dw.inflight_requests += 1;
  dw.inflight_decode_tokens += r.decode_tokens;
  if (track_qps_) dw.routed_at_us.push_back(now);
  Worker& pw = *workers_[r.prefiller];
  pw.inflight_prefill_tokens += r.prefill_tokens;
  pw.inflight_prefill_requests += 1;
  if (track_qps_ && decision.prefill) pw.routed_at_us.push_back(now);
  inflight_.emplace(request.request_id, r);

  // Both the prefiller (computes the blocks) and the decode worker (receives
  // them) will hold the whole prompt shortly.
  if (options_.pending_ttl_us > 0) {
    const int64_t expires = now + options_.pending_ttl_us;
    DeferPendingLocked(r.prefiller, request.block_hashes, decision.prefill_overlap_blocks, now,
                       expires);
    if (decision.prefill && !compresses) {
      DeferPendingLocked(r.decode, request.block_hashes, decision.decode_overlap_blocks, now,
                         expires);
    }
  }

  ++counters_.routed;
  counters_.relief_decisions += relief;
  ++(decision.prefill ? counters_.remote_prefill : counters_.local_prefill);
  if (decision.copy_from) {
    ++counters_.copies;
    counters_.copied_blocks += static_cast<uint64_t>(decision.copy_blocks);
  }
  if (governor_) {
    governor_->OnRouted(request.request_id, r.prefiller, request.block_hashes,
                        decision.prefill_overlap_blocks, now);
    if (decision.copy_from) {
      const int64_t copied_tokens =
          std::min((decision.decode_overlap_blocks + decision.copy_blocks) * options_.block_tokens,
                   request.prompt_tokens) -
          decision.decode_overlap_blocks * options_.block_tokens;
      governor_->OnStarted(request.request_id, *decision.copy_from, decision.decode,
                           request.block_hashes, decision.decode_overlap_blocks,
                           decision.copy_blocks, copied_tokens, now);
    }
  }
  counters_.prompt_tokens += request.prompt_tokens;
  counters_.predicted_hit_tokens += request.prompt_tokens - decision.prefill_tokens;
  counters_.predicted_host_hit_tokens += decision.prefill_host_blocks * options_.block_tokens;
  counters_.predicted_disk_hit_tokens += decision.prefill_disk_blocks * options_.block_tokens;
  return decision;
}

namespace {
constexpr double kMinTrafficPerWorker = 1;
// Whether a copy of the longest held prefix (`best` blocks) could serve
// candidate c: it lacks part of it, and has no lower-tier run (which it
// copies back itself).
bool CopyServes(const Candidate& c, int64_t best) {
  return c.overlap_blocks < best && c.host_blocks + c.disk_blocks == 0;
}
// `value` decayed with time constant `tau_us` from `at_us` to `now_us`.
double Decayed(double value, int64_t at_us, int64_t now_us, int64_t tau_us) {
  if (now_us <= at_us) return value;
  return value * std::exp(-static_cast<double>(now_us - at_us) / static_cast<double>(tau_us));
}
}  // namespace

bool RouterCore::NoteHotPrefixLocked(BlockHash last_block, int64_t now_us, double* share) {
  // Bounded: past this many prefixes, those no request reached within the
  // window are forgotten (they could not be hot), and if the window itself
  // holds more, all of them (a copy then waits for the prefix to be reached
  // again).
  detail::BlockTable& table = *prefix_reach_;
  if (table.size() >= kMaxTrackedPrefixes) {
    stale_prefixes_.clear();
    table.ForEach([&](uint64_t key, const uint64_t* words) {
      if (static_cast<int64_t>(words[kReachNewest]) <= now_us - options_.copy_window_us) {
        stale_prefixes_.push_back(key);
      }
    });
    for (uint64_t key : stale_prefixes_) table.Erase(key);
    if (table.size() >= kMaxTrackedPrefixes / 2) table.ClearKeepCapacity();
  }
  const auto needed = static_cast<uint64_t>(options_.copy_min_requests);
  bool inserted = false;
  uint64_t* reach = table.words(table.FindOrInsert(last_block, &inserted));
  // Words: [count | next << 32, newest_us, demand (double bits), times ring].
  uint64_t count = reach[kReachRing] & 0xFFFFFFFFu;
  uint64_t next = reach[kReachRing] >> 32;
  const double demand =
      Decayed(std::bit_cast<double>(reach[kReachDemand]), static_cast<int64_t>(reach[kReachNewest]),
              now_us, options_.copy_window_us) +
      1;
  reach[kReachDemand] = std::bit_cast<uint64_t>(demand);
  reach[kReachTimes + next] = static_cast<uint64_t>(now_us);
  next = (next + 1) % needed;
  count = std::min(count + 1, needed);
  reach[kReachRing] = count | (next << 32);
  reach[kReachNewest] = static_cast<uint64_t>(now_us);
  *share = traffic_ > 0 ? std::min(1.0, demand / traffic_) : 1.0;
  // The ring's next slot holds the oldest of the latest `needed` times.
  return count == needed &&
         static_cast<int64_t>(reach[kReachTimes + next]) > now_us - options_.copy_window_us;
}

void RouterCore::OfferCopiesLocked(const RouteRequest& request, int64_t now_us) {
  const int64_t prompt_tokens = request.prompt_tokens;
  copy_blocks_.clear();
  price_decline_.clear();
  relief_ = false;
  // copy_cost 0, or >= 1: a copy never pays.
  const bool copies = governor_ && options_.copy_cost > 0 && options_.copy_cost < 1;
  // Without copies the hot prefix is still tracked, for relief.
  if (!copies && !decode_relief_policy_) return;
  if (GroupedLocked()) return;  // a copy moves one group's prefix; not offered with groups
  // Every request counts toward the traffic a prefix's demand is a share of.
  traffic_ = Decayed(traffic_, traffic_at_us_, now_us, options_.copy_window_us) + 1;
  traffic_at_us_ = now_us;
  // The longest prefix any KV writer holds, its least busy holder, and how
  // many workers hold it. A draining or stalled worker counts as no holder:
  // it serves none of the prefix's requests and sends no copy (a draining
  // one, the least busy as it takes no requests, would have its copy
  // dropped; a stuck one would leave the request waiting).
  int64_t best = 0;
  int64_t holders = 0;
  double best_work = 0;
  bool found = false;
  for (const auto& w : workers_) {
    // Any holder copies (decode-only workers too: prefix_copy).
    if (!w || w->draining || StalledLocked(*w, now_us)) continue;
    const int64_t overlap = overlap_[w->id];
    if (overlap == 0 || overlap < best) continue;
    const double work = static_cast<double>(std::max(
        w->inflight_prefill_tokens, w->has_report ? w->reported.queued_prefill_tokens : 0));
    if (overlap > best) holders = 0;
    ++holders;
    if (!found || overlap > best || work < best_work) {
      best = overlap;
      best_work = work;
      copy_source_ = w->id;
      found = true;
    }
  }
  if (!found) return;
  double share = 0;
  if (!NoteHotPrefixLocked(request.block_hashes[static_cast<size_t>(best) - 1], now_us, &share)) {
    return;
  }
  const int64_t best_tokens = std::min(best * options_.block_tokens, prompt_tokens);
  if (std::none_of(candidates_.begin(), candidates_.end(),
                   [&](const Candidate& c) { return CopyServes(c, best); })) {
    return;  // every candidate holds it (or has its own lower-tier copy)
  }
  // A prefix earns holders in proportion to the traffic it draws: with its
  // share of the requests times the decode workers already holding it, a
  // copy adds a duplicate that other prefixes pay for and that its own
  // requests do not need. Until the window has seen a request per worker a
  // share means little (the first request of all is 100% of the traffic):
  // no copies yet.
  const double workers = static_cast<double>(DecodeWorkerCountLocked());
  const double deserved =
      traffic_ >= kMinTrafficPerWorker * workers ? std::ceil(share * workers) : 1.0;
  const bool under_held = static_cast<double>(holders) < std::max(1.0, deserved);
  // An under-held prefix's decision is relieved, copies on or off; with the
  // gate open a copy competes with that relief (Route: ChooseCopyLocked).
  relief_ = under_held;
  if (!copies) return;
  CopyDecline gate = CopyDecline::kEnoughHolders;
  if (!under_held || !governor_->MayStart(now_us, &gate)) {
    // No copy spreads it now (breaker open, probe out or budget spent).
    if (CopyWinsAtLinkPriceLocked(best, best_tokens)) governor_->Declined(gate);
    return;
  }
  // The governor prices the copy to each candidate it could serve (built
  // only here: most decisions end at the gate above).
  quotes_.clear();
  for (const Candidate& c : candidates_) {
    if (!CopyServes(c, best)) continue;
    CopyGovernor::Quote q;
    q.receiver.worker = c.worker;
    const Worker& w = *workers_[c.worker];
    q.receiver.capacity_blocks = w.has_report ? w.reported.total_blocks : 0;
    q.receiver.held_blocks = c.cached_blocks;
    q.receiver.queued_tokens = c.queued_prefill_tokens;
    q.blocks = best - c.overlap_blocks;
    q.tokens = best_tokens - c.overlap_blocks * options_.block_tokens;
    quotes_.push_back(q);
  }
  governor_->Price(copy_source_, quotes_);
  copy_blocks_.assign(candidates_.size(), 0);
  copy_saving_.assign(candidates_.size(), 0);
  base_uncached_.assign(candidates_.size(), 0);
  price_decline_.assign(candidates_.size(), -1);
  size_t q = 0;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    Candidate& c = candidates_[i];
    if (q == quotes_.size() || quotes_[q].receiver.worker != c.worker) continue;
    const CopyGovernor::Quote& quote = quotes_[q++];
    const CopyPrice& price = quote.price;
    if (price.link >= quote.tokens) continue;  // recomputing is cheaper even at the link price
    base_uncached_[i] = c.uncached_tokens - (quote.tokens - price.link);
    if (price.receiver_busy || price.extra() > 0) {
      price_decline_[i] =
          static_cast<int8_t>(price.receiver_busy                ? CopyDecline::kReceiverQueue
                              : price.link_wait > price.pressure ? CopyDecline::kLinkBusy
                                                                 : CopyDecline::kReceiverPressure);
    }
    if (price.receiver_busy || price.total() >= quote.tokens) continue;
    // Never as cheap as holding the blocks (the link price is rounded up).
    copy_saving_[i] = quote.tokens - price.total();
    c.uncached_tokens -= copy_saving_[i];
    copy_blocks_[i] = quote.blocks;
  }
}

std::optional<size_t> RouterCore::ChooseCopyLocked() {
  // The copy the affinity weights would start, if any (their argmin, not
  // the policy's Pick: that would move its tie rotation) ...
  size_t a = 0;
  double affinity_best = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < candidates_.size(); ++i) {
    const double cost = KvCost(candidates_[i], options_.policy_options);
    if (cost < affinity_best) {
      affinity_best = cost;
      a = i;
    }
  }
  if (copy_blocks_[a] > 0) {
    // ... starts when its predicted delay (the relief weights' cost) is no
    // more than that of the best choice relief makes without it: with copies
    // the router then does at least what it does without.
    double relief_best = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < candidates_.size(); ++i) {
      Candidate c = candidates_[i];
      c.uncached_tokens += copy_saving_[i];
      relief_best = std::min(relief_best, KvCost(c, relief_weights_));
    }
    if (KvCost(candidates_[a], relief_weights_) <= relief_best) return a;
  }
  // Otherwise no copy: the candidates as they stand, for the relief pick.
  for (size_t i = 0; i < candidates_.size(); ++i) candidates_[i].uncached_tokens += copy_saving_[i];
  copy_blocks_.assign(candidates_.size(), 0);
  return std::nullopt;
}

bool RouterCore::CopyWinsAtLinkPriceLocked(int64_t best, int64_t best_tokens) const {
  double plain = std::numeric_limits<double>::infinity();
  for (const Candidate& c : candidates_) {
    plain = std::min(plain, KvCost(c, *weights_));
  }
  for (const Candidate& candidate : candidates_) {
    if (!CopyServes(candidate, best)) continue;
    const int64_t tokens = best_tokens - candidate.overlap_blocks * options_.block_tokens;
    const auto link =
        static_cast<int64_t>(std::ceil(static_cast<double>(tokens) * options_.copy_cost));
    if (link >= tokens) continue;
    Candidate c = candidate;
    c.uncached_tokens -= tokens - link;
    if (KvCost(c, *weights_) < plain) return true;
  }
  return false;
}

void RouterCore::CountDeclineLocked(size_t chosen) {
  if (copy_blocks_[chosen] > 0) return;  // a copy was made
  // The cheapest candidate whose copy the governor priced out, at the link
  // price alone: had it won the pick, the old rule would have copied.
  const double chosen_cost = KvCost(candidates_[chosen], *weights_);
  double best = chosen_cost;
  int8_t reason = -1;
  for (size_t i = 0; i < candidates_.size(); ++i) {
    if (price_decline_[i] < 0) continue;
    Candidate c = candidates_[i];
    c.uncached_tokens = base_uncached_[i];
    const double cost = KvCost(c, *weights_);
    if (cost < best) {
      best = cost;
      reason = price_decline_[i];
    }
  }
  if (reason >= 0) governor_->Declined(static_cast<CopyDecline>(reason));
}

std::vector<PushPlan> RouterCore::PlanDrainPush(WorkerId leaving,
                                                std::span<const PushCandidate> candidates,
                                                int64_t budget_blocks) {
  std::vector<PushPlan> plan;
  std::lock_guard lock(mu_);
  if (leaving >= workers_.size() || !workers_[leaving]) return plan;
  FlushPendingLocked();
  std::vector<WorkerId> survivors;
  for (const auto& w : workers_) {
    if (w && !w->draining && w->role != Role::kPrefill && w->id != leaving &&
        !StalledLocked(*w, options_.clock_us())) {
      survivors.push_back(w->id);
    }
  }
  if (survivors.empty()) return plan;
  const int64_t now = options_.clock_us();
  std::vector<uint32_t> overlap;
  // Blocks already promised to each survivor by this plan (they take room).
  std::vector<int64_t> promised(workers_.size(), 0);
  size_t turn = 0;
  for (size_t i = 0; i < candidates.size() && budget_blocks > 0; ++i) {
    const auto hashes = candidates[i].hashes;
    if (hashes.empty()) continue;
    OverlapLocked(hashes, now, &overlap);
    if (overlap[leaving] < hashes.size()) continue;  // evicted meanwhile
    std::optional<PushPlan> best;
    int64_t best_price = 0;
    const double keep =
        static_cast<double>(candidates[i].uses) / static_cast<double>(candidates[i].uses + 1);
    for (size_t k = 0; k < survivors.size(); ++k) {
      const WorkerId t = survivors[(turn + k) % survivors.size()];
      const int64_t missing = static_cast<int64_t>(hashes.size() - overlap[t]);
      if (missing == 0 || missing > budget_blocks) continue;
      const Worker& w = *workers_[t];
      int64_t price = 0;
      if (governor_) {
        CopyGovernor::Quote q;
        q.receiver.worker = t;
        q.receiver.capacity_blocks = w.has_report ? w.reported.total_blocks : 0;
        q.receiver.held_blocks = static_cast<int64_t>(index_.WorkerBlockCount(t)) + promised[t];
        q.receiver.queued_tokens = std::max(w.inflight_prefill_tokens,
                                            w.has_report ? w.reported.queued_prefill_tokens : 0);
        q.blocks = missing;
        q.tokens = missing * options_.block_tokens;
        if (!governor_->PushFits(leaving, q, keep)) continue;
        price = q.price.link_wait + q.price.pressure;
      }
      if (!best || price < best_price) {
        best = PushPlan{i, t, missing};
        best_price = price;
      }
    }
    if (!best) continue;
    turn = (turn + 1) % survivors.size();
    promised[best->target] += best->blocks;
    budget_blocks -= best->blocks;
    if (options_.pending_ttl_us > 0) {
      AddPendingLocked(best->target, hashes, now, now + options_.pending_ttl_us);
    }
    plan.push_back(*best);
  }
  return plan;
}

void RouterCore::ReleaseLocked(Inflight& r, bool prefill_only) {
  if (!r.prefill_done) {
    if (workers_[r.prefiller]) {
      workers_[r.prefiller]->inflight_prefill_tokens -= r.prefill_tokens;
      workers_[r.prefiller]->inflight_prefill_requests -= 1;
    }
    r.prefill_done = true;
  }
  if (prefill_only) return;
  if (workers_[r.decode]) {
    workers_[r.decode]->inflight_requests -= 1;
    workers_[r.decode]->inflight_decode_tokens -= r.decode_tokens;
  }
}

void RouterCore::OnCopyLanded(uint64_t request_id) {
  if (governor_) governor_->OnLanded(request_id);
}

void RouterCore::OnPrefillDone(uint64_t request_id) {
  if (governor_) governor_->OnLanded(request_id);
  std::lock_guard lock(mu_);
  auto it = inflight_.find(request_id);
  if (it != inflight_.end()) ReleaseLocked(it->second, /*prefill_only=*/true);
}

void RouterCore::OnRequestFinished(uint64_t request_id) {
  if (governor_) governor_->OnLanded(request_id);
  std::lock_guard lock(mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end()) return;
  ReleaseLocked(it->second, /*prefill_only=*/false);
  inflight_.erase(it);
}

bool RouterCore::StalledLocked(const Worker& w, int64_t now_us) const {
  return options_.worker_stall_us > 0 && w.has_report &&
         now_us - w.last_report_us > options_.worker_stall_us;
}

std::vector<WorkerView> RouterCore::Workers() const {
  std::vector<WorkerView> out;
  std::lock_guard lock(mu_);
  const int64_t now = options_.clock_us();
  for (const auto& w : workers_) {
    if (!w) continue;
    WorkerView v;
    v.id = w->id;
    v.name = w->name;
    v.role = w->role;
    v.max_model_len = w->max_model_len;
    v.needs_resync = index_.NeedsResync(w->id);
    v.draining = w->draining;
    v.stalled = StalledLocked(*w, now);
    v.indexed_blocks = index_.WorkerBlockCount(w->id);
    v.reported = w->reported;
    v.inflight_requests = w->inflight_requests;
    v.inflight_prefill_tokens = w->inflight_prefill_tokens;
    v.inflight_decode_tokens = w->inflight_decode_tokens;
    out.push_back(std::move(v));
  }
  return out;
}

int64_t RouterCore::MaxModelLen() const {
  std::lock_guard lock(mu_);
  int64_t longest = 0;
  for (const auto& w : workers_) {
    if (!w || w->draining || w->role == Role::kPrefill) continue;
    if (w->max_model_len == 0) return 0;
    longest = std::max(longest, w->max_model_len);
  }
  return longest;
}

RouterStats RouterCore::stats() const {
  RouterStats s;
  {
    std::lock_guard lock(mu_);
    s = counters_;
  }
  if (governor_) s.copy = governor_->stats();
  s.index = index_.stats();
  return s;
}

}  // namespace pdserve::router
