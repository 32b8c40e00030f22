#!/usr/bin/env bash
# TTFT of one prompt size with local prefill (on the decode worker) vs remote
# prefill (on a prefill worker, KV handed off over UCX), one request at a
# time, and the KV bytes that crossed per request. Prints the two
# `pdserve bench serve` JSON lines, each extended with "prefill" and
# "kv_bytes_per_request".
#
#   bench/ttft_local_vs_remote.sh [PDSERVE_BIN] [PRESET] [WORDS] [REQUESTS]
#
# Defaults: build/pdserve, the small preset, 400 words (about 512 tokens with
# its tokenizer and the chat template), 20 requests.
set -euo pipefail
bin="${1:-build/pdserve}"
preset="${2:-small}"
words="${3:-400}"
requests="${4:-20}"
work="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$work"' EXIT

"$bin" make-model --preset "$preset" --out "$work/model" >/dev/null
for mode in local remote; do
  limit=$([ "$mode" = local ] && echo 1000000 || echo 0)
  "$bin" up --dir "$work/$mode" --model "$work/model" --port 0 --control-port 0 \
    --prefill-metrics-port 0 --decode-metrics-port 0 --max-local-prefill "$limit" \
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
  bytes="$(curl -s "$decode_metrics" | awk '/^pdserve_kv_transfer_bytes_total/ {s += $2} END {print s + 0}')"
  jq -c --arg mode "$mode" --argjson bytes "$bytes" --argjson n "$requests" \
    '. + {prefill: $mode, kv_bytes_per_request: ($bytes / $n)}' <<<"$line"
  kill %1
  wait %1 || true
done
