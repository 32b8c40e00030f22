#!/bin/sh
# The CPU engine figures of issue 21 on the `small` preset: fp32 and bf16
# weights, fp32 / fp16 / fp8 / nvfp4 KV, decode at batch 1, 8 and 32 after a
# 256-token prompt, and a 512-token prefill in one chunk. One JSON line per
# result (`pdserve bench engine --json`): the machine, the SIMD level, the
# measured read bandwidth, decode as a fraction of it and the load average
# are in each line.
#
# Usage: bench/cpu_engine_small.sh [BUILD_DIR] [THREADS] > bench/results/engine-small-DATE-cpu.jsonl
set -eu
build=${1:-build}
threads=${2:-2}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$build/pdserve" make-model --preset small --out "$dir/fp32" >&2
"$build/pdserve" make-model --preset small --dtype bf16 --out "$dir/bf16" >&2
for weights in fp32 bf16; do
  for kv in fp32 fp16 fp8 nvfp4; do
    "$build/pdserve" bench engine --model "$dir/$weights" --threads "$threads" --batch 1,8,32 \
      --prompt-tokens 256 --gen-tokens 128 --kv-dtype "$kv" --json
  done
  "$build/pdserve" bench engine --model "$dir/$weights" --threads "$threads" --batch 1 \
    --prompt-tokens 512 --gen-tokens 2 --max-batched-tokens 512 --json
done
