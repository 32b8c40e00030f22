#include "services/router/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <fstream>
#include <list>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include <nlohmann/json.hpp>

namespace pdserve::router {
namespace {

int64_t BlocksFor(int64_t tokens, int64_t block_tokens) {
  return (tokens + block_tokens - 1) / block_tokens;
}

// Prompt tokens covered by the first `blocks` blocks (the last may be partial).
int64_t TokensOfLeadingBlocks(const TraceRequest& r, int64_t blocks, int64_t block_tokens) {
  return std::min(blocks * block_tokens, r.input_length);
}

StatusOr<int64_t> GetCount(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer()) {
    return Status::InvalidArgument(where + ": '" + key + "' missing or not an integer");
  }
  const int64_t v = it->get<int64_t>();
  if (v < 0) return Status::InvalidArgument(where + ": '" + key + "' is negative");
  return v;
}

enum class EventType { kArrival, kWorkerDone, kDeliver, kLoadReport };

struct Event {
  double time;
  uint64_t order;  // FIFO among equal times: keeps event batches in sequence
  EventType type;
  size_t index;  // request (arrival) or worker (done, deliver)
  bool operator>(const Event& o) const { return time != o.time ? time > o.time : order > o.order; }
};

class SimWorker {
 public:
  SimWorker(WorkerId id, int64_t capacity) : id_(id), capacity_(capacity) {}

  WorkerId id() const { return id_; }

  // Leading blocks of `r` cached here.
  int64_t CachedPrefix(const TraceRequest& r) const {
    int64_t n = 0;
    for (uint64_t h : r.hash_ids) {
      if (!where_.contains(h)) break;
      ++n;
    }
    return n;
  }

  // Admits `r` into the cache: touches the hit prefix, inserts the rest so
  // that earlier blocks end up more recent, evicts from the LRU end. Appends
  // evicted and newly stored hashes.
  int64_t Admit(const TraceRequest& r, std::vector<uint64_t>* evicted,
                std::vector<uint64_t>* stored) {
    const int64_t hits = CachedPrefix(r);
    for (size_t i = r.hash_ids.size(); i-- > 0;) {
      const uint64_t h = r.hash_ids[i];
      auto it = where_.find(h);
      if (it != where_.end()) {
        lru_.splice(lru_.begin(), lru_, it->second);
      } else {
        lru_.push_front(h);
        where_.emplace(h, lru_.begin());
        stored->push_back(h);
      }
    }
    while (static_cast<int64_t>(lru_.size()) > capacity_) {
      const uint64_t victim = lru_.back();
      lru_.pop_back();
      where_.erase(victim);
      evicted->push_back(victim);
    }
    // A block stored and evicted by the same admission (a prompt larger than
    // the cache) is reported as neither.
    if (!evicted->empty()) {
      std::unordered_set<uint64_t> gone(evicted->begin(), evicted->end());
      std::erase_if(*stored, [&](uint64_t h) {
        if (!gone.contains(h)) return false;
        std::erase(*evicted, h);
        return true;
      });
    }
    std::reverse(stored->begin(), stored->end());  // prompt order
    return hits;
  }

  struct Running {
    size_t request;
    int64_t remaining;
  };
  enum class Action { kIdle, kPrefill, kDecode };

  std::deque<size_t> queue;  // waiting for prefill
  std::vector<Running> running;
  Action action = Action::kIdle;
  size_t current = 0;               // request being prefilled
  std::vector<uint64_t> to_store;   // its new blocks, announced when it ends
  uint64_t seq = 0;                 // last KV event batch number
  std::deque<KvEventBatch> outbox;  // batches on their way to the router
  int64_t work = 0;
  int64_t routed = 0;

 private:
  WorkerId id_;
  int64_t capacity_;
  std::list<uint64_t> lru_;  // front = most recent
  std::unordered_map<uint64_t, std::list<uint64_t>::iterator> where_;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * static_cast<double>(v.size())));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

Status CheckTimes(const SimOptions& o) {
  if (o.workers <= 0) return Status::InvalidArgument("workers must be positive");
  if (o.workers > 1024) return Status::InvalidArgument("at most 1024 simulated workers");
  if (o.capacity_blocks <= 0) return Status::InvalidArgument("capacity-blocks must be positive");
  if (o.block_tokens <= 0) return Status::InvalidArgument("block-tokens must be positive");
  if (!(o.prefill_tokens_per_s > 0)) {
    return Status::InvalidArgument("prefill rate must be positive");
  }
  for (double v : {o.pending_ttl_s, o.prefill_overhead_s, o.decode_step_s, o.decode_step_per_seq_s,
                   o.event_delay_s}) {
    if (!(v >= 0) || !std::isfinite(v)) {
      return Status::InvalidArgument("simulated times must be finite and non-negative");
    }
  }
  if (!(o.load_report_interval_s > 0)) {
    return Status::InvalidArgument("load report interval must be positive");
  }
  return Status::Ok();
}

class Simulation {
 public:
  Simulation(const std::vector<TraceRequest>& trace, const SimOptions& o, RouterCore* core)
      : trace_(trace), o_(o), core_(core), ttft_(trace.size(), 0) {}

  Status Init() {
    for (int64_t i = 0; i < o_.workers; ++i) {
      auto id = core_->AddWorker("sim-" + std::to_string(i), WorkerRole::kBoth);
      if (!id.ok()) return id.status();
      PDSERVE_RETURN_IF_ERROR(core_->OnSnapshot(*id, 0, {}));  // empty caches
      by_id_.emplace(*id, workers_.size());
      workers_.emplace_back(*id, o_.capacity_blocks);
    }
    return Status::Ok();
  }

  double now() const { return now_; }

  Status Run(const SimProgress& progress) {
    for (size_t i = 0; i < trace_.size(); ++i) {
      Push(static_cast<double>(trace_[i].timestamp_ms) / 1000.0, EventType::kArrival, i);
    }
    Push(0, EventType::kLoadReport, 0);
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
          break;
        case EventType::kWorkerDone:
          Finish(workers_[e.index]);
          Kick(workers_[e.index]);
          break;
        case EventType::kDeliver: {
          SimWorker& w = workers_[e.index];
          const ApplyOutcome outcome = core_->OnKvEvents(w.id(), w.outbox.front());
          w.outbox.pop_front();
          if (outcome != ApplyOutcome::kApplied) {
            return Status::Internal(std::string("simulated KV events were not applied: ") +
                                    ApplyOutcomeName(outcome));
          }
          break;
        }
        case EventType::kLoadReport:
          ReportLoad();
          if (finished_ < trace_.size()) {
            Push(now_ + o_.load_report_interval_s, EventType::kLoadReport, 0);
          }
          break;
      }
    }
    return Status::Ok();
  }

  SimResult Result() const {
    SimResult r;
    r.requests = static_cast<int64_t>(trace_.size());
    r.prompt_tokens = prompt_tokens_;
    r.hit_tokens = hit_tokens_;
    r.predicted_hit_tokens = predicted_hit_tokens_;
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
    return r;
  }

 private:
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
    predicted_hit_tokens_ +=
        TokensOfLeadingBlocks(r, decision->prefill_overlap_blocks, o_.block_tokens);
    prompt_tokens_ += r.input_length;
    SimWorker& w = workers_[by_id_.at(decision->decode)];
    w.queue.push_back(i);
    ++w.routed;
    Kick(w);
    return Status::Ok();
  }

  void Emit(SimWorker& w, KvEvent::Kind kind, std::vector<uint64_t> hashes) {
    if (hashes.empty()) return;
    KvEventBatch batch;
    batch.seq = ++w.seq;
    KvEvent e;
    e.kind = kind;
    e.hashes.assign(hashes.begin(), hashes.end());
    batch.events.push_back(std::move(e));
    w.outbox.push_back(std::move(batch));
    Push(now_ + o_.event_delay_s, EventType::kDeliver, by_id_.at(w.id()));
  }

  // Starts the worker's next action if it is idle.
  void Kick(SimWorker& w) {
    if (w.action != SimWorker::Action::kIdle) return;
    const size_t wi = by_id_.at(w.id());
    if (!w.queue.empty()) {
      const size_t i = w.queue.front();
      w.queue.pop_front();
      const TraceRequest& r = trace_[i];
      std::vector<uint64_t> evicted;
      w.to_store.clear();
      const int64_t hit_blocks = w.Admit(r, &evicted, &w.to_store);
      const int64_t hits = TokensOfLeadingBlocks(r, hit_blocks, o_.block_tokens);
      hit_tokens_ += hits;
      const int64_t computed = r.input_length - hits;
      w.work += computed;
      Emit(w, KvEvent::Kind::kRemoved, std::move(evicted));
      w.action = SimWorker::Action::kPrefill;
      w.current = i;
      Push(now_ + o_.prefill_overhead_s + static_cast<double>(computed) / o_.prefill_tokens_per_s,
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
      ttft_[i] = now_ - static_cast<double>(trace_[i].timestamp_ms) / 1000.0;
      Emit(w, KvEvent::Kind::kStored, std::move(w.to_store));
      w.to_store = {};
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
        load.queued_prefill_tokens +=
            r.input_length - TokensOfLeadingBlocks(r, w.CachedPrefix(r), o_.block_tokens);
      }
      int64_t used_blocks = 0;
      for (const auto& run : w.running) {
        const TraceRequest& r = trace_[run.request];
        used_blocks += BlocksFor(r.input_length + r.output_length - run.remaining, o_.block_tokens);
      }
      load.running = static_cast<int64_t>(w.running.size());
      load.waiting = static_cast<int64_t>(w.queue.size());
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
  int64_t predicted_hit_tokens_ = 0;
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
  ro.index.max_workers = static_cast<size_t>(options.workers);
  // Room for every worker's cache plus the blocks announced while in flight.
  ro.index.max_entries = static_cast<size_t>(options.workers * options.capacity_blocks * 2);
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
  return sim.Result();
}

}  // namespace pdserve::router
