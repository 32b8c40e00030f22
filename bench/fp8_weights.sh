#!/bin/sh
# FP8 weights (docs/weight-quantisation.md): what each format costs in
# quality and what it gains in CPU decode speed.
#
# quality: `pdserve eval` of each FP8 format of stories260K (quantised with
# make-model --from) and of the small, qwen3-moe and deepseek-v3 presets
# (quantised from the same random weights) against the unquantised model
# (--baseline), plus the checkpoint's bytes per parameter. One JSON line per
# model and format.
# speed: `pdserve bench engine` on the small preset, batch-1 decode after a
# 256-token prompt, bf16 against each FP8 format, fp32 KV, ROUNDS times.
# With BEFORE (another pdserve binary) each run is paired with one of BEFORE
# on the same model, back to back, the order alternating from round to
# round; each line then has `variant` (before or after).
#
# Usage: bench/fp8_weights.sh quality|speed [BUILD_DIR] [THREADS] [STORIES260K_DIR] [ROUNDS] [BEFORE] > bench/results/...jsonl
set -eu
what=$1
build=${2:-build}
threads=${3:-2}
stories=${4:-../shared/models/stories260K}
rounds=${5:-1}
before=${6:-}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
text=bench/eval/tinystories.txt

# eval MODEL BASELINE NAME FORMAT: one JSON line with the checkpoint's size
# (weights_gib) added and the baseline's folder given as NAME.
eval_line() {
  bytes=$("$build/pdserve" plan --config "$1/config.json" --weights-from "$1" --gpu-mem-gib 1024 \
    --json | sed 's/.*"weights_gib":\([0-9.e+-]*\).*/\1/')
  "$build/pdserve" eval --model "$1" --baseline "$2" --text "$text" --threads "$threads" --json |
    sed -e "s/^{/{\"eval_model\":\"$3\",\"format\":\"$4\",\"weights_gib\":$bytes,/" \
      -e "s|\"baseline\":\"[^\"]*\"|\"baseline\":\"$3\"|"
}

if [ "$what" = quality ]; then
  if [ -d "$stories" ]; then
    eval_line "$stories" "$stories" stories260K fp32
    for q in fp8-tensor fp8-channel fp8-block; do
      "$build/pdserve" make-model --from "$stories" --quant "$q" --out "$dir/stories-$q" >&2
      eval_line "$dir/stories-$q" "$stories" stories260K "$q"
    done
  fi
  for preset in small qwen3-moe deepseek-v3; do
    dtype=fp32
    [ "$preset" = small ] && dtype=bf16
    "$build/pdserve" make-model --preset "$preset" --dtype "$dtype" --out "$dir/$preset" >&2
    eval_line "$dir/$preset" "$dir/$preset" "$preset" "$dtype"
    for q in fp8-tensor fp8-channel fp8-block; do
      "$build/pdserve" make-model --preset "$preset" --dtype "$dtype" --quant "$q" \
        --out "$dir/$preset-$q" >&2
      eval_line "$dir/$preset-$q" "$dir/$preset" "$preset" "$q"
    done
  done
elif [ "$what" = speed ]; then
  "$build/pdserve" make-model --preset small --dtype bf16 --out "$dir/bf16" >&2
  for q in fp8-tensor fp8-channel fp8-block; do
    "$build/pdserve" make-model --preset small --dtype bf16 --quant "$q" --out "$dir/$q" >&2
  done
  # The formats interleaved, round after round, so that a change in the
  # machine's load falls on all of them.
  # run BINARY FORMAT ROUND [VARIANT]: one JSON line.
  run() {
    tag="\"format\":\"$2\",\"round\":$3,"
    [ -n "${4:-}" ] && tag="$tag\"variant\":\"$4\","
    "$1" bench engine --model "$dir/$2" --threads "$threads" --batch 1 \
      --prompt-tokens 256 --gen-tokens 128 --kv-dtype fp32 --json | sed "s/^{/{$tag/"
  }
  for round in $(seq "$rounds"); do
    for q in bf16 fp8-tensor fp8-channel fp8-block; do
      if [ -z "$before" ]; then
        run "$build/pdserve" "$q" "$round"
      elif [ $((round % 2)) = 1 ]; then
        run "$before" "$q" "$round" before
        run "$build/pdserve" "$q" "$round" after
      else
        run "$build/pdserve" "$q" "$round" after
        run "$before" "$q" "$round" before
      fi
    done
  done
else
  echo "usage: $0 quality|speed [BUILD_DIR] [THREADS] [STORIES260K_DIR] [ROUNDS] [BEFORE]" >&2
  exit 2
fi
