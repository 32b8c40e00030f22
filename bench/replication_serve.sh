#!/usr/bin/env bash
# Hot-prefix replication on the real stack past capacity: `pdserve up` with
# 4 decode workers (no prefill pool; the small preset, 1 thread each, KV
# pools far smaller than the prefixes' working set) driven by `pdserve bench
# serve` replaying a trace of many long Zipf-popular prefixes with more
# clients than the workers can serve, once with the router's copies on
# (--replication-copy-cost: the chart's 0.084, or COPY_COST) and once off,
# RUNS times each in turn. Prints one JSON line per run: TTFT, failures,
# the prefix-cache share, and the router's copy counters
# (started/finished/failed, declined by reason, reused/unused).
#   bench/replication_serve.sh PDSERVE_BIN [RUNS] [REQUESTS]
set -euo pipefail
bin="$(realpath "${1:?usage: $0 PDSERVE_BIN [RUNS] [REQUESTS]}")"
runs="${2:-2}"
requests="${3:-400}"
dir="$(mktemp -d)"
stack=""
cleanup() {
  if [ -n "$stack" ]; then kill -TERM "$stack" 2>/dev/null || true; fi
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

"$bin" make-model --preset small --out "$dir/model" >/dev/null
# 200 prefixes of 5-30 blocks at Zipf 1.1; --trace-block-words 12 makes a
# block 12 words, a prefix 60-360 words (about 100-700 tokens), against 32 MiB
# pools of about 4,000 tokens each.
"$bin" trace generate --sessions "$requests" --prefixes 200 --zipf 1.1 --prefix-tokens 2560 \
  --prefix-tokens-max 15360 --question-tokens 512 --answer-tokens 8 --rate 1000 --seed 7 \
  --output "$dir/trace.jsonl" 2>/dev/null
cpu="$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs || true)"
machine() { echo "$(uname -sm), $(nproc) cores (${cpu:-unknown CPU}), load $(cut -d' ' -f1 /proc/loadavg), shared with other builds and tests"; }

run() {  # name copy_cost
  local name="$1" cost="$2" http=$((18000 + RANDOM % 1000)) control=$((19000 + RANDOM % 1000))
  "$bin" up --dir "$dir/up-$name" --model "$dir/model" --prefill 0 --decode 4 --threads 1 \
    --port "$http" --control-port "$control" --prefill-metrics-port 0 --decode-metrics-port 0 \
    --kv-cache-bytes 32MiB --replication-copy-cost "$cost" --stop-timeout 10 \
    >"$dir/up-$name.log" 2>&1 &
  stack=$!
  for _ in $(seq 600); do
    grep -q 'Ctrl-C stops the stack' "$dir/up-$name.log" && break
    sleep 0.2
  done
  local result metrics load_before
  load_before="$(machine)"
  result="$("$bin" bench serve --url "http://127.0.0.1:$http" --api completions --workload trace \
    --trace "$dir/trace.jsonl" --trace-block-words 12 --requests "$requests" --concurrency 16 \
    --max-tokens 4 --timeout 300 --json 2>/dev/null)"
  metrics="$(curl -s "http://127.0.0.1:$http/metrics" | grep -E '^pdserve_router_(replications|copies_declined|copy_outcomes|copy_breaker_trips)' || true)"
  kill -TERM "$stack"
  wait "$stack" || true
  stack=""
  python3 -c '
import json, re, sys
r = json.loads(sys.argv[1])
counters = {}
for line in sys.argv[2].splitlines():
    m = re.match(r"(pdserve_router_\w+?)(?:_total)?(?:\{(\w+)=\"(\w+)\"\})? ([0-9.e+-]+)$", line)
    if m:
        name = m.group(1).replace("pdserve_router_", "") + ("_" + m.group(3) if m.group(3) else "")
        counters[name] = float(m.group(4))
print(json.dumps({"bench": "replication_serve", "run": sys.argv[3], "copy_cost": float(sys.argv[4]),
                  "machine": sys.argv[5], "workers": 4, "preset": "small", "threads_per_worker": 1,
                  "kv_cache_bytes": 32 << 20, "requests": r["settings"]["requests"], "concurrency": 16,
                  "ok": r["ok"], "failed": r["failed"], "cached_fraction": r["cached_fraction"],
                  "ttft_ms": r["ttft_ms"], "e2e_ms": r["e2e_ms"], "requests_per_s": r["requests_per_s"], "duration_s": r["duration_s"], "prompt_tokens": r["prompt_tokens"],
                  "router": counters}))
' "$result" "$metrics" "$name" "$cost" "$load_before"
}

for i in $(seq "$runs"); do
  run "copies_on_$i" "${COPY_COST:-0.084}"
  run "copies_off_$i" 0
done
