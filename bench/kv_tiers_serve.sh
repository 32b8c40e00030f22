#!/usr/bin/env bash
# Tiered KV cache on a real stack (issue 18): `pdserve up` with one decode
# worker that prefills locally, a device pool that holds about two of the
# workload's system prompts, and a shared-prefix workload over more of them
# (picked at random per request), so that without a lower tier most prefixes
# have been evicted by the time they come back:
#   device        the small pool alone;
#   device+host   the same pool with a host tier holding every prefix;
#   device+disk   the same pool with a disk tier alone (in a temporary folder);
#   large_device  a pool holding every prefix (the ceiling).
# One `pdserve bench serve` JSON line per setting, extended with the tiers,
# the pool sizes and the worker's tier counters (hit tokens per tier, onloads
# and their mean latency).
#   bench/kv_tiers_serve.sh [PDSERVE_BIN] [PRESET] [REQUESTS] [GROUPS] [PREFIX_WORDS]
# Defaults: build/pdserve, the small preset (fp32 KV: 8 KiB per token), 48
# requests at concurrency 2, 8 prompts of 760 words (about 2,000 tokens,
# 16 MiB of KV each); pool 40 MiB, host tier 256 MiB, disk tier 256 MiB.
set -euo pipefail
bin="${1:-build/pdserve}"
preset="${2:-small}"
requests="${3:-48}"
groups="${4:-8}"
prefix_words="${5:-760}"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin" make-model --preset "$preset" --out "$work/model" >/dev/null 2>&1
for setting in device device+host device+disk large_device; do
  pool=40MiB
  tiers=()
  case "$setting" in
    device+host) tiers=(--kv-host-cache-bytes 256MiB) ;;
    device+disk) tiers=(--kv-disk-cache-dir "$work/disk" --kv-disk-cache-bytes 256MiB) ;;
    large_device) pool=256MiB ;;
  esac
  "$bin" up --dir "$work/$setting" --model "$work/model" --port 0 --control-port 0 \
    --prefill 0 --decode 1 --decode-metrics-port 0 --kv-cache-bytes "$pool" "${tiers[@]}" \
    >"$work/$setting.log" 2>&1 &
  until grep -q "Ctrl-C stops" "$work/$setting.log"; do
    sleep 0.2
    kill -0 $! 2>/dev/null || { cat "$work/$setting.log" >&2; exit 1; }
  done
  url="$(grep -o 'ready at http://[0-9.:]*' "$work/$setting.log" | cut -d' ' -f3)"
  metrics="$(grep -o 'http://[0-9.:]*/metrics (decode-0)' "$work/$setting.log" | cut -d' ' -f1)"
  echo "kv_tiers_serve: $setting, $requests requests over $groups prompts of $prefix_words words" >&2
  line="$("$bin" bench serve --json --url "$url" --requests "$requests" --concurrency 2 \
    --groups "$groups" --prefix-words "$prefix_words" --suffix-words 20 --max-tokens 4)"
  LINE="$line" METRICS="$metrics" SETTING="$setting" POOL="$pool" PRESET="$preset" python3 -c '
import json, os, re, urllib.request
env = os.environ
text = urllib.request.urlopen(env["METRICS"]).read().decode()
def metric(name, tier):
    total = 0.0
    for l in text.splitlines():
        if l.startswith(name + "{") and re.search(r"tier=\"%s\"" % tier, l):
            total += float(l.split()[-1])
    return total
r = json.loads(env["LINE"])
tiers = {}
for tier in ("host", "disk"):
    n = metric("pdserve_kv_tier_onload_seconds_count", tier)
    tiers[tier] = {
        "hit_tokens": metric("pdserve_kv_tier_hit_tokens_total", tier),
        "onloads": n,
        "onload_ms_mean": 1e3 * metric("pdserve_kv_tier_onload_seconds_sum", tier) / n if n else 0,
        "offload_bytes": metric("pdserve_kv_tier_offload_bytes_total", tier),
    }
r.update(tiers=env["SETTING"], kv_cache_bytes=env["POOL"], preset=env["PRESET"], tier_metrics=tiers)
print(json.dumps(r))'
  kill %1
  wait %1 || true
done
