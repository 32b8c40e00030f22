// pdserve sim: replays a request trace through the router's real index and
// policy code against simulated workers (services/router/simulator.h).
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "services/cli/command.h"
#include "services/router/simulator.h"

namespace pdserve::cli {
namespace {

using router::SimOptions;
using router::SimResult;

// "kv", "kv,random" or "all" -> policy names; empty on an unknown name.
std::vector<std::string> ParsePolicyList(const std::string& text, std::string* bad) {
  const auto& known = router::PolicyNames();
  if (text == "all") return known;
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string name = text.substr(start, comma - start);
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      *bad = name;
      return {};
    }
    out.push_back(name);
    start = comma + 1;
  }
  return out;
}

nlohmann::json ResultJson(const SimOptions& o, const std::string& trace, const SimResult& r) {
  nlohmann::json j = {
      {"policy", o.policy},
      {"hit_rate", r.hit_rate},
      {"oracle_hit_rate", r.oracle_hit_rate},
      {"hit_rate_vs_oracle", r.oracle_hit_rate > 0 ? r.hit_rate / r.oracle_hit_rate : 1.0},
      {"predicted_hit_rate", r.predicted_hit_rate},
      {"ttft_p50_s", r.ttft_p50_s},
      {"ttft_p99_s", r.ttft_p99_s},
      {"ttft_mean_s", r.ttft_mean_s},
      {"load_imbalance", r.load_imbalance},
      {"requests", r.requests},
      {"prompt_tokens", r.prompt_tokens},
      {"makespan_s", r.makespan_s},
      {"index_rejected_stores", r.index.rejected_stores},
      {"index_gaps", r.index.gaps},
      {"trace", trace},
      {"workers", o.workers},
      {"capacity_blocks", o.capacity_blocks},
      {"block_tokens", o.block_tokens},
      {"load_weight", r.load_weight},
      {"decode_weight", r.decode_weight},
      {"relief_decisions", r.relief_decisions},
      {"temperature", o.policy_options.temperature},
      {"seed", o.policy_options.seed},
      {"pending_ttl_s", o.pending_ttl_s},
      {"prefill_tokens_per_s", o.prefill_tokens_per_s},
      {"prefill_overhead_s", o.prefill_overhead_s},
      {"decode_step_s", o.decode_step_s},
      {"decode_step_per_seq_s", o.decode_step_per_seq_s},
      {"event_delay_s", o.event_delay_s},
      {"load_report_interval_s", o.load_report_interval_s},
      {"time_scale", o.time_scale},
      {"replication", o.replication && o.policy == "kv"},
      {"kv_bytes_per_token", o.kv_bytes_per_token},
      {"copy_gbps", o.copy_gbps},
      {"replication_min_requests", o.replication_min_requests},
      {"replication_window_s", o.replication_window_s},
      {"replication_max_inflight", o.replication_max_inflight},
      {"replication_max_copy_tokens_per_s", o.replication_max_copy_tokens_per_s},
      {"replications_started", r.replications_started},
      {"replications_finished", r.replications_finished},
      {"replications_failed", r.replications_failed},
      {"copied_tokens", r.copied_tokens},
      {"copied_bytes", r.copied_bytes},
      {"copy_landed_blocks", r.copy.landed_blocks},
      {"copy_reused_blocks", r.copy.reused_blocks},
      {"copy_evicted_unused_blocks", r.copy.evicted_unused_blocks},
      {"copy_lost_before_use", r.copy.lost_before_use},
      {"copy_evicted_blocks", r.copy.evicted_blocks},
      {"copy_evicted_recomputed_blocks", r.copy.evicted_recomputed_blocks},
      {"copy_link_waits", r.copy.link_waits},
      {"copy_link_wait_s", r.copy.link_wait_s},
      {"copy_receiver_wait_s", r.copy.receiver_wait_s},
      {"copies_widely_held", r.copy.widely_held},
      {"copy_holders_mean", r.copy.holders_mean},
      {"remove_worker_at_s", o.remove_at_s},
      {"drain_push", o.drain_push},
      {"removed_at_s", r.removed_at_s},
      {"drain_pushed_blocks", r.drain_pushed_blocks},
      {"hit_rate_after_removal", r.hit_rate_after_removal},
      {"requests_after_removal", r.requests_after_removal},
      {"host_capacity_blocks", o.host_capacity_blocks},
      {"disk_capacity_blocks", o.disk_capacity_blocks},
      {"host_onload_gbps", o.host_onload_gbps},
      {"host_onload_latency_s", o.host_onload_latency_s},
      {"disk_onload_gbps", o.disk_onload_gbps},
      {"disk_onload_latency_s", o.disk_onload_latency_s},
      {"host_tier_weight", o.policy_options.host_tier_weight},
      {"disk_tier_weight", o.policy_options.disk_tier_weight},
      {"host_hit_tokens", r.host_hit_tokens},
      {"disk_hit_tokens", r.disk_hit_tokens},
      {"predicted_host_hit_tokens", r.predicted_host_hit_tokens},
      {"predicted_disk_hit_tokens", r.predicted_disk_hit_tokens},
      {"onloads", r.onloads},
      {"onload_bytes", r.onload_bytes},
      {"onload_wait_mean_s", r.onload_wait_mean_s},
      {"copy_outcomes_reused", r.router.copy.reused},
      {"copy_outcomes_unused", r.router.copy.unused},
      {"copy_reuse_ratio", r.router.copy.reuse_ratio},
      {"copy_breaker_trips", r.router.copy.breaker_trips},
      {"copy_breaker", router::CopyBreakerName(r.router.copy.breaker)},
      {"copy_budget_scale", r.router.copy.budget_scale},
  };
  for (size_t k = 0; k < router::kCopyDeclineCount; ++k) {
    j[std::string("copies_declined_") +
      router::CopyDeclineName(static_cast<router::CopyDecline>(k))] = r.router.copy.declined[k];
  }
  return j;
}

int RunSim(int argc, char** argv) {
  FlagSet flags("sim", "Replay a Mooncake-format trace through the router's index and policies.");
  std::string trace_path;
  std::string policies = "kv";
  SimOptions o;
  int64_t seed = 1;
  double pending_ttl_ms = o.pending_ttl_s * 1e3;
  double prefill_overhead_ms = o.prefill_overhead_s * 1e3;
  double decode_step_ms = o.decode_step_s * 1e3;
  double decode_step_per_seq_ms = o.decode_step_per_seq_s * 1e3;
  double event_delay_ms = o.event_delay_s * 1e3;
  double load_report_ms = o.load_report_interval_s * 1e3;
  double host_onload_latency_us = o.host_onload_latency_s * 1e6;
  double disk_onload_latency_us = o.disk_onload_latency_s * 1e6;
  bool json = false;
  flags.AddString("trace", &trace_path,
                  "trace file: JSON lines with timestamp (ms), "
                  "input_length, output_length, hash_ids");
  flags.AddInt("workers", &o.workers, "simulated workers (role both)");
  flags.AddInt("capacity-blocks", &o.capacity_blocks, "KV cache blocks per worker (LRU)");
  flags.AddInt("block-tokens", &o.block_tokens, "tokens per block of the trace's hash_ids");
  flags.AddString("policy", &policies,
                  "routing policy: " + router::PolicyChoices() + ", a comma list, or all");
  // Unset, kv's follow router::WithKvWeights (per decision).
  auto optional_double = [](std::optional<double>* out) {
    return [out](std::string_view text) {
      const std::string t(text);
      char* end = nullptr;
      const double v = std::strtod(t.c_str(), &end);
      if (t.empty() || end != t.c_str() + t.size()) {
        return Status::InvalidArgument("not a number: '" + t + "'");
      }
      *out = v;
      return Status::Ok();
    };
  };
  flags.AddCustom("load-weight", "X", "1/6, 1 to relieve an under-held hot prefix",
                  optional_double(&o.policy_options.load_weight),
                  "kv: weight of the predicted delay (queued work, requests waiting behind) "
                  "against uncached prompt tokens");
  flags.AddCustom("decode-weight", "X", "kv 0.01 (0.1 to relieve), least_loaded 0.05",
                  optional_double(&o.policy_options.decode_weight),
                  "kv, least_loaded: weight of running requests' KV tokens in queued work");
  flags.AddDouble("temperature", &o.policy_options.temperature,
                  "kv: softmax temperature for a randomised choice (0 = cheapest)");
  flags.AddInt("seed", &seed, "random seed (random policy, kv with temperature)");
  flags.AddDouble("pending-ttl-ms", &pending_ttl_ms,
                  "how long routed-but-unconfirmed blocks count as held");
  flags.AddDouble("prefill-tokens-per-s", &o.prefill_tokens_per_s,
                  "simulated prefill speed of one worker");
  flags.AddDouble("prefill-overhead-ms", &prefill_overhead_ms, "fixed cost of one prefill");
  flags.AddDouble("decode-step-ms", &decode_step_ms, "decode step time at batch size 0");
  flags.AddDouble("decode-step-per-seq-ms", &decode_step_per_seq_ms,
                  "decode step time added per running request");
  flags.AddDouble("event-delay-ms", &event_delay_ms, "KV event delivery delay to the router");
  flags.AddDouble("load-report-ms", &load_report_ms, "interval of workers' Load reports");
  flags.AddBool("replication", &o.replication,
                "kv: copy a hot prefix's KV blocks to a less loaded worker when that beats "
                "waiting for the holders (--replication=false: never)");
  flags.AddInt("replication-min-requests", &o.replication_min_requests,
               "kv: a prefix is copied only once this many requests (the one routed included) "
               "reached it as their longest cached prefix within --replication-window-s");
  flags.AddDouble("replication-window-s", &o.replication_window_s,
                  "kv: the window of --replication-min-requests");
  flags.AddInt("replication-max-inflight", &o.replication_max_inflight,
               "kv: copies in flight at full budget (0: one per two workers)");
  flags.AddDouble("replication-max-copy-tokens-per-s", &o.replication_max_copy_tokens_per_s,
                  "kv: copied prompt tokens per second at full budget (0: no rate budget)");
  flags.AddDouble("kv-bytes-per-token", &o.kv_bytes_per_token,
                  "KV cache bytes of one token (all layers), for copy times");
  flags.AddDouble("copy-gbps", &o.copy_gbps, "GB/s of each worker's KV copy link");
  flags.AddInt("host-blocks", &o.host_capacity_blocks,
               "host-memory KV tier per worker, in blocks (0: none)");
  flags.AddInt("disk-blocks", &o.disk_capacity_blocks,
               "local-disk KV tier per worker, in blocks (0: none)");
  flags.AddDouble("host-onload-gbps", &o.host_onload_gbps, "GB/s of a host tier -> device copy");
  flags.AddDouble("host-onload-latency-us", &host_onload_latency_us,
                  "fixed cost of one block's host tier -> device copy");
  flags.AddDouble("disk-onload-gbps", &o.disk_onload_gbps, "GB/s of a disk tier read");
  flags.AddDouble("disk-onload-latency-us", &disk_onload_latency_us,
                  "fixed cost of one block's disk tier read");
  flags.AddDouble("host-tier-weight", &o.policy_options.host_tier_weight,
                  "kv, dynamo: a prompt token in a worker's host tier, against one in its "
                  "device pool (1) and one to compute (0)");
  flags.AddDouble("disk-tier-weight", &o.policy_options.disk_tier_weight,
                  "kv, dynamo: a prompt token in a worker's disk tier, likewise");
  flags.AddDouble("remove-worker-at-s", &o.remove_at_s,
                  "scale-down: at this simulated second a worker drains and leaves (< 0: never)");
  flags.AddInt("remove-worker", &o.remove_worker,
               "index of the worker that leaves (-1: none, to measure the same window without)");
  flags.AddBool("drain-push", &o.drain_push,
                "the leaving worker pushes its most recent prompts' blocks to the survivors");
  flags.AddInt("drain-push-blocks", &o.drain_push_blocks,
               "most blocks the leaving worker pushes (0: as many as it holds)");
  flags.AddDouble("after-removal-s", &o.after_removal_s,
                  "window after the removal whose arrivals give hit_rate_after_removal");
  flags.AddDouble("time-scale", &o.time_scale,
                  "multiply the trace's timestamps: 0.5 replays it twice as fast");
  flags.AddBool("json", &json, "print one JSON line per policy");
  flags.SetEpilog(
      "Example: pdserve sim --trace conversation_trace.jsonl --workers 16 --capacity-blocks 8000 "
      "--block-tokens 512 --policy all --json");
  ParseFlagsOrExit(flags, argc, argv);

  if (trace_path.empty()) UsageError("sim", "--trace is required");
  std::string bad;
  const std::vector<std::string> names = ParsePolicyList(policies, &bad);
  if (names.empty()) {
    UsageError("sim", "--policy: unknown policy '" + bad + "' (valid: " + router::PolicyChoices() +
                          "|all)");
  }
  if (seed < 0) UsageError("sim", "--seed must not be negative");
  o.policy_options.seed = static_cast<uint64_t>(seed);
  o.pending_ttl_s = pending_ttl_ms / 1e3;
  o.prefill_overhead_s = prefill_overhead_ms / 1e3;
  o.decode_step_s = decode_step_ms / 1e3;
  o.decode_step_per_seq_s = decode_step_per_seq_ms / 1e3;
  o.event_delay_s = event_delay_ms / 1e3;
  o.load_report_interval_s = load_report_ms / 1e3;
  o.host_onload_latency_s = host_onload_latency_us / 1e6;
  o.disk_onload_latency_s = disk_onload_latency_us / 1e6;

  for (const std::string& name : names) {
    o.policy = name;
    if (Status st = router::ValidateSimOptions(o); !st.ok()) UsageError("sim", st.message());
  }
  auto trace = router::LoadMooncakeTrace(trace_path, o.block_tokens);
  if (!trace.ok()) UsageError("sim", trace.status().message());
  std::fprintf(stderr, "sim: %zu requests from %s\n", trace->size(), trace_path.c_str());

  if (!json) {
    std::printf("%-16s %9s %9s %9s %10s %10s %10s\n", "policy", "hit_rate", "oracle", "of_oracle",
                "ttft_p50_s", "ttft_p99_s", "imbalance");
  }
  for (const std::string& name : names) {
    o.policy = name;
    auto progress = [&](size_t done, size_t total) {
      std::fprintf(stderr, "sim %s: %zu/%zu requests (%.0f%%)\n", name.c_str(), done, total,
                   100.0 * static_cast<double>(done) / static_cast<double>(total));
    };
    auto result = router::RunSimulation(*trace, o, progress);
    if (!result.ok()) {
      if (result.status().code() == StatusCode::kInvalidArgument) {
        UsageError("sim", result.status().message());
      }
      std::fprintf(stderr, "pdserve sim: %s\n", result.status().ToString().c_str());
      return 1;
    }
    const SimResult& r = *result;
    if (json) {
      std::printf("%s\n", ResultJson(o, trace_path, r).dump().c_str());
    } else {
      std::printf("%-16s %9.4f %9.4f %8.1f%% %10.3f %10.3f %10.3f\n", name.c_str(), r.hit_rate,
                  r.oracle_hit_rate,
                  r.oracle_hit_rate > 0 ? 100.0 * r.hit_rate / r.oracle_hit_rate : 100.0,
                  r.ttft_p50_s, r.ttft_p99_s, r.load_imbalance);
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

PDSERVE_COMMAND("sim", "routing simulator: replay a trace through the router's policies", RunSim);

}  // namespace pdserve::cli
