#include "services/router/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <list>
#include <queue>
#include <span>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

#include "services/router/sim_kv_cache.h"

namespace pdserve::router {
namespace {

int64_t BlocksFor(int64_t tokens, int64_t block_tokens) {
  return (tokens + block_tokens - 1) / block_tokens;
}

// Prompt tokens covered by the first `blocks` blocks (the last may be partial).
int64_t TokensOfLeadingBlocks(const TraceRequest& r, int64_t blocks, int64_t block_tokens) {
  return std::min(blocks * block_tokens, r.input_length);
}

constexpr int64_t kMaxTraceTokens = 10'000'000;

StatusOr<int64_t> GetCount(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) {
    return Status::InvalidArgument(where + ": '" + key + "' missing or not an integer");
  }
  const int64_t v = it->get<int64_t>();
  if (v < 0) return Status::InvalidArgument(where + ": '" + key + "' is negative");
  // Lengths past any context (a trace's timestamps may be epoch
  // milliseconds, so they are not bounded).
  if (std::string_view(key) != "timestamp" && v > kMaxTraceTokens) {
    return Status::InvalidArgument(where + ": '" + key + "' is past " +
                                   std::to_string(kMaxTraceTokens) + " tokens");
  }
  return v;
}

enum class EventType {
  kArrival,
  kWorkerDone,
  kDeliver,
  kLoadReport,
  kCopyDone,
  kRemove,
  kOnloadDone
};

struct Event {
  double time;
  uint64_t order;  // FIFO among equal times: keeps event batches in sequence
  EventType type;
  size_t index;  // request (arrival, onload), worker (done, deliver) or copy
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : order > o.order; }
};

class SimWorker {
 public:
  SimWorker(WorkerId id, const SimOptions& o)
      : cache(o.capacity_blocks, o.host_capacity_blocks, o.disk_capacity_blocks), id_(id) {}

  WorkerId id() const { return id_; }

  // Leading blocks of `r` in the device pool.
  int64_t CachedPrefix(const TraceRequest& r) const { return cache.DevicePrefix(r.hash_ids); }

  struct Running {
    size_t request;
    int64_t remaining;
  };
  enum class Action { kIdle, kPrefill, kDecode };

  SimKvCache cache;
  std::deque<size_t> queue;  // waiting for admission
  std::deque<size_t> ready;  // admitted (lower-tier blocks back), waiting for prefill
  std::vector<Running> running;
  Action action = Action::kIdle;
  size_t current = 0;               // request being prefilled
  uint64_t seq = 0;                 // last KV event batch number
  std::deque<KvEventBatch> outbox;  // batches on their way to the router
  int64_t work = 0;
  int64_t routed = 0;
  double link_free_at = 0;       // when its KV copy link is next idle
  double tier_link_free_at = 0;  // when its tier mover is next idle
  bool draining = false;
  bool removed = false;
  // Copied blocks no later request has hit yet (-> the copy's request).
  std::unordered_map<uint64_t, size_t> copied_unused;
  int64_t copies_out = 0;     // copies from it not landed yet
  int64_t loading = 0;        // requests waiting for their lower-tier blocks
  std::deque<size_t> recent;  // requests admitted, most recent last

 private:
  WorkerId id_;
};

struct Copy {
  size_t request;
  size_t source;
  size_t target;
  int64_t blocks;  // leading blocks of the prompt the target holds once it lands
  bool push;       // a drain push (no request waits for it)
};

constexpr size_t kRecentRequests = 4096;

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

Status CheckTimes(const SimOptions& o) {
  if (o.workers <= 0) return Status::InvalidArgument("workers must be positive");
  if (o.workers > 1024) return Status::InvalidArgument("at most 1024 simulated workers");
  if (o.capacity_blocks <= 0 || o.capacity_blocks > (int64_t{1} << 40)) {
    return Status::InvalidArgument("capacity-blocks must be in [1, 2^40]");
  }
  if (o.block_tokens <= 0) return Status::InvalidArgument("block-tokens must be positive");
  // Bounded so that a prompt's prefill or copy lasts simulated seconds, not
  // ages: the simulated clock advances in load-report ticks.
  if (!(o.prefill_tokens_per_s >= 1) || !(o.prefill_tokens_per_s <= 1e9)) {
    return Status::InvalidArgument("prefill rate must be in [1, 1e9] tokens/s");
  }
  if (!(o.kv_bytes_per_token > 0) || !(o.kv_bytes_per_token <= 1e8) || !(o.copy_gbps >= 1e-3) ||
      !(o.copy_gbps <= 1e6)) {
    return Status::InvalidArgument(
        "KV bytes per token must be in (0, 1e8] and copy bandwidth in [0.001, 1e6] GB/s");
  }
  for (double v : {o.pending_ttl_s, o.prefill_overhead_s, o.decode_step_s, o.decode_step_per_seq_s,
                   o.event_delay_s}) {
    if (!(v >= 0) || !(v <= 86400)) {
      return Status::InvalidArgument(
          "simulated times (pending TTL, prefill overhead, decode steps, event delay) must be "
          "in [0, 1 day]");
    }
  }
  if (o.replication_min_requests < 1 || o.replication_min_requests > kMaxCopyMinRequests) {
    return Status::InvalidArgument("replication-min-requests must be in [1, " +
                                   std::to_string(kMaxCopyMinRequests) + "]");
  }
  if (!(o.replication_window_s >= 1e-3) || !(o.replication_window_s <= 86400)) {
    return Status::InvalidArgument("replication-window-s must be in [0.001, 86400]");
  }
  if (o.replication_max_inflight < 0 || !(o.replication_max_copy_tokens_per_s >= 0) ||
      !std::isfinite(o.replication_max_copy_tokens_per_s)) {
    return Status::InvalidArgument(
        "replication-max-inflight and replication-max-copy-tokens-per-s must not be negative");
  }
  if (!(o.time_scale > 0) || !std::isfinite(o.time_scale)) {
    return Status::InvalidArgument("time scale must be finite and positive");
  }
  if (o.remove_at_s >= 0 && (o.remove_worker < -1 || o.remove_worker >= o.workers)) {
    return Status::InvalidArgument(
        "the worker to remove must be one of the simulated workers (or -1: none)");
  }
  if (o.host_capacity_blocks < 0 || o.disk_capacity_blocks < 0) {
    return Status::InvalidArgument("tier capacities must not be negative");
  }
  for (double v : {o.host_onload_gbps, o.disk_onload_gbps}) {
    if (!(v >= 1e-3) || !(v <= 1e6)) {
      return Status::InvalidArgument("onload bandwidths must be in [0.001, 1e6] GB/s");
    }
  }
  for (double v : {o.host_onload_latency_s, o.disk_onload_latency_s}) {
    if (!(v >= 0) || !(v <= 86400)) {
      return Status::InvalidArgument("onload latencies must be in [0, 1 day]");
    }
  }
  if (o.drain_push_blocks < 0 || !(o.after_removal_s > 0)) {
    return Status::InvalidArgument(
        "drain push budget must not be negative and the after-removal window must be positive");
  }
  if (!(o.load_report_interval_s >= 1e-3) || !std::isfinite(o.load_report_interval_s)) {
    return Status::InvalidArgument("load report interval must be at least 1 ms");
  }
  return Status::Ok();
}

class Simulation {
 public:
  Simulation(const std::vector<TraceRequest>& trace, const SimOptions& o, RouterCore* core)
      : trace_(trace),
        o_(o),
        core_(core),
        ttft_(trace.size(), 0),
        copied_of_(trace.size(), 0),
        copy_end_of_(trace.size(), 0),
        landed_at_(trace.size(), -1),
        hit_of_(trace.size(), 0),
        computed_of_(trace.size(), 0),
        worker_of_(trace.size(), 0),
        to_store_of_(trace.size()) {}

  Status Init() {
    for (int64_t i = 0; i < o_.workers; ++i) {
      auto id = core_->AddWorker("sim-" + std::to_string(i), Role::kBoth);
      if (!id.ok()) return id.status();
      PDSERVE_RETURN_IF_ERROR(core_->OnSnapshot(*id, 0, {}));  // empty caches
      by_id_.emplace(*id, workers_.size());
      workers_.emplace_back(*id, o_);
    }
    return Status::Ok();
  }

  double now() const { return now_; }

  Status Run(const SimProgress& progress) {
    arrival_times_.clear();
    for (size_t i = 0; i < trace_.size(); ++i) {
      Push(ArrivalTime(i), EventType::kArrival, i);
      arrival_times_.push_back(ArrivalTime(i));
    }
    std::sort(arrival_times_.begin(), arrival_times_.end());
    Push(0, EventType::kLoadReport, 0);
    if (o_.remove_at_s >= 0 && o_.remove_worker >= 0) {
      Push(o_.remove_at_s, EventType::kRemove, static_cast<size_t>(o_.remove_worker));
    }
    const size_t progress_every = std::max<size_t>(1, trace_.size() / 10);
    size_t arrived = 0;
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      now_ = e.time;
      switch (e.type) {
        case EventType::kArrival:
          PDSERVE_RETURN_IF_ERROR(Arrive(e.index));
          if (++arrived % progress_every == 0 && progress) progress(arrived, trace_.size());
          arrived_ = arrived;
          break;
        case EventType::kWorkerDone:
          Finish(workers_[e.index]);
          Kick(workers_[e.index]);
          TryLeave(workers_[e.index]);
          break;
        case EventType::kRemove:
          StartDrain(workers_[e.index]);
          break;
        case EventType::kDeliver: {
          SimWorker& w = workers_[e.index];
          if (w.removed) {  // its index entries are gone with it
            w.outbox.pop_front();
            break;
          }
          const ApplyOutcome outcome = core_->OnKvEvents(w.id(), w.outbox.front());
          w.outbox.pop_front();
          if (outcome != ApplyOutcome::kApplied) {
            return Status::Internal(std::string("simulated KV events were not applied: ") +
                                    ApplyOutcomeName(outcome));
          }
          break;
        }
        case EventType::kCopyDone:
          Land(copies_[e.index]);
          break;
        case EventType::kOnloadDone: {
          SimWorker& w = workers_[worker_of_[e.index]];
          --w.loading;
          w.ready.push_back(e.index);
          Kick(w);
          break;
        }
        case EventType::kLoadReport: {
          ReportLoad();
          if (finished_ >= trace_.size()) break;
          double next = now_ + o_.load_report_interval_s;
          // Idle (every arrived request finished) and reported so once:
          // nothing changes until the next arrival, however far (a trace in
          // epoch milliseconds starts decades in).
          // (Not with a worker removal in the run: its drain pushes copies
          // that no request accounts for.)
          const bool idle = finished_ == arrived_ && o_.remove_at_s < 0;
          if (idle && idle_reported_ && arrived_ < arrival_times_.size()) {
            next = std::max(next, arrival_times_[arrived_]);
          }
          idle_reported_ = idle;
          Push(next, EventType::kLoadReport, 0);
          break;
        }
      }
    }
    return Status::Ok();
  }

  SimResult Result() const {
    SimResult r;
    r.requests = static_cast<int64_t>(trace_.size());
    r.prompt_tokens = prompt_tokens_;
    r.hit_tokens = hit_tokens_;
    r.host_hit_tokens = host_hit_tokens_;
    r.disk_hit_tokens = disk_hit_tokens_;
    r.predicted_hit_tokens = predicted_hit_tokens_;
    r.predicted_host_hit_tokens = predicted_host_hit_tokens_;
    r.predicted_disk_hit_tokens = predicted_disk_hit_tokens_;
    r.onloads = onloads_;
    r.onload_bytes = onload_bytes_;
    r.onload_wait_mean_s = onloads_ > 0 ? onload_wait_s_ / static_cast<double>(onloads_) : 0.0;
    r.oracle_hit_tokens = OracleHitTokens(trace_, o_.block_tokens);
    const double total = std::max<double>(1, static_cast<double>(prompt_tokens_));
    r.hit_rate = static_cast<double>(hit_tokens_) / total;
    r.oracle_hit_rate = static_cast<double>(r.oracle_hit_tokens) / total;
    r.predicted_hit_rate = static_cast<double>(predicted_hit_tokens_) / total;
    r.ttft_p50_s = Percentile(ttft_, 0.50);
    r.ttft_p99_s = Percentile(ttft_, 0.99);
    double sum = 0;
    for (double t : ttft_) sum += t;
    r.ttft_mean_s = ttft_.empty() ? 0 : sum / static_cast<double>(ttft_.size());
    int64_t max_work = 0, total_work = 0;
    for (const SimWorker& w : workers_) {
      r.work.push_back(w.work);
      r.routed.push_back(w.routed);
      max_work = std::max(max_work, w.work);
      total_work += w.work;
    }
    const double mean = static_cast<double>(total_work) / static_cast<double>(workers_.size());
    r.load_imbalance = mean > 0 ? static_cast<double>(max_work) / mean : 1.0;
    r.makespan_s = now_;
    r.index = core_->stats().index;
    r.replications_started = replications_started_;
    r.replications_finished = replications_finished_;
    r.replications_failed = replications_failed_;
    r.copied_tokens = copied_tokens_;
    r.copied_bytes = copied_bytes_;
    r.copy = copy_stats_;
    if (replications_started_ > 0) {
      r.copy.holders_mean = holders_sum_ / static_cast<double>(replications_started_);
    }
    r.router = core_->stats();
    r.removed_at_s = removed_at_s_;
    r.drain_pushed_blocks = drain_pushed_blocks_;
    if (o_.remove_at_s >= 0) {
      int64_t hits = 0, tokens = 0;
      for (size_t i = 0; i < trace_.size(); ++i) {
        const double t = ArrivalTime(i);
        if (t < o_.remove_at_s || t >= o_.remove_at_s + o_.after_removal_s) continue;
        hits += hit_of_[i];
        tokens += trace_[i].input_length;
        ++r.requests_after_removal;
      }
      r.hit_rate_after_removal =
          tokens > 0 ? static_cast<double>(hits) / static_cast<double>(tokens) : 0.0;
    }
    return r;
  }

 private:
  std::vector<double> arrival_times_;  // every request's, ascending
  size_t arrived_ = 0;                 // requests arrived so far
  bool idle_reported_ = false;         // the last load report found no request running

  double ArrivalTime(size_t i) const {
    return static_cast<double>(trace_[i].timestamp_ms) / 1000.0 * o_.time_scale;
  }

  void Push(double time, EventType type, size_t index) {
    events_.push({time, order_++, type, index});
  }

  Status Arrive(size_t i) {
    const TraceRequest& r = trace_[i];
    RouteRequest req;
    req.request_id = i;
    req.block_hashes = std::span<const BlockHash>(r.hash_ids.data(), r.hash_ids.size());
    // The trace's last block may be partial; the router sees whole blocks.
    req.prompt_tokens = std::max<int64_t>(
        r.input_length, static_cast<int64_t>(r.hash_ids.size()) * o_.block_tokens);
    req.max_new_tokens = r.output_length;
    auto decision = core_->Route(req);
    if (!decision.ok()) return decision.status();
    core_->FlushPending();  // as the service does once the request is sent
    const int64_t device = decision->prefill_overlap_blocks;
    const int64_t host = device + decision->prefill_host_blocks;
    const int64_t disk = host + decision->prefill_disk_blocks;
    predicted_hit_tokens_ += TokensOfLeadingBlocks(r, disk, o_.block_tokens);
    predicted_host_hit_tokens_ += TokensOfLeadingBlocks(r, host, o_.block_tokens) -
                                  TokensOfLeadingBlocks(r, device, o_.block_tokens);
    predicted_disk_hit_tokens_ += TokensOfLeadingBlocks(r, disk, o_.block_tokens) -
                                  TokensOfLeadingBlocks(r, host, o_.block_tokens);
    prompt_tokens_ += r.input_length;
    SimWorker& w = workers_[by_id_.at(decision->decode)];
    worker_of_[i] = by_id_.at(decision->decode);
    ++w.routed;
    if (decision->copy_from && StartCopy(i, by_id_.at(*decision->copy_from), by_id_.at(w.id()),
                                         decision->decode_overlap_blocks + decision->copy_blocks)) {
      return Status::Ok();  // queued when the copy lands
    }
    w.queue.push_back(i);
    Kick(w);
    return Status::Ok();
  }

  // Copies the prompt's blocks [target's cached prefix, `blocks`) that the
  // source still holds. False when it holds none of them (a failed copy: the
  // target computes them).
  // `arriving`: leading blocks the target is getting from an earlier push
  // (a drain plan's, on the same links ahead of this one).
  bool StartCopy(size_t i, size_t source, size_t target, int64_t blocks, bool push = false,
                 int64_t arriving = 0) {
    const TraceRequest& r = trace_[i];
    SimWorker& src = workers_[source];
    SimWorker& dst = workers_[target];
    const int64_t have = std::max(dst.CachedPrefix(r), arriving);
    blocks = std::min(blocks, src.CachedPrefix(r));
    if (blocks <= have) {
      if (!push) {
        ++replications_failed_;
        core_->OnCopyLanded(i);
      }
      return false;
    }
    const int64_t tokens = TokensOfLeadingBlocks(r, blocks, o_.block_tokens) -
                           TokensOfLeadingBlocks(r, have, o_.block_tokens);
    const double bytes = static_cast<double>(tokens) * o_.kv_bytes_per_token;
    const double start = std::max({now_, src.link_free_at, dst.link_free_at});
    const double end = start + bytes / (o_.copy_gbps * 1e9);
    src.link_free_at = dst.link_free_at = end;
    ++src.copies_out;
    if (push) {
      drain_pushed_blocks_ += blocks - have;
    } else {
      ++replications_started_;
      copied_bytes_ += bytes;
      copied_tokens_ += tokens;
      copied_of_[i] = tokens;
      copy_end_of_[i] = blocks;
      if (start > now_) {
        ++copy_stats_.link_waits;
        copy_stats_.link_wait_s += start - now_;
      }
      int64_t holders = 0;
      for (size_t k = 0; k < workers_.size(); ++k) {
        if (k != target && !workers_[k].removed && workers_[k].CachedPrefix(r) >= blocks) {
          ++holders;
        }
      }
      holders_sum_ += static_cast<double>(holders);
      if (2 * holders >= static_cast<int64_t>(workers_.size()) - 1) ++copy_stats_.widely_held;
    }
    copies_.push_back({i, source, target, blocks, push});
    Push(end, EventType::kCopyDone, copies_.size() - 1);
    return true;
  }

  // Request i is admitted on w with `device` leading blocks in its pool:
  // copied blocks among them are reused if another request copied them in.
  void NoteCopyUse(SimWorker& w, size_t i, int64_t device) {
    const TraceRequest& r = trace_[i];
    if (landed_at_[i] >= 0) {
      copy_stats_.receiver_wait_s += now_ - landed_at_[i];
      if (device < copy_end_of_[i]) ++copy_stats_.lost_before_use;
    }
    if (w.copied_unused.empty()) return;
    for (int64_t b = 0; b < device; ++b) {
      auto it = w.copied_unused.find(r.hash_ids[static_cast<size_t>(b)]);
      if (it == w.copied_unused.end() || it->second == i) continue;
      ++copy_stats_.reused_blocks;
      w.copied_unused.erase(it);
    }
  }

  // Copied blocks among the device evictions in `changes` leave unused;
  // returns the number of device evictions.
  int64_t NoteEvictions(SimWorker& w, const std::vector<SimKvChange>& changes) {
    int64_t evicted = 0;
    for (const SimKvChange& ch : changes) {
      if (ch.tier != KvTier::kDevice || ch.stored) continue;
      ++evicted;
      if (w.copied_unused.erase(ch.hash) > 0) ++copy_stats_.evicted_unused_blocks;
    }
    return evicted;
  }

  void Land(const Copy& c) {
    SimWorker& dst = workers_[c.target];
    const TraceRequest& r = trace_[c.request];
    std::vector<SimKvChange> changes;
    std::vector<uint64_t> stored;
    dst.cache.Admit(std::span<const uint64_t>(r.hash_ids.data(), static_cast<size_t>(c.blocks)),
                    &changes, &stored);
    const int64_t evicted = NoteEvictions(dst, changes);
    for (uint64_t h : stored) changes.push_back({h, KvTier::kDevice, true});
    Emit(dst, changes);
    --workers_[c.source].copies_out;
    TryLeave(workers_[c.source]);
    if (c.push) return;
    copy_stats_.evicted_blocks += evicted;
    for (const SimKvChange& ch : changes) {
      if (ch.tier == KvTier::kDevice && !ch.stored) evicted_by_copy_.insert(ch.hash);
    }
    copy_stats_.landed_blocks += static_cast<int64_t>(stored.size());
    for (uint64_t h : stored) dst.copied_unused[h] = c.request;
    landed_at_[c.request] = now_;
    core_->OnCopyLanded(c.request);
    ++replications_finished_;
    dst.queue.push_back(c.request);
    Kick(dst);
  }

  // Scale-down: no new requests; with drain_push, the prompts of its most
  // recent requests go to the survivors RouterCore::PlanDrainPush picks,
  // within the block budget.
  void StartDrain(SimWorker& w) {
    w.draining = true;
    core_->SetDraining(w.id(), true);
    const size_t source = by_id_.at(w.id());
    std::vector<size_t> survivors;
    for (size_t k = 0; k < workers_.size(); ++k) {
      if (!workers_[k].draining && !workers_[k].removed) survivors.push_back(k);
    }
    if (o_.drain_push && !survivors.empty()) {
      // Its most recent prompts first, each once (by the last block it still
      // holds), with how often they came lately; RouterCore picks the
      // survivor of each under the copy pressure rule.
      std::vector<size_t> requests;
      std::vector<PushCandidate> candidates;
      std::unordered_map<uint64_t, size_t> seen;  // last held block -> candidate
      for (auto it = w.recent.rbegin(); it != w.recent.rend(); ++it) {
        const TraceRequest& r = trace_[*it];
        const int64_t held = w.CachedPrefix(r);
        if (held == 0) continue;
        auto [found, fresh] =
            seen.emplace(r.hash_ids[static_cast<size_t>(held - 1)], candidates.size());
        if (!fresh) {
          ++candidates[found->second].uses;
          continue;
        }
        requests.push_back(*it);
        candidates.push_back(
            {std::span<const BlockHash>(r.hash_ids.data(), static_cast<size_t>(held)), 1});
      }
      const int64_t budget = o_.drain_push_blocks > 0 ? o_.drain_push_blocks : o_.capacity_blocks;
      for (const PushPlan& p : core_->PlanDrainPush(w.id(), candidates, budget)) {
        const auto blocks = static_cast<int64_t>(candidates[p.candidate].hashes.size());
        StartCopy(requests[p.candidate], source, by_id_.at(p.target), blocks, /*push=*/true,
                  /*arriving=*/blocks - p.blocks);
      }
    }
    TryLeave(w);
  }

  // A draining worker leaves once idle with every copy from it landed.
  void TryLeave(SimWorker& w) {
    if (!w.draining || w.removed || w.action != SimWorker::Action::kIdle || !w.queue.empty() ||
        !w.ready.empty() || w.loading > 0 || !w.running.empty() || w.copies_out > 0) {
      return;
    }
    w.removed = true;
    removed_at_s_ = now_;
    (void)core_->RemoveWorker(w.id());
  }

  // One batch of `changes`, runs of the same tier and direction as one event.
  void Emit(SimWorker& w, const std::vector<SimKvChange>& changes) {
    if (changes.empty()) return;
    KvEventBatch batch;
    batch.sequence_number = ++w.seq;
    for (size_t i = 0; i < changes.size();) {
      size_t j = i;
      std::vector<BlockHash> hashes;
      while (j < changes.size() && changes[j].tier == changes[i].tier &&
             changes[j].stored == changes[i].stored) {
        hashes.push_back(changes[j++].hash);
      }
      if (changes[i].stored) {
        batch.events.emplace_back(KvStored{std::move(hashes), std::nullopt, changes[i].tier});
      } else {
        batch.events.emplace_back(KvRemoved{std::move(hashes), changes[i].tier});
      }
      i = j;
    }
    w.outbox.push_back(std::move(batch));
    Push(now_ + o_.event_delay_s, EventType::kDeliver, by_id_.at(w.id()));
  }

  // Takes a queued request into the worker's cache: its device prefix and
  // the lower-tier run after it are served, the rest is to be computed.
  // False when it first waits for its lower-tier blocks (kOnloadDone).
  bool Admit(SimWorker& w, size_t i) {
    const TraceRequest& r = trace_[i];
    const int64_t device = w.cache.DevicePrefix(r.hash_ids);
    const SimLowerRun lower = w.cache.LowerRun(r.hash_ids, device);
    NoteCopyUse(w, i, device);
    std::vector<SimKvChange> changes;
    w.cache.Admit(r.hash_ids, &changes, &to_store_of_[i]);
    NoteEvictions(w, changes);
    for (uint64_t h : to_store_of_[i]) {
      if (evicted_by_copy_.erase(h) > 0) ++copy_stats_.evicted_recomputed_blocks;
    }
    Emit(w, changes);
    const int64_t served_blocks = device + lower.blocks();
    const int64_t served = TokensOfLeadingBlocks(r, served_blocks, o_.block_tokens);
    const int64_t host = TokensOfLeadingBlocks(r, device + lower.host, o_.block_tokens) -
                         TokensOfLeadingBlocks(r, device, o_.block_tokens);
    const int64_t disk = served - TokensOfLeadingBlocks(r, device + lower.host, o_.block_tokens);
    // Blocks this request had copied in are not cache hits.
    hit_of_[i] = std::max<int64_t>(0, served - copied_of_[i]);
    hit_tokens_ += hit_of_[i];
    host_hit_tokens_ += host;
    disk_hit_tokens_ += disk;
    computed_of_[i] = r.input_length - served;
    w.work += computed_of_[i];
    w.recent.push_back(i);
    if (w.recent.size() > kRecentRequests) w.recent.pop_front();
    if (lower.blocks() == 0) return true;
    // The worker's tier mover copies the blocks back, one at a time; its
    // prefill and decode steps go on meanwhile.
    const double seconds =
        static_cast<double>(lower.host) * o_.host_onload_latency_s +
        static_cast<double>(host) * o_.kv_bytes_per_token / (o_.host_onload_gbps * 1e9) +
        static_cast<double>(lower.disk) * o_.disk_onload_latency_s +
        static_cast<double>(disk) * o_.kv_bytes_per_token / (o_.disk_onload_gbps * 1e9);
    const double end = std::max(now_, w.tier_link_free_at) + seconds;
    w.tier_link_free_at = end;
    ++onloads_;
    onload_bytes_ += static_cast<double>(host + disk) * o_.kv_bytes_per_token;
    onload_wait_s_ += end - now_;
    ++w.loading;
    Push(end, EventType::kOnloadDone, i);
    return false;
  }

  // Starts the worker's next action if it is idle: admits queued requests
  // until one is ready (those waiting for onloads step aside), prefills the
  // oldest ready one, else runs a decode step.
  void Kick(SimWorker& w) {
    if (w.action != SimWorker::Action::kIdle) return;
    const size_t wi = by_id_.at(w.id());
    while (w.ready.empty() && !w.queue.empty()) {
      const size_t i = w.queue.front();
      w.queue.pop_front();
      if (Admit(w, i)) w.ready.push_back(i);
    }
    if (!w.ready.empty()) {
      const size_t i = w.ready.front();
      w.ready.pop_front();
      w.action = SimWorker::Action::kPrefill;
      w.current = i;
      Push(now_ + o_.prefill_overhead_s +
               static_cast<double>(computed_of_[i]) / o_.prefill_tokens_per_s,
           EventType::kWorkerDone, wi);
    } else if (!w.running.empty()) {
      w.action = SimWorker::Action::kDecode;
      Push(now_ + o_.decode_step_s +
               o_.decode_step_per_seq_s * static_cast<double>(w.running.size()),
           EventType::kWorkerDone, wi);
    }
  }

  void Finish(SimWorker& w) {
    if (w.action == SimWorker::Action::kPrefill) {
      const size_t i = w.current;
      ttft_[i] = now_ - ArrivalTime(i);
      std::vector<SimKvChange> stored;
      for (uint64_t h : to_store_of_[i]) stored.push_back({h, KvTier::kDevice, true});
      Emit(w, stored);
      to_store_of_[i] = {};
      core_->OnPrefillDone(i);
      const int64_t out = trace_[i].output_length;
      if (out > 0) w.work += 1;  // the first token comes with the prefill
      if (out > 1) {
        w.running.push_back({i, out - 1});
      } else {
        Done(i);
      }
    } else if (w.action == SimWorker::Action::kDecode) {
      w.work += static_cast<int64_t>(w.running.size());
      for (auto& run : w.running) {
        if (--run.remaining == 0) Done(run.request);
      }
      std::erase_if(w.running, [](const SimWorker::Running& run) { return run.remaining == 0; });
    }
    w.action = SimWorker::Action::kIdle;
  }

  void Done(size_t i) {
    core_->OnRequestFinished(i);
    ++finished_;
  }

  void ReportLoad() {
    for (SimWorker& w : workers_) {
      WorkerLoad load;
      for (size_t i : w.queue) {
        const TraceRequest& r = trace_[i];
        const int64_t device = w.CachedPrefix(r);
        const int64_t served = device + w.cache.LowerRun(r.hash_ids, device).blocks();
        load.queued_prefill_tokens +=
            r.input_length - TokensOfLeadingBlocks(r, served, o_.block_tokens);
      }
      for (size_t i : w.ready) load.queued_prefill_tokens += computed_of_[i];
      int64_t used_blocks = 0;
      for (const auto& run : w.running) {
        const TraceRequest& r = trace_[run.request];
        used_blocks += BlocksFor(r.input_length + r.output_length - run.remaining, o_.block_tokens);
      }
      load.running = static_cast<int64_t>(w.running.size());
      load.waiting = static_cast<int64_t>(w.queue.size() + w.ready.size());
      load.total_blocks = o_.capacity_blocks;
      load.free_blocks = std::max<int64_t>(0, o_.capacity_blocks - used_blocks);
      (void)core_->OnLoad(w.id(), load);
    }
  }

  const std::vector<TraceRequest>& trace_;
  const SimOptions& o_;
  RouterCore* core_;
  std::vector<SimWorker> workers_;
  std::unordered_map<WorkerId, size_t> by_id_;
  std::priority_queue<Event, std::vector<Event>, std::greater<Event>> events_;
  uint64_t order_ = 0;
  double now_ = 0;
  size_t finished_ = 0;
  std::vector<double> ttft_;
  int64_t prompt_tokens_ = 0;
  int64_t hit_tokens_ = 0;
  int64_t host_hit_tokens_ = 0;
  int64_t disk_hit_tokens_ = 0;
  int64_t predicted_hit_tokens_ = 0;
  int64_t predicted_host_hit_tokens_ = 0;
  int64_t predicted_disk_hit_tokens_ = 0;
  int64_t onloads_ = 0;
  double onload_bytes_ = 0;
  double onload_wait_s_ = 0;
  std::vector<int64_t> copied_of_;    // per request: tokens copied in for it
  std::vector<int64_t> copy_end_of_;  // per request: leading blocks held once its copy landed
  std::vector<double> landed_at_;     // per request: when its copy landed (-1: none)
  SimCopyStats copy_stats_;
  std::unordered_set<uint64_t> evicted_by_copy_;  // by a landing, not computed again since
  double holders_sum_ = 0;
  std::vector<int64_t> hit_of_;       // per request: cache hit tokens (any tier)
  std::vector<int64_t> computed_of_;  // per request: prompt tokens its worker computes
  std::vector<size_t> worker_of_;     // per request: the worker it was routed to
  std::vector<std::vector<uint64_t>>
      to_store_of_;  // its new device blocks, announced when computed
  double removed_at_s_ = -1;
  int64_t drain_pushed_blocks_ = 0;
  std::vector<Copy> copies_;
  int64_t replications_started_ = 0;
  int64_t replications_finished_ = 0;
  int64_t replications_failed_ = 0;
  int64_t copied_tokens_ = 0;
  double copied_bytes_ = 0;
};

}  // namespace

StatusOr<std::vector<TraceRequest>> ParseMooncakeTrace(std::istream& in, int64_t block_tokens,
                                                       const std::string& source_name) {
  if (block_tokens <= 0) return Status::InvalidArgument("block-tokens must be positive");
  std::vector<TraceRequest> out;
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = source_name + ":" + std::to_string(line_no);
    nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return Status::InvalidArgument(where + ": not a JSON object");
    }
    TraceRequest r;
    auto ts = GetCount(j, "timestamp", where);
    if (!ts.ok()) return ts.status();
    auto in_len = GetCount(j, "input_length", where);
    if (!in_len.ok()) return in_len.status();
    auto out_len = GetCount(j, "output_length", where);
    if (!out_len.ok()) return out_len.status();
    r.timestamp_ms = *ts;
    r.input_length = *in_len;
    r.output_length = *out_len;
    auto ids = j.find("hash_ids");
    if (ids == j.end() || !ids->is_array()) {
      return Status::InvalidArgument(where + ": 'hash_ids' missing or not an array");
    }
    r.hash_ids.reserve(ids->size());
    for (const auto& id : *ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0) {
        return Status::InvalidArgument(where + ": 'hash_ids' holds a non-integer or negative id");
      }
      r.hash_ids.push_back(id.get<uint64_t>());
    }
    const int64_t expected = BlocksFor(r.input_length, block_tokens);
    if (static_cast<int64_t>(r.hash_ids.size()) != expected) {
      return Status::InvalidArgument(
          where + ": " + std::to_string(r.hash_ids.size()) + " hash_ids for " +
          std::to_string(r.input_length) + " tokens, expected " + std::to_string(expected) +
          " at " + std::to_string(block_tokens) + " tokens per block (wrong --block-tokens?)");
    }
    out.push_back(std::move(r));
  }
  if (in.bad()) return Status::InvalidArgument(source_name + ": read error");
  std::stable_sort(out.begin(), out.end(), [](const TraceRequest& a, const TraceRequest& b) {
    return a.timestamp_ms < b.timestamp_ms;
  });
  return out;
}

StatusOr<std::vector<TraceRequest>> LoadMooncakeTrace(const std::string& path,
                                                      int64_t block_tokens) {
  std::ifstream in(path);
  if (!in) return Status::NotFound(path + ": cannot open trace file");
  return ParseMooncakeTrace(in, block_tokens, path);
}

Status ValidateSimOptions(const SimOptions& options) {
  PDSERVE_RETURN_IF_ERROR(CheckTimes(options));
  auto policy = MakePolicy(options.policy, options.policy_options);
  return policy.ok() ? Status::Ok() : policy.status();
}

int64_t OracleHitTokens(const std::vector<TraceRequest>& trace, int64_t block_tokens) {
  std::unordered_set<uint64_t> seen;
  int64_t hits = 0;
  for (const TraceRequest& r : trace) {
    int64_t n = 0;
    while (n < static_cast<int64_t>(r.hash_ids.size()) && seen.contains(r.hash_ids[n])) ++n;
    hits += TokensOfLeadingBlocks(r, n, block_tokens);
    seen.insert(r.hash_ids.begin(), r.hash_ids.end());
  }
  return hits;
}

StatusOr<SimResult> RunSimulation(const std::vector<TraceRequest>& trace, const SimOptions& options,
                                  const SimProgress& progress) {
  PDSERVE_RETURN_IF_ERROR(ValidateSimOptions(options));
  RouterOptions ro;
  ro.policy = options.policy;
  ro.policy_options = options.policy_options;
  ro.block_tokens = options.block_tokens;
  ro.pending_ttl_us = static_cast<int64_t>(options.pending_ttl_s * 1e6);
  // Replication is part of pdserve's kv policy; the anchors have none.
  if (options.replication && options.policy == "kv") {
    ro.copy_cost =
        options.prefill_tokens_per_s * options.kv_bytes_per_token / (options.copy_gbps * 1e9);
    ro.copy_min_requests = options.replication_min_requests;
    ro.copy_window_us = static_cast<int64_t>(options.replication_window_s * 1e6);
    ro.copy_max_inflight = options.replication_max_inflight;
    ro.copy_max_tokens_per_s = options.replication_max_copy_tokens_per_s;
  }
  ro.drain_push = options.drain_push && options.remove_at_s >= 0;
  ro.index.max_workers = static_cast<size_t>(options.workers);
  // Room for every worker's cache plus the blocks announced while in flight.
  ro.index.max_entries = static_cast<size_t>(options.workers * options.capacity_blocks * 2);
  // The simulated caches announce their stored blocks without parents (and
  // runs of several requests as one): the index walks every prompt.
  ro.index.chained_parents = false;
  // Its cache model reuses a trace request's blocks whole (the last one too).
  ro.reuse_stops_before_last_token = false;
  const Simulation* clock_source = nullptr;
  ro.clock_us = [&clock_source] {
    return clock_source ? static_cast<int64_t>(clock_source->now() * 1e6) : 0;
  };
  auto core = RouterCore::Create(std::move(ro));
  if (!core.ok()) return core.status();
  Simulation sim(trace, options, core->get());
  clock_source = &sim;
  PDSERVE_RETURN_IF_ERROR(sim.Init());
  PDSERVE_RETURN_IF_ERROR(sim.Run(progress));
  SimResult result = sim.Result();
  const PolicyOptions& used = (*core)->options().policy_options;
  result.load_weight = *used.load_weight;
  result.decode_weight = *used.decode_weight;
  result.relief_decisions = static_cast<int64_t>((*core)->stats().relief_decisions);
  return result;
}

}  // namespace pdserve::router
