#!/usr/bin/env bash
# Tiered KV cache in the routing simulator (issue 18): Mooncake's
# conversation trace on 16 workers of 1,000 device blocks each, device only,
# with an 8,000-block host tier, with a 32,000-block disk tier below it, and
# with the disk tier alone;
# pdserve's kv policy and Dynamo's (both credit lower tiers at the
# --host-tier-weight / --disk-tier-weight defaults), at the trace's rate and
# twice it. One JSON line per run (pdserve sim's fields plus trace_name,
# tiers and machine), then one "tiers" line per (policy, time scale)
# comparing the tiered runs with the device-only one.
#   bench/kv_tiers_sim.sh PDSERVE_BIN CONVERSATION_TRACE
set -euo pipefail
bin="${1:?usage: $0 PDSERVE_BIN CONVERSATION_TRACE}"
trace="${2:?usage: $0 PDSERVE_BIN CONVERSATION_TRACE}"
machine="$(uname -sm), $(nproc) cores"
for scale in 1 0.5; do
  for tiers in "device" "device+host" "device+host+disk" "device+disk"; do
    args=()
    case "$tiers" in
      device+host) args=(--host-blocks 8000) ;;
      device+host+disk) args=(--host-blocks 8000 --disk-blocks 32000) ;;
      device+disk) args=(--disk-blocks 32000) ;;
    esac
    echo "kv_tiers_sim: time scale $scale, $tiers" >&2
    "$bin" sim --trace "$trace" --workers 16 --capacity-blocks 1000 --block-tokens 512 \
      --time-scale "$scale" --policy kv,dynamo "${args[@]}" --json 2>/dev/null |
      python3 -c '
import json, sys
for line in sys.stdin:
    j = json.loads(line)
    j["trace"] = j["trace_name"] = "conversation"
    j["tiers"] = sys.argv[1]
    j["machine"] = sys.argv[2]
    j["reuse_rate"] = j["hit_rate"] + j["copied_tokens"] / max(1, j["prompt_tokens"])
    print(json.dumps(j))
' "$tiers" "$machine"
  done
done | python3 -c '
import json, sys
rows = [json.loads(line) for line in sys.stdin]
for r in rows:
    print(json.dumps(r))
for scale in sorted({r["time_scale"] for r in rows}, reverse=True):
    for policy in ("kv", "dynamo"):
        by = {r["tiers"]: r for r in rows if r["policy"] == policy and r["time_scale"] == scale}
        base = by["device"]
        for tiers in ("device+host", "device+host+disk", "device+disk"):
            t = by[tiers]
            print(json.dumps({
                "tiers": tiers, "vs": "device", "policy": policy, "time_scale": scale,
                "trace_name": "conversation", "machine": rows[0]["machine"],
                "hit_rate": t["hit_rate"], "device_only_hit_rate": base["hit_rate"],
                "hit_rate_vs_oracle": t["hit_rate_vs_oracle"],
                "device_only_hit_rate_vs_oracle": base["hit_rate_vs_oracle"],
                "ttft_p50_s": t["ttft_p50_s"], "device_only_ttft_p50_s": base["ttft_p50_s"],
                "ttft_p99_s": t["ttft_p99_s"], "device_only_ttft_p99_s": base["ttft_p99_s"],
                "ttft_mean_s": t["ttft_mean_s"], "device_only_ttft_mean_s": base["ttft_mean_s"],
                "host_hit_tokens": t["host_hit_tokens"], "disk_hit_tokens": t["disk_hit_tokens"],
            }))
'

# The host tier's weight in the kv policy (disk at its default), with both
# tiers at the trace's rate: what a host block is worth against a device one.
for weight in 0 0.5 0.75 0.9 1; do
  echo "kv_tiers_sim: host tier weight $weight" >&2
  "$bin" sim --trace "$trace" --workers 16 --capacity-blocks 1000 --block-tokens 512 \
    --policy kv --host-blocks 8000 --disk-blocks 32000 --host-tier-weight "$weight" --json \
    2>/dev/null |
    python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
j["trace"] = j["trace_name"] = "conversation"
j["tiers"] = "device+host+disk"
j["sweep"] = "host_tier_weight"
j["machine"] = sys.argv[1]
j["reuse_rate"] = j["hit_rate"] + j["copied_tokens"] / max(1, j["prompt_tokens"])
print(json.dumps(j))
' "$machine"
done
