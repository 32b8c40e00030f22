#!/usr/bin/env bash
# TTFT of one prompt size, one request at a time, with
#   local            prefill on the decode worker itself,
#   remote           prefill on a prefill worker, each finished chunk's KV
#                    blocks handed off over UCX while the next chunk computes,
#   remote_unstreamed  the same, all blocks sent once the prompt is done,
# and the KV bytes that crossed per request. Prints three `pdserve bench
# serve` JSON lines, each extended with "prefill", "kv_bytes_per_request" and
# the settings. Every worker gets the same threads, so compute is equal.
#
#   bench/ttft_local_vs_remote.sh [PDSERVE_BIN] [PRESET] [WORDS] [REQUESTS] [DEVICE] [KV_DTYPE]
#
# Defaults: build/pdserve, the small preset, 760 words (about 2,048 tokens
# with its tokenizer and the chat template), 10 requests, device auto, fp32
# KV (the KV bytes a hand-off moves follow the KV dtype: compare them with
# several runs).
set -euo pipefail
bin="${1:-build/pdserve}"
preset="${2:-small}"
words="${3:-760}"
requests="${4:-10}"
device="${5:-auto}"
kv_dtype="${6:-fp32}"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin" make-model --preset "$preset" --out "$work/model" >/dev/null
for mode in local remote remote_unstreamed; do
  limit=$([ "$mode" = local ] && echo 1000000 || echo 0)
  stream=$([ "$mode" = remote_unstreamed ] && echo false || echo true)
  "$bin" up --dir "$work/$mode" --model "$work/model" --port 0 --control-port 0 \
    --prefill-metrics-port 0 --decode-metrics-port 0 --max-local-prefill "$limit" \
    --kv-stream-chunks="$stream" --device "$device" --kv-cache-bytes 256MiB --kv-dtype "$kv_dtype" \
    >"$work/$mode.log" 2>&1 &
  until grep -q "Ctrl-C stops" "$work/$mode.log"; do
    sleep 0.2
    kill -0 $! 2>/dev/null || { cat "$work/$mode.log" >&2; exit 1; }
  done
  url="$(grep -o 'ready at http://[0-9.:]*' "$work/$mode.log" | cut -d' ' -f3)"
  decode_metrics="$(grep -o 'http://[0-9.:]*/metrics (decode-0)' "$work/$mode.log" | cut -d' ' -f1)"
  echo "ttft_local_vs_remote: $mode prefill, $requests requests of ~$words words" >&2
  # Unique prompts (no prefix shared beyond the chat template), one in flight.
  line="$("$bin" bench serve --json --url "$url" --requests "$requests" --concurrency 1 \
    --groups 1 --prefix-words 0 --suffix-words "$words" --max-tokens 4)"
  # python3 rather than curl and jq: the GPU image has the one, not always the others.
  LINE="$line" METRICS="$decode_metrics" MODE="$mode" PRESET="$preset" DEVICE="$device" KV="$kv_dtype" \
    REQUESTS="$requests" WORDS="$words" python3 -c '
import json, os, urllib.request
env = os.environ
text = urllib.request.urlopen(env["METRICS"]).read().decode()
moved = sum(float(l.split()[-1]) for l in text.splitlines()
            if l.startswith("pdserve_kv_transfer_bytes_total"))
r = json.loads(env["LINE"])
r.update(prefill=env["MODE"], kv_bytes_per_request=moved / int(env["REQUESTS"]),
         preset=env["PRESET"], words=int(env["WORDS"]), device=env["DEVICE"], kv_dtype=env["KV"])
print(json.dumps(r))'
  kill %1
  wait %1 || true
done
