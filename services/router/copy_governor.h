// CopyGovernor: what a hot-prefix copy really costs and whether the cluster
// may start one now. RouterCore owns one and asks it on every decision that
// could copy; the router service and the simulator report back when a copy
// landed, and KV events tell it which copied blocks were evicted unused.
//
// Why (docs/routing.md, "When copies lose"): priced by link time alone, a
// copy looks cheap whenever a holder's queue is a little longer than
// another worker's. On a busy cluster whose hot set exceeds its caches that
// is always true, and copies then duplicate prefixes across caches, evict
// blocks other requests come back for, and are themselves evicted before
// anyone reuses them: the hit rate falls, queues grow, more copies look
// cheap.
//
// Price of copying `blocks` blocks (tokens T) from source S to receiver R,
// in tokens of prefill work (the unit of the kv policy's cost):
//   link      T x copy_cost                  the copy's own time on the links
//   link wait (tokens in flight on S's and R's links) x copy_cost
//   pressure  evicted x block_tokens x v     evicted = the copy's blocks R
//             has no free room for once its queue is admitted; v = the
//             share of evicted blocks that some worker stored again (computed
//             or copied) within about one cluster's worth of evictions: a
//             sampled ghost list of every worker's evictions, fed by KV
//             events. Cluster-wide, because the router sends a prefix's next
//             request wherever it is held: what an eviction costs is a
//             prefix that nobody holds any more.
// Receiver's queue: a copy pays only into spare capacity. A receiver with
// more prefill queued than the copy's own link time is busy when the copy
// lands: the request waits there as it would at a holder and the copy only
// adds a duplicate (moving work between busy workers is the kv policy's
// load term's job, by recompute). No copy there (kReceiverQueue).
//
// Cluster budget: copies in flight (not landed) at most
// scale x max_inflight, copied tokens per second at most scale x
// max_tokens_per_s (a token bucket), scale in [1/16, 1] (starting at 1/4):
// + 1/16 for every copy whose blocks another request later hit on the
// receiver (reused), x 0.7 for every copy evicted or aged out
// (reuse_window_us) before that (unused).
//
// Breaker: the reuse ratio is an EWMA (weight 1/8, starting at
// reset_ratio) over copy outcomes. Below trip_ratio it opens: no copy
// starts for cooldown_us. Then it is half-open: one copy at a time (a
// probe); a reused probe closes it (ratio restarts at reset_ratio, above
// the trip point: hysteresis), an unused one opens it again for twice the
// previous cooldown (at most 16 x cooldown_us). Only the probe's outcome
// decides: copies from before the trip that end meanwhile move the ratio and
// the budget alone. A probe whose record goes without an outcome (its
// receiver left, its record was pushed out) ends the half-open state as if
// the cooldown had just run out: the next copy is a new probe.
//
// Thread safety: every method takes the governor's own mutex (RouterCore
// calls it under its lock; KV events arrive on other threads).
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "common/block_hash.h"
#include "common/kv_events.h"
#include "services/router/prefix_index.h"

namespace pdserve::router {

// Why a copy that a link-time price alone would have made did not start.
enum class CopyDecline : uint8_t {
  kBreakerOpen,       // copies have been losing (or a probe is out)
  kInflightBudget,    // the cluster's copies in flight are at the budget
  kRateBudget,        // the cluster's copied tokens per second are at the budget
  kLinkBusy,          // priced out mostly by copies already on its links
  kReceiverQueue,     // the receiver is busy: more prefill queued than the copy's link time
  kReceiverPressure,  // priced out mostly by the blocks it would evict
  kEnoughHolders,     // the prefix has as many holders as its traffic share earns
  kCount
};
inline constexpr size_t kCopyDeclineCount = static_cast<size_t>(CopyDecline::kCount);
// "breaker_open", "inflight_budget", "rate_budget", "link_busy",
// "receiver_queue", "receiver_pressure", "enough_holders" (metric labels).
const char* CopyDeclineName(CopyDecline reason);

enum class CopyBreaker : uint8_t { kClosed = 0, kHalfOpen = 1, kOpen = 2 };
const char* CopyBreakerName(CopyBreaker state);  // "closed", "half_open", "open"

struct CopyGovernorOptions {
  double copy_cost = 0;  // link time per copied token / prefill time per token
  int64_t block_tokens = 16;
  // Copies in flight cluster-wide at full budget; 0: one per two workers.
  int64_t max_inflight = 0;
  // Copied prompt tokens per second cluster-wide at full budget (bytes per
  // second / KV bytes per token); 0: no rate budget.
  double max_tokens_per_s = 0;
  double trip_ratio = 0.35;
  double reset_ratio = 0.6;
  int64_t cooldown_us = 10'000'000;
  // A copy no other request reused within this is unused.
  int64_t reuse_window_us = 30'000'000;
};

// The parts of one copy's price, in tokens of prefill work.
struct CopyPrice {
  int64_t link = 0;
  int64_t link_wait = 0;
  int64_t pressure = 0;
  bool receiver_busy = false;  // no copy: see kReceiverQueue
  int64_t extra() const { return link_wait + pressure; }
  int64_t total() const { return link + link_wait + pressure; }
};

// What the governor knows of a receiver when pricing (from the load view).
struct ReceiverView {
  WorkerId worker = 0;
  int64_t capacity_blocks = 0;  // 0: unknown (assumed full)
  int64_t held_blocks = 0;      // device blocks the index lists
  int64_t queued_tokens = 0;    // prefill tokens queued ahead of this request
};

struct CopyGovernorStats {
  std::array<uint64_t, kCopyDeclineCount> declined{};
  uint64_t started = 0;
  uint64_t landed = 0;
  uint64_t reused = 0;  // outcomes: another request hit the copy on its receiver
  uint64_t unused = 0;  // evicted or aged out before that
  uint64_t breaker_trips = 0;
  CopyBreaker breaker = CopyBreaker::kClosed;
  double reuse_ratio = 0;  // the breaker's EWMA
  double budget_scale = 0;
  int64_t inflight = 0;
  int64_t inflight_limit = 0;
  double tokens_per_s_limit = 0;  // 0: none
};

class CopyGovernor {
 public:
  explicit CopyGovernor(CopyGovernorOptions options);

  void AddWorker(WorkerId worker);
  void RemoveWorker(WorkerId worker);  // its copies end without an outcome
  // Workers counted for the default in-flight budget.
  void SetWorkerCount(int64_t workers);

  // Whether a copy may start now (breaker, budgets); the reason when not.
  // Moves an open breaker whose cooldown is over to half-open.
  bool MayStart(int64_t now_us, CopyDecline* reason);
  // Prices each quote: copying quote.blocks blocks (quote.tokens tokens)
  // from `source` to quote.receiver (one lock for a whole decision).
  struct Quote {
    ReceiverView receiver;
    int64_t blocks = 0;
    int64_t tokens = 0;
    CopyPrice price;  // out
  };
  void Price(WorkerId source, std::span<Quote> quotes) const;

  // Drain pushes (a leaving worker's prompts written to a survivor) pay the
  // same receiver pressure: a push fits a receiver when the blocks it
  // evicts there are worth less than the pushed blocks, evicted x v <=
  // blocks x keep (keep: the chance the pushed prompt is used again), and
  // the receiver's queue would not evict it first (its queued blocks and
  // the push fill the pool). Prices quote.price (link wait and pressure)
  // like Price.
  bool PushFits(WorkerId source, Quote& quote, double keep) const;

  // A copy started: receiver gets blocks [first_block, first_block + blocks)
  // of `hashes` (a prompt's block hashes) from `source`.
  void OnStarted(uint64_t request_id, WorkerId source, WorkerId receiver,
                 std::span<const BlockHash> hashes, int64_t first_block, int64_t blocks,
                 int64_t tokens, int64_t now_us);
  // Its blocks landed on the receiver (or the copy failed): frees its links.
  void OnLanded(uint64_t request_id);
  // Counts a decline for the metrics.
  void Declined(CopyDecline reason);
  // A request was routed to `worker` (the one prefilling it), which holds
  // its first `overlap` blocks: copies there that it hits are reused.
  void OnRouted(uint64_t request_id, WorkerId worker, std::span<const BlockHash> hashes,
                int64_t overlap, int64_t now_us);
  // Device-tier evictions end copies unused and feed the ghost list;
  // device-tier stores of ghost blocks count as their comeback.
  void OnKvEvents(WorkerId worker, const KvEventBatch& batch, int64_t now_us);
  // The worker's pool size, from its load report (sizes the ghost list).
  void SetCapacity(WorkerId worker, int64_t capacity_blocks);

  CopyGovernorStats stats() const;
  // v: share of evicted blocks stored again soon after.
  double EvictionValue() const;

 private:
  struct Record {
    uint64_t request_id = 0;
    uint32_t first_block = 0;
    BlockHash first_hash = 0;
    BlockHash last_hash = 0;
    int64_t started_us = 0;
    bool probe = false;  // the half-open breaker's one copy
  };
  struct Ghosts {
    int64_t window_blocks = 0;   // evictions the list spans (the pools' total)
    uint32_t sample_shift = 64;  // a hash is tracked when (h * K) >> shift == 0; 64: all
    size_t slots = 0;            // ring size
    std::deque<BlockHash> ring;  // tracked evictions, oldest first
    std::unordered_map<BlockHash, uint32_t> live;  // -> times in the ring
    double value = 0.5;                            // EWMA of comebacks
  };
  struct Worker {
    bool present = false;
    std::vector<Record> open;  // copies to it with no outcome yet
    int64_t link_tokens = 0;   // tokens of copies in flight on its link
    int64_t capacity_blocks = 0;
  };
  struct Inflight {
    WorkerId source = 0;
    WorkerId receiver = 0;
    int64_t tokens = 0;
    bool probe = false;
  };

  void OutcomeLocked(bool reused, bool probe, int64_t now_us);
  // A record dropped with no outcome: a probe's frees the half-open state.
  void DroppedLocked(const Record& record);
  void ExpireLocked(int64_t now_us);
  void RefillLocked(int64_t now_us);
  int64_t InflightLimitLocked() const;
  void ResizeGhostsLocked();
  bool Tracked(BlockHash h) const;

  const CopyGovernorOptions o_;
  mutable std::mutex mu_;
  std::vector<Worker> workers_;
  std::unordered_map<uint64_t, Inflight> inflight_;
  int64_t worker_count_ = 0;
  CopyBreaker breaker_ = CopyBreaker::kClosed;
  int64_t open_until_us_ = 0;
  int64_t cooldown_us_ = 0;
  bool probe_out_ = false;
  double ratio_ = 0;
  double scale_ = 0.25;
  double bucket_ = 0;  // copied tokens available (may go negative: debt)
  int64_t bucket_at_us_ = -1;
  int64_t last_sweep_us_ = 0;
  Ghosts ghosts_;
  CopyGovernorStats counters_;
};

}  // namespace pdserve::router
