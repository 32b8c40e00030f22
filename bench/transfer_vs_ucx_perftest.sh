#!/usr/bin/env bash
# Compares `pdserve bench transfer` with `ucx_perftest -t ucp_put_bw` (Debian
# ucx-utils) on the same UCX transports and message sizes, and prints a ratio
# table. One pdserve put carries one KV block, so the message size is the
# block size.
#
# ucx_perftest puts the same buffer to the same remote address over and over,
# so its working set stays in cache; pdserve writes scattered blocks of a pool.
# Each size is therefore measured twice for pdserve: with a one-block pool
# ("hot": the same buffer every time, the like-for-like comparison) and with a
# large pool of scattered blocks ("cold": what a KV cache does, bound by
# memory bandwidth, which ucx_perftest never measures).
#
# Every figure is the median of REPEAT runs, the tools taking turns, so that
# a burst of noise on a shared machine does not decide a ratio.
#
# Usage: bench/transfer_vs_ucx_perftest.sh [path/to/pdserve]
# Environment: SIZES (bytes, default "65536 262144 1048576 4194304"),
#   TLS_LIST (default "tcp shm"), SECONDS_PER_RUN (default 3),
#   HOT_BLOCKS (default 1), COLD_POOL_BYTES (default 268435456), REPEAT (default 3).
set -euo pipefail

PDSERVE=${1:-build/pdserve}
SIZES=${SIZES:-"65536 262144 1048576 4194304"}
TLS_LIST=${TLS_LIST:-"tcp shm"}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-3}
HOT_BLOCKS=${HOT_BLOCKS:-1}
COLD_POOL_BYTES=${COLD_POOL_BYTES:-268435456}
REPEAT=${REPEAT:-3}

command -v ucx_perftest >/dev/null || { echo "ucx_perftest not found (apt-get install ucx-utils)" >&2; exit 2; }
[[ -x "$PDSERVE" ]] || { echo "pdserve binary not found at $PDSERVE" >&2; exit 2; }

# ucx_perftest bandwidth in GB/s (10^9 B/s); it reports MB/s with MB = 2^20.
perftest_gbps() {
  local tls=$1 size=$2 iters=$3 port=$((20000 + RANDOM % 20000))
  UCX_TLS=$tls ucx_perftest -p "$port" >/dev/null 2>&1 &
  local server=$!
  sleep 1
  local line
  line=$(UCX_TLS=$tls timeout 120 ucx_perftest -p "$port" localhost -t ucp_put_bw -s "$size" \
           -n "$iters" 2>/dev/null | awk '/^Final:/ {print $7}')
  kill "$server" 2>/dev/null || true
  wait "$server" 2>/dev/null || true
  awk -v mb="$line" 'BEGIN { if (mb == "") print "nan"; else printf "%.3f", mb * 1048576 / 1e9 }'
}

pdserve_gbps() {
  local tls=$1 size=$2 blocks=$3
  "$PDSERVE" bench transfer --tls "$tls" --block-bytes "$size" --blocks "$blocks" \
    --seconds "$SECONDS_PER_RUN" --json 2>/dev/null |
    sed -n 's/.*"gbytes_per_s":\([0-9.eE+-]*\).*/\1/p' |
    awk '{ printf "%.3f", $1 }'
}

median() { sort -g | awk '{ v[NR] = $1 } END { if (NR == 0) print "nan"; else print v[int((NR + 1) / 2)] }'; }

cores=$(nproc)
cpu=$(awk -F': ' '/model name/ {print $2; exit}' /proc/cpuinfo)
echo "machine: $cores cores, $cpu; $(ucx_info -v | head -1 | sed 's/# //')"
printf '%-5s %10s %14s %14s %16s %10s %10s\n' tls msg_bytes pdserve_hot pdserve_cold ucx_perftest \
  ratio_hot ratio_cold
for tls in $TLS_LIST; do
  for size in $SIZES; do
    # Enough iterations for roughly SECONDS_PER_RUN at the transport's usual speed.
    if [[ $tls == tcp ]]; then budget=$((300 * 1024 * 1024)); else budget=$((8 * 1024 * 1024 * 1024)); fi
    iters=$((budget * SECONDS_PER_RUN / 3 / size))
    ((iters < 200)) && iters=200
    refs=() hots=() colds=()
    for ((r = 0; r < REPEAT; ++r)); do
      echo "  $tls $size: run $((r + 1)) of $REPEAT" >&2
      refs+=("$(perftest_gbps "$tls" "$size" "$iters")")
      hots+=("$(pdserve_gbps "$tls" "$size" "$HOT_BLOCKS")")
      colds+=("$(pdserve_gbps "$tls" "$size" $((COLD_POOL_BYTES / size)))")
    done
    ref=$(printf '%s\n' "${refs[@]}" | median)
    hot=$(printf '%s\n' "${hots[@]}" | median)
    cold=$(printf '%s\n' "${colds[@]}" | median)
    ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (b + 0 > 0) printf "%.2f", a / b; else print "nan" }'; }
    printf '%-5s %10s %14s %14s %16s %10s %10s\n' "$tls" "$size" "$hot" "$cold" "$ref" \
      "$(ratio "$hot" "$ref")" "$(ratio "$cold" "$ref")"
  done
done
echo "(GB/s = 10^9 bytes per second, median of $REPEAT runs; ratio = pdserve / ucx_perftest)"
