// The worker's Prometheus series (names as in docs/architecture.md section 8), in
// one place for the service shell and both sides of the KV hand-off.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "common/metrics/metrics.h"
#include "transport/control/connection.h"

namespace pdserve::worker {

struct WorkerMetrics {
  explicit WorkerMetrics(prometheus::Registry& r)
      : queries(metrics::AddCounter(
            r, "pdserve_prefix_cache_queries_tokens_total",
            "Prompt tokens looked up in the prefix cache for prefill computation")),
        hits(metrics::AddCounter(
            r, "pdserve_prefix_cache_hits_tokens_total",
            "Prompt tokens found in the prefix cache (blocks received by transfer are "
            "not hits)")),
        usage(metrics::AddGauge(r, "pdserve_kv_cache_usage_ratio",
                                "Fraction of KV blocks held by requests")),
        capacity(metrics::AddGaugeFamily(
            r, "pdserve_kv_cache_capacity_tokens",
            "Tokens of context one sequence can hold in the KV pool (blocks x block size; "
            "windowed layers counted at their window), labelled with its KV dtype")),
        running(metrics::AddGauge(r, "pdserve_requests_running",
                                  "Requests being prefilled or decoded")),
        waiting(metrics::AddGauge(r, "pdserve_requests_waiting",
                                  "Requests queued, including those waiting for remote KV")),
        ttft(metrics::AddHistogram(r, "pdserve_time_to_first_token_seconds",
                                   "Time from Generate to the first token",
                                   metrics::TimeToFirstTokenBuckets())),
        itl(metrics::AddHistogram(r, "pdserve_inter_token_latency_seconds",
                                  "Time between consecutive output tokens of a request",
                                  metrics::InterTokenLatencyBuckets())),
        transfer_seconds(metrics::AddHistogram(
            r, "pdserve_kv_transfer_seconds",
            "Time from a hand-off's first KV write to its last completing (a streamed prefill "
            "overlaps it with computing the prompt's later chunks)",
            metrics::KvTransferBuckets())),
        transfer_bytes(metrics::AddCounterFamily(r, "pdserve_kv_transfer_bytes_total",
                                                 "KV bytes moved between workers")),
        transfer_network_writes(metrics::AddCounter(
            r, "pdserve_kv_transfer_network_writes_total",
            "Network writes the KV transport issued (UCX puts and gathered chunk messages)")),
        transfer_failures(
            metrics::AddCounter(r, "pdserve_kv_transfer_failures_total",
                                "KV hand-offs that failed (transfer error, timeout, lost peer)")),
        staging_bytes_in_use(metrics::AddGauge(
            r, "pdserve_kv_staging_bytes_in_use",
            "Bytes of the KV transport's bounce buffers held by transfers in flight")),
        blocks_held_for_peers(metrics::AddGauge(
            r, "pdserve_kv_blocks_held_for_peers",
            "KV blocks of failed hand-offs kept out of use until the prefill peer that was to "
            "fill them can no longer write into them (its report or its transfer deadline)")),
        staging_bytes_reserved(metrics::AddGauge(
            r, "pdserve_kv_staging_bytes_reserved",
            "Bytes the KV transport reserved for bounce buffers (--kv-staging-bytes at most)")),
        evicted_tokens(metrics::AddCounterFamily(
            r, "pdserve_kv_evicted_tokens_total",
            "Tokens whose KV blocks were released because no later query reaches them, by mode "
            "(streaming: attention sinks; window: the model's sliding windows)")),
        blocks_saved(metrics::AddHistogram(
            r, "pdserve_kv_blocks_saved_per_request",
            "KV blocks a finished request released while it ran (windows, attention sinks): "
            "what it saved against dense attention",
            {0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536})),
        preemptions(
            metrics::AddCounter(r, "pdserve_preemptions_total",
                                "Sequences preempted for lack of KV blocks (recomputed later)")),
        requests(metrics::AddCounterFamily(
            r, "pdserve_requests_total", "Requests finished by this worker, by kind and outcome")),
        prefill_tokens(metrics::AddCounter(r, "pdserve_prompt_tokens_total",
                                           "Prompt tokens of requests admitted")),
        generation_tokens(
            metrics::AddCounter(r, "pdserve_generation_tokens_total", "Output tokens produced")),
        tier_blocks(metrics::AddGaugeFamily(
            r, "pdserve_kv_tier_blocks",
            "KV blocks held in a lower tier (tier=host|disk) behind the device pool")),
        tier_capacity(metrics::AddGaugeFamily(r, "pdserve_kv_tier_capacity_blocks",
                                              "KV blocks a lower tier can hold")),
        tier_hit_tokens(metrics::AddCounterFamily(
            r, "pdserve_kv_tier_hit_tokens_total",
            "Prompt tokens whose KV was copied back from a lower tier instead of computed")),
        tier_offload_bytes(metrics::AddCounterFamily(r, "pdserve_kv_tier_offload_bytes_total",
                                                     "KV bytes written into a lower tier")),
        tier_onload_bytes(metrics::AddCounterFamily(r, "pdserve_kv_tier_onload_bytes_total",
                                                    "KV bytes read out of a lower tier")),
        tier_onload_seconds(metrics::AddHistogramFamily(
            r, "pdserve_kv_tier_onload_seconds",
            "Time a request waited for its prefix to come back from the lower tiers (tier: the "
            "slowest one it came from)")),
        tier_corrupt(metrics::AddCounter(
            r, "pdserve_kv_tier_corrupt_blocks_total",
            "Disk-tier blocks that failed their checksums: dropped, never served")),
        disk_write_queue(
            metrics::AddGauge(r, "pdserve_kv_tier_disk_write_queue_blocks",
                              "Host-tier KV blocks waiting for their write-through copy on disk")),
        disk_writes(metrics::AddCounterFamily(
            r, "pdserve_kv_tier_disk_writes_total",
            "KV blocks written to the disk tier (cause=through: a write-through copy of a "
            "host-tier block; evict: a block written as it left the tier above; flush: at stop)")),
        disk_writes_dropped(metrics::AddCounter(
            r, "pdserve_kv_tier_disk_writes_dropped_total",
            "Host-tier KV blocks that found the write-through queue full (they reach the disk "
            "only when the host tier evicts them)")),
        disk_write_errors(metrics::AddCounter(
            r, "pdserve_kv_tier_disk_write_errors_total",
            "Disk-tier writes that failed (a full disk, an I/O error; the cause is logged at "
            "most every 10 s)")),
        disk_discarded(metrics::AddCounter(
            r, "pdserve_kv_tier_discarded_blocks_total",
            "Disk-tier KV blocks found at start that another model (weights, config, "
            "tokenizer) or KV configuration wrote: discarded, never served")),
        control_buffered_bytes(metrics::AddGauge(
            r, "pdserve_control_buffered_bytes",
            "Bytes held for control connections (routers and peer workers): incomplete "
            "received frames and queued sends")),
        control_refused(metrics::AddCounterFamily(
            r, "pdserve_control_refused_total",
            "Connections to the peer port refused before completing their handshake, by "
            "reason")),
        grammar_compile_seconds(metrics::AddHistogram(
            r, "pdserve_grammar_compile_seconds",
            "Time to compile a structured-output constraint and its token masks (cache misses)",
            metrics::TimeToFirstTokenBuckets())),
        grammar_requests(metrics::AddCounterFamily(r, "pdserve_grammar_requests_total",
                                                   "Constrained requests by how their grammar was "
                                                   "found (result=cached|compiled|failed)")),
        tensor_parallel_size(metrics::AddGauge(
            r, "pdserve_worker_tensor_parallel_size",
            "Ranks the worker's model is split across (docs/tensor-parallel.md); 1: one device")),
        rank_kv_usage(metrics::AddGaugeFamily(
            r, "pdserve_kv_cache_rank_usage_ratio",
            "Fraction of each tensor-parallel rank's KV pool shard held by requests, by rank (a "
            "block is a shard on every rank: the ranks fill alike)")),
        rank_kv_bytes(
            metrics::AddGaugeFamily(r, "pdserve_kv_cache_rank_bytes",
                                    "Bytes of each tensor-parallel rank's KV pool shard, by rank")),
        all_reduce_seconds(metrics::AddHistogram(
            r, "pdserve_worker_all_reduce_seconds",
            "Wall time of rank 0's tensor-parallel all-reduces (two per layer and step), the wait "
            "for the slowest rank included",
            {1e-6, 3e-6, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1})) {
    for (const char* result : {"cached", "compiled", "failed"})
      grammar_requests.Add({{"result", result}});
    for (const char* reason : control::kRefusalReasons) control_refused.Add({{"reason", reason}});
    // Both directions exist from the start at 0: throughput panels and
    // alerts see a series on every worker before the first hand-off.
    for (const char* direction : {"in", "out"}) transfer_bytes.Add({{"direction", direction}});
    // Every release mode at 0 too, so that the dashboard's eviction panel
    // reads 0, not "no data", on workers of dense models.
    for (const char* mode : {"streaming", "window", "snapkv"}) evicted_tokens.Add({{"mode", mode}});
  }

  // One finished request of `kind` ("decode" or "prefill") with `outcome`.
  void CountRequest(const char* kind, const char* outcome) {
    requests.Add({{"kind", kind}, {"outcome", outcome}}).Increment();
  }

  prometheus::Counter& queries;
  prometheus::Counter& hits;
  prometheus::Gauge& usage;
  prometheus::Family<prometheus::Gauge>& capacity;
  prometheus::Gauge& running;
  prometheus::Gauge& waiting;
  prometheus::Histogram& ttft;
  prometheus::Histogram& itl;
  prometheus::Histogram& transfer_seconds;
  prometheus::Family<prometheus::Counter>& transfer_bytes;
  prometheus::Counter& transfer_network_writes;
  prometheus::Counter& transfer_failures;
  prometheus::Gauge& staging_bytes_in_use;
  prometheus::Gauge& blocks_held_for_peers;
  prometheus::Gauge& staging_bytes_reserved;
  prometheus::Family<prometheus::Counter>& evicted_tokens;
  prometheus::Histogram& blocks_saved;
  prometheus::Counter& preemptions;
  prometheus::Family<prometheus::Counter>& requests;
  prometheus::Counter& prefill_tokens;
  prometheus::Counter& generation_tokens;
  prometheus::Family<prometheus::Gauge>& tier_blocks;
  prometheus::Family<prometheus::Gauge>& tier_capacity;
  prometheus::Family<prometheus::Counter>& tier_hit_tokens;
  prometheus::Family<prometheus::Counter>& tier_offload_bytes;
  prometheus::Family<prometheus::Counter>& tier_onload_bytes;
  prometheus::Family<prometheus::Histogram>& tier_onload_seconds;
  prometheus::Counter& tier_corrupt;
  prometheus::Gauge& disk_write_queue;
  prometheus::Family<prometheus::Counter>& disk_writes;
  prometheus::Counter& disk_writes_dropped;
  prometheus::Counter& disk_write_errors;
  prometheus::Counter& disk_discarded;
  prometheus::Gauge& control_buffered_bytes;
  prometheus::Family<prometheus::Counter>& control_refused;
  prometheus::Histogram& grammar_compile_seconds;
  prometheus::Family<prometheus::Counter>& grammar_requests;
  prometheus::Gauge& tensor_parallel_size;
  prometheus::Family<prometheus::Gauge>& rank_kv_usage;
  prometheus::Family<prometheus::Gauge>& rank_kv_bytes;
  prometheus::Histogram& all_reduce_seconds;
};

}  // namespace pdserve::worker
