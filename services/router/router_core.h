// RouterCore: the routing brain the router service calls — workers, their
// load, the global prefix index, and the choice of (decode worker, prefill
// worker or local prefill) for each request. No I/O: the control plane turns
// worker messages into the calls below; the HTTP layer calls Route() and
// reports the request's progress back.
//
// Request accounting: Route() charges the chosen workers with the request's
// prefill tokens and KV footprint; OnPrefillDone() releases the prefill part,
// OnRequestFinished() (finished, failed or cancelled) the rest. Between two
// Load reports, and for requests other router replicas sent, the worker's own
// numbers and this router's accounting each undercount, so the policy sees
// the larger of the two.
//
// Conditional disaggregation (docs/architecture.md section 3): the decode worker D
// is chosen first among decode|both workers (its own overlap and load); if the
// tokens D would compute exceed max_local_prefill and a prefill-role worker
// exists, a prefill worker is chosen among them (cache affinity and load),
// else D prefills locally. This is the system's only prefill decision: the
// router carries it to D in Generate (prefill_address), and D follows it. Workers of role `both`
// serve their own prefills only; they are never picked as another worker's remote prefiller.
//
// Burst handling: after each decision the blocks the prefilling worker will
// compute are recorded as pending for pending_ttl_us, so the next requests
// sharing that new prefix land on the same worker before its KV events come.
// Route() returns before it writes them (about one cache miss per block):
// they are applied by FlushPending(), which the caller runs once the request
// is on its way, or else by the next call that reads or changes the index
// (Route, Overlap, PlanDrainPush, KV events, snapshots, worker changes), so
// every decision and event still sees every earlier decision's entries.
//
// Thread safety: all methods may be called concurrently. Route() and the
// accounting calls serialise on one mutex (a decision is a few microseconds);
// KV events go straight to the index, which has its own reader/writer lock,
// so event ingestion only contends with the index query of a decision (and
// takes the mutex only to write pending entries a caller left unwritten).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/block_hash.h"
#include "common/status.h"
#include "services/protocol/role.h"
#include "services/router/copy_governor.h"
#include "services/router/policy.h"
#include "services/router/prefix_index.h"

namespace pdserve::router {

namespace detail {
class BlockTable;
}

// A worker's periodic Load report.
struct WorkerLoad {
  int64_t queued_prefill_tokens = 0;  // prompt tokens waiting for prefill (after its cache)
  int64_t running = 0;                // requests decoding
  int64_t waiting = 0;                // requests queued
  int64_t free_blocks = 0;            // KV blocks not held by running requests
  int64_t total_blocks = 0;
};

inline constexpr int64_t kDefaultMaxLocalPrefill = 512;
inline constexpr int64_t kMaxCopyMinRequests = 16;

struct RouterOptions {
  std::string policy = "kv";
  PolicyOptions policy_options;
  int64_t block_tokens = kDefaultBlockSize;
  // The most prompt tokens a decode worker prefills itself: a request whose
  // decode worker would compute more (its cached prefix excluded) is
  // prefilled on a prefill worker, when one is registered. The router's
  // --max-local-prefill; this decision is the only one (workers follow it).
  int64_t max_local_prefill = kDefaultMaxLocalPrefill;
  // A prefill worker with more prefill queued than this (tokens: its load
  // report or the router's own count, whichever is larger) prefills no new
  // request; with none left under it, the decode worker prefills itself, so
  // an overloaded prefill pool does not queue every long prompt while
  // decode workers idle (Dynamo's disaggregated router has the same lever,
  // in requests). 0: no bound.
  int64_t max_prefill_queue_tokens = 0;
  int64_t pending_ttl_us = 2'000'000;
  // Hot-prefix replication by KV copy. A decode candidate that lacks part of
  // the longest cached prefix any worker holds may have those blocks copied
  // from its least busy holder (any role: decode-only workers write KV for
  // copies) instead of computing them; the policy then sees each copied
  // token as copy_cost prompt tokens of work (copy time / prefill time per
  // token) plus what services/router/copy_governor.h prices beyond that (the
  // copies already on its links, the blocks it evicts). A copy is offered
  // only for a hot prefix (below) that has fewer holders than its share of
  // the requests (decayed over copy_window_us) times the decode workers
  // earns, to a candidate with no more prefill queued than the copy's link
  // time, while the governor's budget and breaker allow. So a busy holder's
  // prefix spreads to idle workers as far as its traffic needs, and no
  // further. 0 (or >= 1, where recomputing is cheaper): no copies.
  double copy_cost = 0;
  // Only a hot prefix is copied: one that at least copy_min_requests
  // requests (the one being routed included) reached as their longest cached
  // prefix within copy_window_us. A conversation's own history, reached once
  // per turn, then stays with its holder (copying it away trades that
  // holder's hit for a copy), while a system prompt that a burst of requests
  // shares is spread. 1: any prefix a copy pays for.
  int64_t copy_min_requests = 2;
  int64_t copy_window_us = 10'000'000;
  // What a copy costs beyond its link time and the cluster's copy budget
  // (services/router/copy_governor.h): copies in flight at full budget (0:
  // one per two decode workers), copied tokens per second at full budget
  // (0: no rate budget), and how long a copy may wait for another request
  // to hit it before it counts as unused.
  int64_t copy_max_inflight = 0;
  double copy_max_tokens_per_s = 0;
  int64_t copy_reuse_window_us = 30'000'000;
  // Drain pushes are planned here (PlanDrainPush): keeps the eviction value
  // up to date even with replication off.
  bool drain_push = false;
  PrefixIndexOptions index;
  // A worker sends its load from its engine loop, between steps: when its
  // reports stop for this long while its connection stays up (heartbeats
  // come from another thread), its engine is stuck in a step, and it gets
  // no new requests while another worker can take them (a decode worker
  // then prefills itself), until they resume (WorkerView::stalled). 0: never.
  int64_t worker_stall_us = 0;
  // A worker's engine always computes a prompt's last token (its logits
  // are the first output), so it reuses cached blocks only up to the one
  // before it: a block-aligned prompt's last block never, and a windowed
  // group's reach is judged from that block's start. Predictions stop
  // there too. The simulator, whose cache model counts a trace's blocks
  // whole, turns this off.
  bool reuse_stops_before_last_token = true;
  // Microseconds on a monotonic clock; the simulator supplies simulated time.
  std::function<int64_t()> clock_us;
};

struct RouteRequest {
  uint64_t request_id = 0;                  // unique among requests in flight
  std::span<const BlockHash> block_hashes;  // full prompt blocks (hash spec v1)
  int64_t prompt_tokens = 0;                // >= block_hashes.size() * block_tokens
  int64_t max_new_tokens = 0;               // for the KV footprint estimate
  // Workers that failed this request already (a retry): taken again only
  // when no other can take it.
  std::span<const WorkerId> avoid;
};
// Only workers whose max_model_len (when known) holds prompt_tokens +
// max_new_tokens decode the request, and only those whose max_model_len holds
// the prompt and its first token prefill it. A decode worker whose whole KV
// pool (when known) is too small for the prompt and its first token (its
// engine refuses them), or one to avoid, decodes only when no other can,
// and a stalled one after those; such a prefill worker never prefills (the
// decode worker does).

// A leaving worker's prompt it could push to a survivor (PlanDrainPush).
struct PushCandidate {
  std::span<const BlockHash> hashes;  // the prompt's full blocks
  int64_t uses = 1;                   // requests that used it lately
};
struct PushPlan {
  size_t candidate = 0;  // index into the candidates
  WorkerId target = 0;
  int64_t blocks = 0;  // blocks the target lacks (what the push writes)
};

struct RouteDecision {
  WorkerId decode = 0;
  std::optional<WorkerId> prefill;  // empty: the decode worker prefills locally
  int64_t decode_overlap_blocks = 0;
  int64_t prefill_overlap_blocks = 0;  // of the prefilling worker (== decode's when local)
  // The blocks after those that the prefilling worker copies back from its
  // lower tiers instead of computing.
  int64_t prefill_host_blocks = 0;
  int64_t prefill_disk_blocks = 0;
  int64_t prefill_tokens = 0;  // tokens the prefilling worker is expected to compute
  // Replication: before its prefill the decode worker receives blocks
  // [decode_overlap_blocks, decode_overlap_blocks + copy_blocks) of the
  // prompt from copy_from, which holds them (local prefill only).
  std::optional<WorkerId> copy_from;
  int64_t copy_blocks = 0;
  bool remote_prefill() const { return prefill.has_value(); }
};

// What the router knows about one worker, for /metrics, logs and tests.
struct WorkerView {
  WorkerId id = 0;
  std::string name;
  Role role = Role::kBoth;
  int64_t max_model_len = 0;  // 0: not reported
  bool needs_resync = false;
  bool draining = false;
  bool stalled = false;  // load reports stopped (RouterOptions::worker_stall_us)
  size_t indexed_blocks = 0;
  WorkerLoad reported;
  int64_t inflight_requests = 0;
  int64_t inflight_prefill_tokens = 0;
  int64_t inflight_decode_tokens = 0;
};

struct RouterStats {
  uint64_t routed = 0;
  uint64_t local_prefill = 0;
  uint64_t remote_prefill = 0;
  uint64_t prompt_tokens = 0;
  uint64_t predicted_hit_tokens = 0;  // overlap of the prefilling worker, in tokens (tiers too)
  uint64_t predicted_host_hit_tokens = 0;  // of those, in its host tier
  uint64_t predicted_disk_hit_tokens = 0;  // and in its disk tier
  uint64_t relief_decisions = 0;           // kv decisions at the relief weights (WithKvWeights)
  uint64_t copies = 0;                     // decisions with a replication copy
  uint64_t copied_blocks = 0;
  CopyGovernorStats copy;  // declines by reason, outcomes, breaker, budget (replication on)
  PrefixIndexStats index;
};

class RouterCore {
 public:
  // InvalidArgument for an unknown policy or nonsensical options.
  static StatusOr<std::unique_ptr<RouterCore>> Create(RouterOptions options);
  ~RouterCore();

  // Registers a worker (a fresh connection). Its KV events are accepted after
  // its first snapshot (OnSnapshot). `max_model_len`: the longest sequence
  // (prompt + output) it runs, 0 when it did not say; `kv_capacity_blocks`:
  // the blocks of its KV pool, 0 when unknown. InvalidArgument for a
  // duplicate name or a negative length, ResourceExhausted when all index
  // slots are taken.
  StatusOr<WorkerId> AddWorker(const std::string& name, Role role, int64_t max_model_len = 0,
                               int64_t kv_capacity_blocks = 0);
  // Disconnect: purges the worker from the index and the load view. Returns
  // the ids of requests it was decoding and that had not finished (the caller
  // retries or fails them; they are no longer accounted). Requests it was
  // only prefilling for another worker stay in flight on that decode worker,
  // which falls back to local prefill.
  std::vector<uint64_t> RemoveWorker(WorkerId worker);

  // A draining worker gets no new requests (its running ones finish); its
  // blocks stay indexed. No-op for an unknown worker.
  void SetDraining(WorkerId worker, bool draining);

  // The model's KV layer groups (common/kv_groups.h), as its workers
  // register them: the window of each group (0: full attention). Empty or
  // one full group (the default): prefixes are leading runs of block
  // hashes. Otherwise a worker's prefix is CachedPrefixBlocks over its
  // indexed keys (PrefixIndex::GroupedOverlap), pending entries cover every
  // group, and the lower tiers and hot-prefix copies are not predicted.
  // `sink_tokens`: the windowed groups' attention sinks (--kv-eviction
  // streaming), whose blocks a prefix needs too.
  void SetKvGroupWindows(std::vector<int64_t> windows, int64_t sink_tokens = 0);
  std::vector<int64_t> KvGroupWindows() const;
  int64_t KvSinkTokens() const;
  // SnapKV (--kv-eviction snapkv), as its workers register it: a prompt of
  // P > budget tokens reuses at most (P - window) / block_tokens cached
  // blocks, so its predicted prefix stops there. 0, 0: no SnapKV.
  void SetSnapKv(int64_t budget_tokens, int64_t observation_window);
  std::pair<int64_t, int64_t> SnapKv() const;
  // The prefix each worker slot can start `hashes` from (LeadingOverlap or
  // GroupedOverlap per the groups), pending entries after now_us counted.
  void Overlap(std::span<const BlockHash> hashes, int64_t now_us, std::vector<uint32_t>* out);

  ApplyOutcome OnKvEvents(WorkerId worker, const KvEventBatch& batch);
  // `host` and `disk`: what the worker holds in its lower tiers.
  Status OnSnapshot(WorkerId worker, uint64_t seq, std::span<const BlockHash> hashes,
                    std::span<const BlockHash> host = {}, std::span<const BlockHash> disk = {});
  Status OnLoad(WorkerId worker, const WorkerLoad& load);

  // Unavailable when no decode-capable worker is registered, accepting
  // requests and long enough for the request; InvalidArgument for a request
  // id already in flight or inconsistent sizes.
  StatusOr<RouteDecision> Route(const RouteRequest& request);
  // Writes the pending entries of the decisions Route() made since the last
  // flush (see "Burst handling" above). Cheap when there are none.
  void FlushPending();
  // Scale-down: which of the leaving worker's prompts (hottest first) go to
  // which survivor (decode-capable, not draining), within budget_blocks. A
  // prompt the leaver no longer holds whole, or that every survivor holds,
  // is skipped. Each goes to the survivor where it fits under the copy
  // pressure rule (CopyGovernor::PushFits; keep = uses / (uses + 1)) at
  // the lowest price, spreading ties in turn; one that fits nowhere is not
  // pushed. Records the pushes' blocks as pending on their targets.
  std::vector<PushPlan> PlanDrainPush(WorkerId leaving, std::span<const PushCandidate> candidates,
                                      int64_t budget_blocks);
  // The longest sequence (prompt + output tokens) a request may have: the
  // largest max_model_len of the decode-capable workers accepting requests.
  // 0 when unknown: none is registered, or one did not report its length
  // (and might take any request).
  int64_t MaxModelLen() const;
  void OnPrefillDone(uint64_t request_id);
  // The request's copy landed on its decode worker, or failed: its links
  // are free again (also implied by OnPrefillDone and OnRequestFinished).
  void OnCopyLanded(uint64_t request_id);
  void OnRequestFinished(uint64_t request_id);

  std::vector<WorkerView> Workers() const;
  RouterStats stats() const;
  const RouterOptions& options() const { return options_; }
  // The index itself (events may also be applied to it directly).
  PrefixIndex& index() { return index_; }

 private:
  struct Worker;
  struct Inflight {
    WorkerId decode = 0;
    WorkerId prefiller = 0;  // == decode for local prefill
    int64_t prefill_tokens = 0;
    int64_t decode_tokens = 0;
    bool prefill_done = false;
  };
  explicit RouterCore(RouterOptions options);
  // `w` as a candidate for `request`, whose leading overlap_blocks blocks it
  // holds (its tier run and block count from match_). Also forgets the
  // worker's routing times older than the QPS window.
  Candidate MakeCandidateLocked(Worker& w, int64_t overlap_blocks, const RouteRequest& request,
                                int64_t now_us);
  // Its load reports stopped more than worker_stall_us before `now_us`.
  bool StalledLocked(const Worker& w, int64_t now_us) const;
  void ReleaseLocked(Inflight& r, bool prefill_only);
  // With copy_cost > 0, the longest held prefix hot and the governor's
  // budget open: lowers each decode candidate's uncached tokens by what a
  // copy from the best holder would save at the governor's price, recording
  // the copy in copy_*_. Sets relief_ when that prefix is hot and has fewer
  // holders than its traffic earns: the decision then takes the relief
  // weights, unless ChooseCopyLocked starts a copy.
  void OfferCopiesLocked(const RouteRequest& request, int64_t now_us);
  // For a relieved decision with copies offered: the candidate whose copy
  // the affinity weights pick, when its predicted delay (the relief
  // weights' cost) is at most the best relief choice's without copies;
  // else withdraws the offers (candidates back as they stand) and returns
  // nothing, for the relief pick.
  std::optional<size_t> ChooseCopyLocked();
  // After the pick of candidate `chosen`: counts a decline when a copy the
  // link price alone would have made did not happen.
  void CountDeclineLocked(size_t chosen);
  // Whether a copy of the longest held prefix (best blocks, best_tokens
  // tokens) at its link price alone would beat every candidate as it stands
  // (what the rule before the governor would have done).
  bool CopyWinsAtLinkPriceLocked(int64_t best, int64_t best_tokens) const;
  int64_t DecodeWorkerCountLocked() const;
  // Counts one more request reaching the prefix that ends with block
  // `last_block`; true when it is hot (see RouterOptions::copy_min_requests).
  // *share: its decayed request count over all requests' (its demand).
  bool NoteHotPrefixLocked(BlockHash last_block, int64_t now_us, double* share);
  bool GroupedLocked() const {
    return group_windows_.size() > 1 || (group_windows_.size() == 1 && group_windows_[0] > 0);
  }
  void OverlapLocked(std::span<const BlockHash> hashes, int64_t now_us,
                     std::vector<uint32_t>* out) const;
  void AddPendingLocked(WorkerId worker, std::span<const BlockHash> hashes, int64_t now_us,
                        int64_t expires_us);
  // Route's pending entries (the prompt's blocks from `held` on), kept
  // until FlushPendingLocked writes them; the worker's first `held` blocks
  // are then confirmed to the index as a chain (PrefixIndex::AdoptHeldPrefix).
  void DeferPendingLocked(WorkerId worker, std::span<const BlockHash> prompt, int64_t held,
                          int64_t now_us, int64_t expires_us);
  void FlushPendingLocked();

  RouterOptions options_;
  PrefixIndex index_;
  // Only production-stack reads recent_requests: the others skip the
  // per-worker routing-time queues.
  const bool track_qps_;
  mutable std::mutex mu_;
  std::unique_ptr<RoutingPolicy> decode_policy_;
  std::unique_ptr<RoutingPolicy> prefill_policy_;
  // kv with default weights: the same policies at the relief weights
  // (WithKvWeights), for decisions OfferCopiesLocked marks relief_.
  std::unique_ptr<RoutingPolicy> decode_relief_policy_;
  std::unique_ptr<RoutingPolicy> prefill_relief_policy_;
  PolicyOptions relief_weights_;
  const PolicyOptions* weights_ = nullptr;  // this decision's, for KvCost
  bool relief_ = false;
  std::vector<std::unique_ptr<Worker>> workers_;  // by slot; null when free
  std::unordered_map<uint64_t, Inflight> inflight_;
  RouterStats counters_;
  // Scratch reused by Route() (under mu_) so a decision does not allocate.
  std::vector<uint32_t> overlap_;
  std::vector<int64_t> group_windows_;
  int64_t sink_tokens_ = 0;
  int64_t snapkv_budget_ = 0, snapkv_window_ = 0;
  std::vector<BlockHash> pending_keys_;
  // Decisions' pending entries not yet written (DeferPendingLocked): each a
  // range of deferred_hashes_. has_deferred_ lets the KV event path, which
  // does not take mu_, skip the lock when there are none.
  struct DeferredPending {
    WorkerId worker = 0;
    size_t first = 0, count = 0;  // the prompt
    size_t held = 0;              // its blocks the worker held at the decision
    int64_t now_us = 0, expires_us = 0;
  };
  std::vector<DeferredPending> deferred_;
  std::vector<BlockHash> deferred_hashes_;
  std::atomic<bool> has_deferred_{false};
  std::vector<PrefixIndex::WorkerMatch> match_;  // per worker slot, with overlap_
  std::vector<Candidate> candidates_;
  std::vector<int64_t> copy_blocks_;  // per decode candidate: blocks a copy brings
  std::vector<int64_t> copy_saving_;  // ... and the uncached tokens it takes off
  WorkerId copy_source_ = 0;
  // Per decode candidate offered nothing by the governor's price: its
  // uncached tokens at the link price alone and why (for the decline count).
  std::vector<CopyGovernor::Quote> quotes_;
  std::vector<int64_t> base_uncached_;
  std::vector<int8_t> price_decline_;       // -1: none, else a CopyDecline
  std::unique_ptr<CopyGovernor> governor_;  // replication on only
  double traffic_ = 0;  // every request routed, decayed with time constant copy_window_us
  int64_t traffic_at_us_ = 0;
  // The longest held prefixes requests reached, by their last block (an
  // open-addressing table: one miss and no allocation per decision): words
  // kReachRing (count of times recorded up to copy_min_requests | ring
  // position of the next << 32), kReachNewest (latest time), kReachDemand
  // (requests reaching it, decayed like traffic_; double bits) and from
  // kReachTimes the times of the latest copy_min_requests of them (a ring).
  static constexpr size_t kReachRing = 0, kReachNewest = 1, kReachDemand = 2, kReachTimes = 3;
  static constexpr size_t kMaxTrackedPrefixes = 1 << 16;
  std::unique_ptr<detail::BlockTable> prefix_reach_;  // with copies or relief only
  std::vector<uint64_t> stale_prefixes_;
};

}  // namespace pdserve::router
