#include "services/router/copy_governor.h"

#include <algorithm>
#include <cmath>

namespace pdserve::router {
namespace {

constexpr double kRatioWeight = 1.0 / 8;  // breaker EWMA weight per outcome
constexpr double kScaleMin = 1.0 / 16;
constexpr double kScaleStep = 1.0 / 16;  // + per reused copy
constexpr double kScaleCut = 0.7;        // x per unused copy
constexpr int64_t kMaxCooldowns = 16;    // the longest open period, in cooldown_us
constexpr size_t kMaxOpenRecords = 16;   // per receiver; the oldest ends without outcome
constexpr size_t kGhostSlots = 512;      // tracked evictions per worker at most
constexpr double kGhostWeight = 1.0 / 64;
constexpr double kBucketSeconds = 2;  // burst of the rate budget
constexpr int64_t kSweepEveryUs = 1'000'000;
constexpr uint64_t kMix = 0x9E3779B97F4A7C15ull;

}  // namespace

const char* CopyDeclineName(CopyDecline reason) {
  switch (reason) {
    case CopyDecline::kBreakerOpen:
      return "breaker_open";
    case CopyDecline::kInflightBudget:
      return "inflight_budget";
    case CopyDecline::kRateBudget:
      return "rate_budget";
    case CopyDecline::kLinkBusy:
      return "link_busy";
    case CopyDecline::kReceiverQueue:
      return "receiver_queue";
    case CopyDecline::kReceiverPressure:
      return "receiver_pressure";
    case CopyDecline::kEnoughHolders:
      return "enough_holders";
    case CopyDecline::kCount:
      break;
  }
  return "unknown";
}

const char* CopyBreakerName(CopyBreaker state) {
  switch (state) {
    case CopyBreaker::kClosed:
      return "closed";
    case CopyBreaker::kHalfOpen:
      return "half_open";
    case CopyBreaker::kOpen:
      return "open";
  }
  return "unknown";
}

CopyGovernor::CopyGovernor(CopyGovernorOptions options)
    : o_(options), cooldown_us_(options.cooldown_us), ratio_(options.reset_ratio) {
  ResizeGhostsLocked();
}

void CopyGovernor::AddWorker(WorkerId worker) {
  std::lock_guard lock(mu_);
  if (worker >= workers_.size()) workers_.resize(worker + 1);
  workers_[worker] = Worker{};
  workers_[worker].present = true;
}

void CopyGovernor::RemoveWorker(WorkerId worker) {
  std::lock_guard lock(mu_);
  if (worker >= workers_.size()) return;
  for (const Record& r : workers_[worker].open) DroppedLocked(r);
  workers_[worker] = Worker{};
  ResizeGhostsLocked();
  // Copies on its links no longer hold the budget.
  std::erase_if(inflight_, [&](const auto& entry) {
    const Inflight& c = entry.second;
    if (c.source != worker && c.receiver != worker) return false;
    if (c.source < workers_.size()) workers_[c.source].link_tokens -= c.tokens;
    if (c.receiver < workers_.size()) workers_[c.receiver].link_tokens -= c.tokens;
    if (c.probe) probe_out_ = false;
    return true;
  });
  for (Worker& w : workers_) w.link_tokens = std::max<int64_t>(0, w.link_tokens);
}

void CopyGovernor::SetWorkerCount(int64_t workers) {
  std::lock_guard lock(mu_);
  worker_count_ = workers;
}

int64_t CopyGovernor::InflightLimitLocked() const {
  const int64_t full =
      o_.max_inflight > 0 ? o_.max_inflight : std::max<int64_t>(1, worker_count_ / 2);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(scale_ * static_cast<double>(full))));
}

void CopyGovernor::RefillLocked(int64_t now_us) {
  if (o_.max_tokens_per_s <= 0) return;
  const double rate = scale_ * o_.max_tokens_per_s;
  if (bucket_at_us_ < 0) {
    bucket_ = rate * kBucketSeconds;
  } else {
    bucket_ += rate * static_cast<double>(now_us - bucket_at_us_) * 1e-6;
  }
  bucket_ = std::min(bucket_, rate * kBucketSeconds);
  bucket_at_us_ = now_us;
}

bool CopyGovernor::MayStart(int64_t now_us, CopyDecline* reason) {
  std::lock_guard lock(mu_);
  if (now_us - last_sweep_us_ >= kSweepEveryUs) ExpireLocked(now_us);
  if (breaker_ == CopyBreaker::kOpen && now_us >= open_until_us_) {
    breaker_ = CopyBreaker::kHalfOpen;
  }
  if (breaker_ == CopyBreaker::kOpen || (breaker_ == CopyBreaker::kHalfOpen && probe_out_)) {
    *reason = CopyDecline::kBreakerOpen;
    return false;
  }
  if (static_cast<int64_t>(inflight_.size()) >= InflightLimitLocked()) {
    *reason = CopyDecline::kInflightBudget;
    return false;
  }
  RefillLocked(now_us);
  if (o_.max_tokens_per_s > 0 && bucket_ <= 0) {
    *reason = CopyDecline::kRateBudget;
    return false;
  }
  return true;
}

void CopyGovernor::Price(WorkerId source, std::span<Quote> quotes) const {
  std::lock_guard lock(mu_);
  const int64_t source_busy = source < workers_.size() ? workers_[source].link_tokens : 0;
  for (Quote& q : quotes) {
    const ReceiverView& r = q.receiver;
    CopyPrice& p = q.price;
    p = CopyPrice{};
    p.link = static_cast<int64_t>(std::ceil(static_cast<double>(q.tokens) * o_.copy_cost));
    const bool known = r.worker < workers_.size() && workers_[r.worker].present;
    const int64_t busy = source_busy + (known ? workers_[r.worker].link_tokens : 0);
    p.link_wait = static_cast<int64_t>(std::ceil(static_cast<double>(busy) * o_.copy_cost));
    const int64_t queued_blocks = (r.queued_tokens + o_.block_tokens - 1) / o_.block_tokens;
    // A copy pays only into spare capacity: a receiver with more prefill
    // queued than the copy's own link time is busy when it lands, so the
    // request waits there as it would at a holder, and the copy only adds
    // a duplicate (moves between busy workers are the load term's, by
    // recompute). A queue that alone fills the pool would also evict it.
    p.receiver_busy = r.queued_tokens > p.link ||
                      (r.capacity_blocks > 0 && queued_blocks + q.blocks >= r.capacity_blocks);
    const int64_t free_blocks =
        r.capacity_blocks > 0 ? std::max<int64_t>(0, r.capacity_blocks - r.held_blocks) : 0;
    const int64_t evicted =
        std::clamp<int64_t>(q.blocks + queued_blocks - free_blocks, 0, q.blocks);
    const double value = std::clamp(ghosts_.value, 0.0, 1.0);
    p.pressure =
        static_cast<int64_t>(std::ceil(static_cast<double>(evicted * o_.block_tokens) * value));
  }
}

bool CopyGovernor::PushFits(WorkerId source, Quote& quote, double keep) const {
  Price(source, std::span<Quote>(&quote, 1));
  const ReceiverView& r = quote.receiver;
  const int64_t queued_blocks = (r.queued_tokens + o_.block_tokens - 1) / o_.block_tokens;
  if (r.capacity_blocks > 0 && queued_blocks + quote.blocks >= r.capacity_blocks) return false;
  const double pushed_value =
      static_cast<double>(quote.blocks * o_.block_tokens) * std::clamp(keep, 0.0, 1.0);
  return static_cast<double>(quote.price.pressure) <= pushed_value;
}

void CopyGovernor::OnStarted(uint64_t request_id, WorkerId source, WorkerId receiver,
                             std::span<const BlockHash> hashes, int64_t first_block, int64_t blocks,
                             int64_t tokens, int64_t now_us) {
  std::lock_guard lock(mu_);
  if (receiver >= workers_.size() || !workers_[receiver].present || blocks <= 0 ||
      first_block < 0 || static_cast<size_t>(first_block + blocks) > hashes.size()) {
    return;
  }
  Inflight c{source, receiver, tokens, breaker_ == CopyBreaker::kHalfOpen};
  if (c.probe) probe_out_ = true;
  if (source < workers_.size()) workers_[source].link_tokens += tokens;
  workers_[receiver].link_tokens += tokens;
  inflight_[request_id] = c;
  if (o_.max_tokens_per_s > 0) bucket_ -= static_cast<double>(tokens);
  auto& open = workers_[receiver].open;
  if (open.size() >= kMaxOpenRecords) {
    DroppedLocked(open.front());
    open.erase(open.begin());
  }
  open.push_back({request_id, static_cast<uint32_t>(first_block),
                  hashes[static_cast<size_t>(first_block)],
                  hashes[static_cast<size_t>(first_block + blocks - 1)], now_us, c.probe});
  ++counters_.started;
}

void CopyGovernor::OnLanded(uint64_t request_id) {
  std::lock_guard lock(mu_);
  auto it = inflight_.find(request_id);
  if (it == inflight_.end()) return;
  const Inflight& c = it->second;
  if (c.source < workers_.size()) {
    workers_[c.source].link_tokens =
        std::max<int64_t>(0, workers_[c.source].link_tokens - c.tokens);
  }
  if (c.receiver < workers_.size()) {
    workers_[c.receiver].link_tokens =
        std::max<int64_t>(0, workers_[c.receiver].link_tokens - c.tokens);
  }
  inflight_.erase(it);
  ++counters_.landed;
}

void CopyGovernor::Declined(CopyDecline reason) {
  std::lock_guard lock(mu_);
  ++counters_.declined[static_cast<size_t>(reason)];
}

void CopyGovernor::OnRouted(uint64_t request_id, WorkerId worker, std::span<const BlockHash> hashes,
                            int64_t overlap, int64_t now_us) {
  std::lock_guard lock(mu_);
  if (worker >= workers_.size()) return;
  auto& open = workers_[worker].open;
  for (size_t i = 0; i < open.size();) {
    const Record& rec = open[i];
    if (rec.request_id != request_id && static_cast<int64_t>(rec.first_block) < overlap &&
        hashes[rec.first_block] == rec.first_hash) {
      const bool probe = rec.probe;
      open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
      OutcomeLocked(/*reused=*/true, probe, now_us);
    } else {
      ++i;
    }
  }
}

void CopyGovernor::OnKvEvents(WorkerId worker, const KvEventBatch& batch, int64_t now_us) {
  std::lock_guard lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].present) return;
  Worker& w = workers_[worker];
  Ghosts& g = ghosts_;
  for (const KvEvent& e : batch.events) {
    if (const auto* rm = std::get_if<KvRemoved>(&e)) {
      if (rm->tier != KvTier::kDevice) continue;
      for (BlockHash h : rm->block_hashes) {
        for (size_t i = 0; i < w.open.size(); ++i) {
          if (w.open[i].last_hash == h || w.open[i].first_hash == h) {
            const bool probe = w.open[i].probe;
            w.open.erase(w.open.begin() + static_cast<std::ptrdiff_t>(i));
            OutcomeLocked(/*reused=*/false, probe, now_us);
            break;
          }
        }
        if (!Tracked(h)) continue;
        if (g.ring.size() >= g.slots) {
          const BlockHash old = g.ring.front();
          g.ring.pop_front();
          auto it = g.live.find(old);
          if (it != g.live.end() && --it->second == 0) {
            g.live.erase(it);
            g.value += kGhostWeight * (0.0 - g.value);  // left the window, never back
          }
        }
        g.ring.push_back(h);
        ++g.live[h];
      }
    } else if (const auto* st = std::get_if<KvStored>(&e)) {
      if (st->tier != KvTier::kDevice || g.live.empty()) continue;
      for (BlockHash h : st->block_hashes) {
        if (!Tracked(h)) continue;
        auto it = g.live.find(h);
        if (it == g.live.end()) continue;
        g.live.erase(it);  // its ring slots become stale
        g.value += kGhostWeight * (1.0 - g.value);
      }
    } else if (std::holds_alternative<KvCleared>(e)) {
      const std::vector<Record> cleared = std::move(w.open);
      w.open.clear();
      for (const Record& r : cleared) OutcomeLocked(/*reused=*/false, r.probe, now_us);
    }
  }
}

void CopyGovernor::SetCapacity(WorkerId worker, int64_t capacity_blocks) {
  std::lock_guard lock(mu_);
  if (worker >= workers_.size() || !workers_[worker].present ||
      workers_[worker].capacity_blocks == capacity_blocks) {
    return;
  }
  workers_[worker].capacity_blocks = capacity_blocks;
  ResizeGhostsLocked();
}

void CopyGovernor::ResizeGhostsLocked() {
  // The window spans about one pass of evictions over every pool: a block
  // stored again within it would still have been cached with a little more
  // room, which is what a copy's evictions take away. Sampled so that at
  // most kGhostSlots are tracked; resized only when the total changes by a
  // quarter (the list starts over then).
  int64_t window = 0;
  for (const Worker& w : workers_) window += w.present ? w.capacity_blocks : 0;
  if (window <= 0) window = 4096;
  if (ghosts_.window_blocks > 0 && 4 * std::abs(window - ghosts_.window_blocks) < window) return;
  const double value = ghosts_.value;
  ghosts_ = Ghosts{};
  ghosts_.value = value;
  ghosts_.window_blocks = window;
  uint32_t bits = 0;
  while ((window >> bits) > static_cast<int64_t>(kGhostSlots)) ++bits;
  ghosts_.sample_shift = 64 - bits;
  ghosts_.slots = static_cast<size_t>(std::max<int64_t>(1, window >> bits));
}

bool CopyGovernor::Tracked(BlockHash h) const {
  return ghosts_.sample_shift >= 64 || ((h * kMix) >> ghosts_.sample_shift) == 0;
}

void CopyGovernor::DroppedLocked(const Record& record) {
  if (!record.probe || breaker_ != CopyBreaker::kHalfOpen) return;
  probe_out_ = false;  // half-open still: the next copy is the probe
}

void CopyGovernor::OutcomeLocked(bool reused, bool probe, int64_t now_us) {
  ++(reused ? counters_.reused : counters_.unused);
  ratio_ += kRatioWeight * ((reused ? 1.0 : 0.0) - ratio_);
  scale_ = reused ? std::min(1.0, scale_ + kScaleStep) : std::max(kScaleMin, scale_ * kScaleCut);
  if (breaker_ == CopyBreaker::kHalfOpen) {
    if (!probe) return;  // an older copy: only the probe decides
    probe_out_ = false;
    if (reused) {
      breaker_ = CopyBreaker::kClosed;
      ratio_ = std::max(ratio_, o_.reset_ratio);
      cooldown_us_ = o_.cooldown_us;
    } else {
      breaker_ = CopyBreaker::kOpen;
      cooldown_us_ = std::min(cooldown_us_ * 2, o_.cooldown_us * kMaxCooldowns);
      open_until_us_ = now_us + cooldown_us_;
    }
    return;
  }
  if (breaker_ == CopyBreaker::kClosed && ratio_ < o_.trip_ratio) {
    breaker_ = CopyBreaker::kOpen;
    open_until_us_ = now_us + cooldown_us_;
    ++counters_.breaker_trips;
  }
}

void CopyGovernor::ExpireLocked(int64_t now_us) {
  last_sweep_us_ = now_us;
  for (Worker& w : workers_) {
    for (size_t i = 0; i < w.open.size();) {
      if (w.open[i].started_us + o_.reuse_window_us <= now_us) {
        const bool probe = w.open[i].probe;
        w.open.erase(w.open.begin() + static_cast<std::ptrdiff_t>(i));
        OutcomeLocked(/*reused=*/false, probe, now_us);
      } else {
        ++i;
      }
    }
  }
}

double CopyGovernor::EvictionValue() const {
  std::lock_guard lock(mu_);
  return ghosts_.value;
}

CopyGovernorStats CopyGovernor::stats() const {
  std::lock_guard lock(mu_);
  CopyGovernorStats s = counters_;
  s.breaker = breaker_;
  s.reuse_ratio = ratio_;
  s.budget_scale = scale_;
  s.inflight = static_cast<int64_t>(inflight_.size());
  s.inflight_limit = InflightLimitLocked();
  s.tokens_per_s_limit = o_.max_tokens_per_s > 0 ? scale_ * o_.max_tokens_per_s : 0.0;
  return s;
}

}  // namespace pdserve::router
