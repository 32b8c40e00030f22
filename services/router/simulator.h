// Routing simulator: replays a Mooncake-format request trace through the
// router's real RouterCore (prefix index, load view, policy) against
// simulated workers, to compare policies on prefix hit rate, TTFT and balance.
//
// Trace format (JSON lines): {"timestamp": ms, "input_length": tokens,
// "output_length": tokens, "hash_ids": [...]}, one id per block_tokens-token
// block of the prompt (the last may be partial); equal ids at equal positions
// mean the same prefix. The ids stand in for block hashes.
//
// Simulated worker (role `both`, one per --workers):
// - an LRU cache of capacity_blocks blocks. A prompt's leading cached blocks
//   are hits; the rest are inserted (earlier blocks kept more recent, so a
//   chain is evicted from its tail as an engine does). Evictions emit Removed
//   events when the prefill starts, insertions Stored events when it ends,
//   delivered to the router after event_delay_s.
// - one FIFO prefill queue; a prefill takes prefill_overhead_s + uncached
//   tokens / prefill_tokens_per_s and has priority over decode steps.
// - continuous-batching decode: a step takes decode_step_s +
//   decode_step_per_seq_s * batch and gives every running request a token.
// - Lower tiers (host_capacity_blocks, disk_capacity_blocks > 0): the
//   worker's cache is services/router/sim_kv_cache.h, placing blocks as the
//   engine's tiers do and announcing every move as the engine's KV events
//   (KvTier). A request whose device prefix continues in a lower tier waits
//   for those blocks on the worker's tier mover (one transfer at a time:
//   per block the tier's latency plus its bytes over the tier's bandwidth)
//   while the worker prefills and decodes others, then queues for the prefill
//   of the rest. Offloads cost nothing here: the engine makes them off the
//   step loop over the other direction of the link.
// - Load reports every load_report_interval_s.
// - Replication (policy kv, --replication): when the router decides to copy a
//   prefix's blocks from a holder (RouterCore copy_cost = copy time / prefill
//   time per token, from kv_bytes_per_token and copy_gbps), the copy takes
//   bytes / bandwidth on the source's and the target's links (one copy at a
//   time per link), then the blocks enter the target's LRU like computed ones
//   (so replicas age out) and the request joins the target's queue. Blocks
//   the source evicted before the copy starts are computed instead.
// - Scale-down (remove_at_s >= 0): at that time worker remove_worker starts
//   draining: the router sends it nothing new, it finishes its queued and
//   running requests, and with drain_push it pushes the prompts of its most
//   recently admitted requests (the blocks it still holds, up to
//   drain_push_blocks) to the survivors in turn, over the copy links. It
//   leaves (RouterCore::RemoveWorker) once idle and every push landed. The
//   hit rate of the requests arriving in the following after_removal_s shows
//   the dip.
// TTFT = end of the request's prefill - arrival. Hit rate = cached prompt
// tokens (device or lower tier) / prompt tokens at the workers (copied blocks count as copied, not
// as hits, for the request that asked for the copy); the oracle is one infinite cache
// seeing every request in arrival order. Work of a worker = prompt tokens it
// computed + tokens it generated; load imbalance = max / mean work.
#pragma once

#include <cstdint>
#include <functional>
#include <istream>
#include <string>
#include <vector>

#include "common/status.h"
#include "services/router/router_core.h"

namespace pdserve::router {

struct TraceRequest {
  int64_t timestamp_ms = 0;
  int64_t input_length = 0;
  int64_t output_length = 0;
  std::vector<uint64_t> hash_ids;
};

// Parses JSON lines; blank lines are skipped. InvalidArgument naming the line
// for malformed JSON, missing or negative fields, or a hash_ids count that is
// not ceil(input_length / block_tokens). Requests come back sorted by
// timestamp (stable).
StatusOr<std::vector<TraceRequest>> ParseMooncakeTrace(std::istream& in, int64_t block_tokens,
                                                       const std::string& source_name);
// NotFound when the file cannot be opened.
StatusOr<std::vector<TraceRequest>> LoadMooncakeTrace(const std::string& path,
                                                      int64_t block_tokens);

struct SimOptions {
  int64_t workers = 16;
  int64_t capacity_blocks = 8000;
  int64_t block_tokens = 512;
  std::string policy = "kv";
  PolicyOptions policy_options;
  double pending_ttl_s = 2.0;
  double prefill_tokens_per_s = 8000;
  double prefill_overhead_s = 0.005;
  double decode_step_s = 0.015;
  double decode_step_per_seq_s = 0.0002;
  double event_delay_s = 0.01;
  double load_report_interval_s = 0.1;
  // Arrival times are the trace's timestamps times this: 0.5 replays it
  // twice as fast (twice the load), 2 half as fast.
  double time_scale = 1.0;
  double remove_at_s = -1;    // < 0: no worker leaves
  int64_t remove_worker = 0;  // index of the worker that leaves; -1: none (baseline window)
  bool drain_push = true;     // it pushes its hottest prefixes to the survivors
  // Push budget in blocks (0: as many as it holds). The most recent prompts
  // matter most: on a 4-worker multi-turn trace 100 blocks already remove
  // the dip, while pushing all 2,000 held the copy links for seconds.
  int64_t drain_push_blocks = 1000;
  double after_removal_s = 60;                   // window of hit_rate_after_removal
  bool replication = true;                       // hot-prefix copies (policy kv only)
  int64_t replication_min_requests = 2;          // RouterOptions::copy_min_requests
  double replication_window_s = 10;              // RouterOptions::copy_window_us
  int64_t replication_max_inflight = 0;          // RouterOptions::copy_max_inflight
  double replication_max_copy_tokens_per_s = 0;  // RouterOptions::copy_max_tokens_per_s
  double kv_bytes_per_token = 131072;            // Llama-3-8B, bf16 KV
  double copy_gbps = 12.5;                       // GB/s of a worker's KV copy link
  // Lower tiers per worker, in blocks (0: none), and what an onload costs:
  // host memory over PCIe Gen4 x16 from pinned memory, one NVMe Gen4 drive.
  int64_t host_capacity_blocks = 0;
  int64_t disk_capacity_blocks = 0;
  double host_onload_gbps = 25;
  double host_onload_latency_s = 10e-6;  // per block
  double disk_onload_gbps = 6;
  double disk_onload_latency_s = 100e-6;  // per block
};

// What hot-prefix copies did to the receivers' caches and links (the
// mechanism behind a copy's price, docs/routing.md). Block counts are of
// copies that asked for a request (drain pushes are not included).
struct SimCopyStats {
  int64_t landed_blocks = 0;              // blocks new to the target when a copy landed
  int64_t reused_blocks = 0;              // of those, hit later by another request on the target
  int64_t evicted_unused_blocks = 0;      // evicted from the target before any such hit
  int64_t lost_before_use = 0;            // copies whose request found part of them evicted already
  int64_t evicted_blocks = 0;             // blocks a landing evicted from the target's device pool
  int64_t evicted_recomputed_blocks = 0;  // of those, computed again later (on any worker)
  int64_t link_waits = 0;                 // copies that waited for a busy source or target link
  double link_wait_s = 0;                 // their waits, summed
  double receiver_wait_s = 0;             // landing to the request's admission, summed
  int64_t widely_held = 0;  // copies of a prefix at least half the other workers held in full
  double holders_mean = 0;  // workers holding the whole copied prefix at its start, mean
};

struct SimResult {
  double load_weight = 0;  // the kv weights the router used (router::WithKvWeights)
  double decode_weight = 0;
  int64_t relief_decisions = 0;  // kv: decisions at the relief weights instead
  int64_t requests = 0;
  int64_t prompt_tokens = 0;
  int64_t hit_tokens = 0;            // served from the workers' caches, any tier
  int64_t host_hit_tokens = 0;       // of those, onloaded from a host tier
  int64_t disk_hit_tokens = 0;       // and from a disk tier
  int64_t predicted_hit_tokens = 0;  // the router's expectation at routing time
  int64_t predicted_host_hit_tokens = 0;
  int64_t predicted_disk_hit_tokens = 0;
  int64_t oracle_hit_tokens = 0;
  double hit_rate = 0;
  double oracle_hit_rate = 0;
  double predicted_hit_rate = 0;
  double ttft_p50_s = 0;
  double ttft_p99_s = 0;
  double ttft_mean_s = 0;
  double load_imbalance = 0;  // max / mean work
  int64_t replications_started = 0;
  int64_t replications_finished = 0;
  int64_t replications_failed = 0;  // the source no longer held the blocks
  int64_t copied_tokens = 0;
  double copied_bytes = 0;
  SimCopyStats copy;
  RouterStats router;        // the RouterCore's own counters (copy decisions declined, by reason)
  double removed_at_s = -1;  // when the leaving worker left
  int64_t drain_pushed_blocks = 0;    // blocks it pushed to survivors
  double hit_rate_after_removal = 0;  // of requests arriving in the window
  int64_t requests_after_removal = 0;
  int64_t onloads = 0;  // requests that waited for lower-tier blocks
  double onload_bytes = 0;
  double onload_wait_mean_s = 0;  // of those requests, from admission to blocks back
  double makespan_s = 0;          // simulated time until the last request finished
  std::vector<int64_t> work;      // per worker: prompt tokens computed + tokens generated
  std::vector<int64_t> routed;    // per worker: requests
  PrefixIndexStats index;
};

// InvalidArgument for non-positive sizes or rates, negative times, an unknown policy.
Status ValidateSimOptions(const SimOptions& options);

// Called every so often with (requests arrived, total).
using SimProgress = std::function<void(size_t, size_t)>;

// InvalidArgument for bad options (unknown policy, non-positive sizes or rates).
StatusOr<SimResult> RunSimulation(const std::vector<TraceRequest>& trace, const SimOptions& options,
                                  const SimProgress& progress = {});

// Oracle hit tokens of `trace`: one cache of unlimited size, arrival order.
int64_t OracleHitTokens(const std::vector<TraceRequest>& trace, int64_t block_tokens);

}  // namespace pdserve::router
