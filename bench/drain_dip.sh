#!/usr/bin/env bash
# The hit-rate dip of a scale-down on the real stack: a router and 4 workers
# (role both, tiny model, CPU) warmed by a shared-prefix load, then one worker
# gets SIGTERM and the same load runs again. Three runs: nobody leaves, a
# worker leaves with the router's --drain-push-blocks (its hot prompts are
# written to the survivors first), and without. Prints one JSON line per run
# with the prefix-cache share (pdserve bench serve) before and after.
#   bench/drain_dip.sh PDSERVE_BIN
set -euo pipefail
bin="$(realpath "${1:?usage: $0 PDSERVE_BIN}")"
dir="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$dir"
}
trap cleanup EXIT

"$bin" make-model --preset tiny --out "$dir/model" >/dev/null
head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$dir/secret"
chmod 600 "$dir/secret"
load=(--workload shared-prefix --api completions --groups 8 --prefix-words 150 --suffix-words 10
  --requests 64 --concurrency 4 --max-tokens 8 --seed 1 --json)
machine="$(uname -sm), $(nproc) cores"

run() {  # name, leave (yes|no), router flags...
  local name="$1" leave="$2"
  shift 2
  local http=$((18000 + RANDOM % 1000)) control=$((19000 + RANDOM % 1000))
  pids=()
  "$bin" router --model "$dir/model" --host 127.0.0.1 --port "$http" --control-port "$control" \
    --cluster-secret-file "$dir/secret" "$@" >"$dir/router-$name.log" 2>&1 &
  pids+=($!)
  for i in 0 1 2 3; do
    "$bin" worker --role both --model "$dir/model" --router "127.0.0.1:$control" \
      --host 127.0.0.1 --port 0 --metrics-port 0 --worker-id "w$i" --threads 1 \
      --transfer-tls tcp --kv-cache-bytes 8MiB --cluster-secret-file "$dir/secret" \
      >"$dir/w$i-$name.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 300); do
    [ "$(grep -c ' synced' "$dir/router-$name.log" || true)" -ge 4 ] && break
    sleep 0.1
  done
  local before after
  before="$("$bin" bench serve --url "http://127.0.0.1:$http" "${load[@]}")"
  if [ "$leave" = yes ]; then
    kill -TERM "${pids[1]}"
    wait "${pids[1]}" || true
    sleep 0.5  # the survivors' KV events reach the router
  fi
  after="$("$bin" bench serve --url "http://127.0.0.1:$http" "${load[@]}")"
  python3 -c '
import json, sys
before, after = json.loads(sys.argv[1]), json.loads(sys.argv[2])
share = lambda j: j["cached_fraction"]
print(json.dumps({"bench": "drain_dip", "run": sys.argv[3], "machine": sys.argv[4],
                  "workers": 4, "groups": 8, "requests_per_phase": 64,
                  "router_flags": sys.argv[5], "share_before": share(before),
                  "share_after": share(after), "failed_after": after.get("failed", 0)}))
' "$before" "$after" "$name" "$machine" "$*"
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
}

run nobody_leaves no --drain-push-blocks 1000
run leave_with_push yes --drain-push-blocks 1000
run leave_without_push yes
