#!/usr/bin/env bash
# Routing simulator table: every policy on a Mooncake-format trace, plus a
# sweep of the kv policy's load weight. Prints JSON lines (one per run).
#   bench/router_sim_table.sh PDSERVE_BIN TRACE [WORKERS] [CAPACITY_BLOCKS]
set -euo pipefail
bin="${1:?usage: $0 PDSERVE_BIN TRACE [WORKERS] [CAPACITY_BLOCKS]}"
trace="${2:?usage: $0 PDSERVE_BIN TRACE [WORKERS] [CAPACITY_BLOCKS]}"
workers="${3:-16}"
capacity="${4:-8000}"
common=(--trace "$trace" --workers "$workers" --capacity-blocks "$capacity" --block-tokens 512 --json)
"$bin" sim "${common[@]}" --policy all
for weight in 0.1 0.5 1.0; do
  "$bin" sim "${common[@]}" --policy kv --load-weight "$weight"
done
for rate in 4000 16000; do
  for weight in 0.25 1.0; do
    "$bin" sim "${common[@]}" --policy kv --load-weight "$weight" --prefill-tokens-per-s "$rate"
  done
done
