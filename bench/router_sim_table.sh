#!/usr/bin/env bash
# Routing table of docs/routing.md: every policy (pdserve's kv with hot-prefix
# replication, the anchors' defaults, the baselines) on three traces, at
# 16 workers x {1000, 8000} blocks and time scales {1, 0.5}. Prints one JSON
# line per run (pdserve sim's fields plus trace_name and machine), then one
# "goal" line per (trace, capacity, time scale) comparing kv with the best
# anchor. Last, the scale-down lines: one of 4 workers leaves mid-trace,
# with and without pushing its hottest prefixes to the survivors, and the
# hit rate of the next 60 s against the same window with no one leaving.
#   bench/router_sim_table.sh PDSERVE_BIN CONVERSATION_TRACE
# The conversation trace is Mooncake's conversation_trace.jsonl (512-token
# blocks); the two other traces are generated with fixed seeds:
#   skew       8000 single-turn requests at 40/s over 4 system prompts of
#              8192 tokens, Zipf 1.5 (the hottest gets 60% of them)
#   multiturn  600 sessions of 10 turns (think time 20 s), 8 prompts of 2048
#              tokens at Zipf 0.5, arriving in 30 s on / 30 s off bursts
set -euo pipefail
bin="${1:?usage: $0 PDSERVE_BIN CONVERSATION_TRACE}"
conversation="${2:?usage: $0 PDSERVE_BIN CONVERSATION_TRACE}"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT

"$bin" trace generate --sessions 8000 --prefixes 4 --zipf 1.5 --prefix-tokens 8192 \
  --question-tokens 512 --answer-tokens 256 --rate 40 --seed 1 --output "$dir/skew.jsonl" 2>/dev/null
"$bin" trace generate --sessions 600 --turns 10 --prefixes 8 --zipf 0.5 --prefix-tokens 2048 \
  --question-tokens 400 --answer-tokens 300 --think-s 20 --rate 1.5 --arrival onoff \
  --on-s 30 --off-s 30 --seed 2 --output "$dir/multiturn.jsonl" 2>/dev/null

machine="$(uname -sm), $(nproc) cores"
for name in conversation skew multiturn; do
  trace="$conversation"
  [ "$name" = conversation ] || trace="$dir/$name.jsonl"
  for capacity in 1000 8000; do
    for scale in 1 0.5; do
      "$bin" sim --trace "$trace" --workers 16 --capacity-blocks "$capacity" --block-tokens 512 \
        --time-scale "$scale" --policy all --json 2>/dev/null |
        python3 -c '
import json, sys
name, machine = sys.argv[1], sys.argv[2]
rows = []
for line in sys.stdin:
    j = json.loads(line)
    j["trace"] = name  # not the file path
    j["trace_name"] = name
    j["machine"] = machine
    j["reuse_rate"] = j["hit_rate"] + j["copied_tokens"] / max(1, j["prompt_tokens"])
    rows.append(j)
    print(json.dumps(j))
kv = next(r for r in rows if r["policy"] == "kv")
anchors = [r for r in rows if r["policy"] in ("dynamo", "llm-d", "sglang", "production-stack")]
best_p99 = min(r["ttft_p99_s"] for r in anchors)
best_mean = min(r["ttft_mean_s"] for r in anchors)
best_reuse = max(r["reuse_rate"] for r in anchors)
best_hit = max(r["hit_rate"] for r in anchors)
print(json.dumps({
    "goal": "kv vs best anchor", "trace_name": name, "machine": machine,
    "capacity_blocks": kv["capacity_blocks"], "time_scale": kv["time_scale"],
    "kv_ttft_p99_s": kv["ttft_p99_s"], "best_anchor_ttft_p99_s": best_p99,
    "p99_reduction": 1 - kv["ttft_p99_s"] / best_p99 if best_p99 > 0 else 0,
    "kv_ttft_mean_s": kv["ttft_mean_s"], "best_anchor_ttft_mean_s": best_mean,
    "kv_reuse_rate": kv["reuse_rate"], "best_anchor_reuse_rate": best_reuse,
    "kv_hit_rate": kv["hit_rate"], "best_anchor_hit_rate": best_hit,
    "p99_and_mean_at_or_below_every_anchor":
        kv["ttft_p99_s"] <= best_p99 and kv["ttft_mean_s"] <= best_mean,
    "hit_within_2_points": kv["hit_rate"] >= best_hit - 0.02,
    "reuse_within_2_points": kv["reuse_rate"] >= best_reuse - 0.02,
}))
' "$name" "$machine"
    done
  done
done

"$bin" trace generate --sessions 400 --turns 10 --prefixes 8 --zipf 0.5 --prefix-tokens 2048 \
  --question-tokens 400 --answer-tokens 300 --think-s 20 --rate 0.5 --seed 3 \
  --output "$dir/scaledown.jsonl" 2>/dev/null
for run in "-1 true" "0 false" "0 true"; do
  set -- $run
  "$bin" sim --trace "$dir/scaledown.jsonl" --workers 4 --capacity-blocks 8000 --block-tokens 512 \
    --policy kv --remove-worker-at-s 400 --remove-worker "$1" --drain-push="$2" \
    --after-removal-s 60 --json 2>/dev/null |
    python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
j["trace"] = j["trace_name"] = "scaledown"
j["machine"] = sys.argv[1]
j["scenario"] = ("no worker leaves" if sys.argv[2] == "-1" else
                 "worker 0 drains, pushes its hottest prefixes" if sys.argv[3] == "true" else
                 "worker 0 drains, cache dropped")
print(json.dumps(j))
' "$machine" "$1" "$2"
done
