#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu-kit.tar.xz
# carried (bench/gpu/make_kit.sh): the gpu-labelled tests, compute-sanitizer memcheck
# over the kernel tests, then the GPU benchmarks (copy bandwidth, bf16 GEMM
# rate, paged decode attention, and the engine on Llama-3.1-8B shapes with
# dummy weights: batch-1 decode and a 4096-token prefill, bf16 and fp8 KV).
# Logs and JSON lines go to $OUT (or ./gpu-out); a summary prints last.
#
# Usage: bench/gpu/run_kit.sh [all|tests|bench]
set -uo pipefail

WHAT=${1:-all}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
KIT=$PWD/.gpu-kit
[[ -d $KIT || ! -f $KIT.tar.xz ]] || xz -dc "$KIT.tar.xz" | tar -xf -
[[ -x $KIT/bin/pdserve ]] || { echo "run_kit: $KIT is missing (bench/gpu/make_kit.sh)" >&2; exit 2; }
export LD_LIBRARY_PATH=$KIT/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export UCX_MODULE_DIR=$KIT/lib/ucx
export PATH=/usr/local/cuda/bin:$PATH
PDSERVE=$KIT/bin/pdserve
summary=()
step() { echo "== $*" >&2; }

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

if [[ $WHAT == all || $WHAT == tests ]]; then
  for t in cuda_rms_norm_test cuda_backend_test cuda_engine_test cuda_kv_transfer_test; do
    step "$t"
    if "$KIT/bin/$t" --gtest_brief=1 > "$OUT/$t.log" 2>&1; then r=pass; else r=FAIL; fi
    skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?[.,].*/\1/p' "$OUT/$t.log" | head -1)
    summary+=("$t: $r, ${skipped:-0} skipped")
  done
  for t in cuda_rms_norm_test cuda_backend_test; do
    step "compute-sanitizer memcheck $t"
    if compute-sanitizer --tool memcheck --error-exitcode 3 "$KIT/bin/$t" --gtest_brief=1 \
      > "$OUT/memcheck-$t.log" 2>&1; then r=clean; else r=ERRORS; fi
    summary+=("memcheck $t: $r")
  done
fi

if [[ $WHAT == all || $WHAT == bench ]]; then
  : > "$OUT/bench.jsonl"
  for kv in fp16 bf16 fp8; do
    step "bench kernels, $kv KV"
    "$PDSERVE" bench kernels --batch 64 --context 4096 --kv-dtype "$kv" 2>>"$OUT/bench.err" |
      tee -a "$OUT/bench.jsonl"
  done
  for kv in bf16 fp8; do
    step "bench engine, Llama-3.1-8B shapes, batch-1 decode, $kv KV"
    "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b --load-format dummy --device cuda \
      --kv-dtype "$kv" --batch 1 --prompt-tokens 512 --gen-tokens 64 --json \
      2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
    step "bench engine, Llama-3.1-8B shapes, 4096-token prefill, $kv KV"
    "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b --load-format dummy --device cuda \
      --kv-dtype "$kv" --batch 1 --prompt-tokens 4096 --gen-tokens 2 --max-batched-tokens 4096 \
      --json 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
  done
  summary+=("bench: $(grep -c . "$OUT/bench.jsonl") JSON lines in bench.jsonl")
fi

echo
printf '%s\n' "${summary[@]}"
