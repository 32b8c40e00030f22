#!/usr/bin/env bash
# What connected-but-idle peers cost a transfer: every peer a writer connects
# to has a UCP worker of its own (docs/architecture.md, section 6), which the
# transfer's progress thread polls on each turn. `pdserve bench transfer
# --idle-peers N` keeps N further receivers connected while it writes to one;
# this runs N = 0, 8, 32, 64 in turns over ROUNDS rounds, for one small block
# per transfer (latency: one transfer in flight) and for large scattered
# transfers (bandwidth), and prints the JSON lines with "round" added.
#
# Usage: bench/transfer_idle_peers.sh [path/to/pdserve] > results.jsonl
# Environment: TLS (default tcp), ROUNDS (default 3), SECONDS_PER_RUN (default 2),
#   PEERS (default "0 8 32 64").
set -euo pipefail

PDSERVE=${1:-build/pdserve}
TLS=${TLS:-tcp}
ROUNDS=${ROUNDS:-3}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-2}
PEERS=${PEERS:-"0 8 32 64"}
[[ -x "$PDSERVE" ]] || { echo "pdserve binary not found at $PDSERVE" >&2; exit 2; }

for round in $(seq 1 "$ROUNDS"); do
  for shape in "16KiB 1 1" "256KiB 256 4"; do
    read -r bytes blocks inflight <<<"$shape"
    for n in $PEERS; do
      echo "round $round/$ROUNDS: $bytes x $blocks, $n idle peers" >&2
      "$PDSERVE" bench transfer --tls "$TLS" --block-bytes "$bytes" --blocks "$blocks" \
        --inflight "$inflight" --seconds "$SECONDS_PER_RUN" --idle-peers "$n" --json 2>/dev/null |
        sed "s/^{/{\"round\":$round,/"
    done
  done
done
