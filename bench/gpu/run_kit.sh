#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, with .gpu-kit.tar.xz
# carried (bench/gpu/make_kit.sh): the gpu-labelled tests (the serving test
# starts router + prefill + decode workers on the GPU and compares their text
# with the CPU engine, for the tiny model and stories260K), compute-sanitizer
# memcheck over the kernel tests, then the GPU benchmarks (copy bandwidth,
# bf16 GEMM rate, paged decode attention, the engine on Llama-3.1-8B shapes
# with dummy weights: batch-1 decode and a 4096-token prefill, bf16 and fp8
# KV) and `bench serve` against a GPU stack (stories260K, and Llama-3.1-8B
# shapes with dummy weights). Logs and JSON lines go to $OUT (or ./gpu-out);
# a summary prints last.
#
# Also (families): each model-family preset generates the same greedy tokens
# on the GPU as on the CPU, `bench engine` on the qwen3-moe preset and on
# the deepseek-v3 preset at a 4K context (latent KV bytes per decode step).
# And (kv): for every KV dtype, stories260K and the tiny, qwen3 and
# deepseek-v3 presets generate the same greedy tokens on the GPU as on the
# CPU, and `bench engine` on Llama-3.1-8B shapes (decode and prefill, tokens
# per GiB of KV).
#
# And (eviction): attention sinks, Quest and SnapKV on the device (issue
# 33): their op and engine tests alone (backend_ops_test's PagedAttention
# and Quest cases, under memcheck too; cuda_engine_test's stories260K
# streaming, Quest and SnapKV runs against the CPU), then Quest's decode speed against
# dense attention on Llama-3.1-8B shapes (dummy weights, bf16 KV, batch 8,
# 8,192-token prompts) with K = 16 and 64, each line given the attention
# bytes a step reads at most (selected blocks per query head plus the key
# bounds; bench/gpu/NOTES.md).
#
# And (tp): the communicators' GPU tests (device-local on one GPU, NCCL where
# two exist) and the NCCL KV transfer's (two GPUs); stories260K's greedy
# tokens at TP 2 on one GPU (device-local) and on two (NCCL) against the
# CPU's at TP 1; `bench engine` on Llama-3.1-8B shapes at TP 1 and TP 2 on
# one GPU, and TP 2 on two GPUs where they exist.
#
# And (quick): one short call for a first look at a tree that never ran on a
# device: the headline benchmarks first on a quiet GPU (kernels with fp16
# KV; Llama-3.1-8B shapes batch-1 decode after 512 tokens with graphs on and
# off, batch 64, and a 4096-token prefill), then every GPU test binary at
# once, each under a time limit, with memcheck over backend_ops_test; the
# logs come back as one archive (the device tool returns at most 8 files).
#
# And (perf): the kernels of issue 29 in one short call: the op and engine
# tests (memcheck too) all at once under time limits, then on a quiet GPU
# `bench kernels` for fp16, bf16 and fp8 KV, `bench engine` on Llama-3.1-8B
# shapes (dummy bf16) at batch 1, 8, 32 and 64 after 1,024 tokens, a
# 4,096-token prefill and batch-1 decode after it, and the FP8 checkpoint's
# shapes (bench/configs/llama-3.1-8b-fp8) where that folder exists. JSON
# lines in perf.jsonl; logs in logs.tar.gz.
#
# And (profile): perf's tests and benchmarks, then Nsight Compute's kernel
# durations over whole `bench engine` runs without graphs (batch 1 and 64
# after 1,024 tokens; --clock-control none), one CSV row per launch in
# logs.tar.gz; bench/gpu/kernel_shares.py turns them into each kernel's
# share of a decode step.
#
# And (verify): the shortest check of a change to kernels and graphs, most
# important first, logs packed after each: backend_ops_test, then
# cuda_engine_test, then `bench engine` batch 1 to 64 after 1,024 tokens,
# Qwen3-30B-A3B shapes at batch 1 and 8 with graphs and without, then
# memcheck over backend_ops_test.
#
# And (check): verify and perf in one call, for a session whose device
# minutes fit one start (below).
#
# Usage: bench/gpu/run_kit.sh [all|quick|perf|profile|verify|check|tests|bench|serve|families|kv|eviction|tp]
set -uo pipefail

WHAT=${1:-all}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
KIT=$PWD/.gpu-kit
# Unpacked again whenever the tarball changed: a warm machine keeps the
# ignored .gpu-kit/ of the last call, which a rebuilt kit must replace.
if [[ -f $KIT.tar.xz ]]; then
  sum=$(sha1sum < "$KIT.tar.xz")
  if [[ ! -f $KIT/.sum || $(cat "$KIT/.sum") != "$sum" ]]; then
    rm -rf "$KIT"
    xz -dc "$KIT.tar.xz" | tar -xf - && echo "$sum" > "$KIT/.sum"
  fi
fi
[[ -x $KIT/bin/pdserve ]] || { echo "run_kit: $KIT is missing (bench/gpu/make_kit.sh)" >&2; exit 2; }
export LD_LIBRARY_PATH=$KIT/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export UCX_MODULE_DIR=$KIT/lib/ucx
export PATH=/usr/local/cuda/bin:$PATH
PDSERVE=$KIT/bin/pdserve
summary=()
step() { echo "== $*" >&2; }
# A gtest log's outcome: tests passed and skipped, FAILED lines (a binary
# that skipped everything, as without a device, must not read as a pass).
outcome() {
  local passed skipped
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\..*/\1/p' "$1" | head -1)
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?[.,].*/\1/p' "$1" | head -1)
  echo "${passed:-0} passed, ${skipped:-0} skipped, $(grep -c '^\[  FAILED  \]' "$1") FAILED lines"
}

# The modes that run many steps (quick, perf, profile, verify, check): logs
# outside $OUT, packed into one archive after every phase (the device tool
# returns at most 8 files, and a run cut off at its time limit still
# returns the archive of the phases before).
logs=$(mktemp -d)/logs
mkdir -p "$logs"
pack() {
  printf '%s\n' "${summary[@]}" > "$logs/summary.txt"
  cp "$OUT/device.txt" "$logs/"
  tar -czf "$OUT/logs.tar.gz" -C "$(dirname "$logs")" logs
}
# `bench engine` on MODEL with dummy weights, its JSON line into perf.jsonl.
engine() {  # LABEL SECONDS MODEL FLAGS...
  local label=$1 limit=$2 model=$3
  shift 3
  step "bench engine $label"
  timeout -k 5 "$limit" "$PDSERVE" bench engine --model "$model" --load-format dummy \
    --device cuda --json "$@" 2>>"$logs/bench.err" | tee -a "$OUT/perf.jsonl"
  summary+=("bench engine $label: exit ${PIPESTATUS[0]}")
  pack
}
# Starts each test binary named, and memcheck over backend_ops_test's
# FILTER (empty: none), at once in the background, each under LIMIT
# seconds; their "pid:name" entries go to the array `pids`.
start_tests() {  # LIMIT MEMCHECK_FILTER BINARIES...
  local limit=$1 filter=$2 t
  shift 2
  for t in "$@"; do
    PDSERVE_BIN=$PDSERVE PDSERVE_REAL_MODEL_DIR=$KIT/models/stories260K \
      timeout -k 5 "$limit" "$KIT/bin/$t" --gtest_brief=1 > "$logs/$t.log" 2>&1 &
    pids+=("$!:$t")
  done
  if [[ -n $filter ]]; then
    timeout -k 5 "$limit" compute-sanitizer --tool memcheck --error-exitcode 3 \
      "$KIT/bin/backend_ops_test" --gtest_brief=1 --gtest_filter="$filter" \
      > "$logs/memcheck-backend_ops_test.log" 2>&1 &
    pids+=("$!:memcheck backend_ops_test")
  fi
}
# Greedy tokens on the GPU against the CPU, one line each: every preset
# spec (preset:dtype) given, then stories260K at TP 2 on one GPU (the
# device-local communicator). fp32 weights take cuBLAS's pedantic fp32
# products, as the CPU; bf16 ones round activations to bf16 where the
# CPU's decode does not, so a near tie may flip a token (compare against a
# CPU whose prefill rounds as CUDA does: bench/gpu/NOTES.md).
greedy_presets() {  # SPECS...
  local spec preset dtype model cpu gpu r
  gen() {  # MODEL FLAGS...
    local model=$1
    shift
    timeout 60 "$PDSERVE" generate --model "$model" "$@" --prompt "Once upon a time" \
      --max-tokens 32 --temperature 0 --ignore-eos --json 2>>"$logs/greedy.err" |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'
  }
  for spec in "$@"; do
    preset=${spec%:*} dtype=${spec#*:} model=$(dirname "$logs")/model-$preset-$dtype
    "$PDSERVE" make-model --preset "$preset" --dtype "$dtype" --out "$model" > /dev/null 2>&1 ||
      { echo "$spec: make-model failed"; continue; }
    cpu=$(gen "$model" --device cpu) gpu=$(gen "$model" --device cuda)
    [[ -n $cpu && $cpu == "$gpu" ]] && r=equal || r="DIFFERENT cpu $cpu gpu $gpu"
    echo "$spec greedy tokens, GPU vs CPU: $r"
    rm -rf "$model"
  done
  if [[ -f $KIT/models/stories260K/config.json ]]; then
    cpu=$(gen "$KIT/models/stories260K" --device cpu)
    gpu=$(gen "$KIT/models/stories260K" --tensor-parallel 2 --devices cuda:0,cuda:0)
    [[ -n $cpu && $cpu == "$gpu" ]] && r=equal || r="DIFFERENT cpu $cpu gpu $gpu"
    echo "stories260K TP 2 on cuda:0,cuda:0 vs CPU: $r"
  fi
}
# The GPU engine against the CPU reference, teacher-forced over the
# TinyStories text (`pdserve eval --device cuda --baseline-device cpu`, fp32
# KV on both): one JSON line each into eval.jsonl and a summary line with the
# NLL difference and top-1 agreement, issue 29's bounds being 0.01 nats and
# 0.98. stories260K first, then every preset spec (preset:dtype) given.
eval_presets() {  # SPECS...
  local spec preset dtype model line
  one() {  # NAME MODEL
    line=$(timeout 120 "$PDSERVE" eval --model "$2" --text bench/eval/tinystories.txt \
      --device cuda --baseline-device cpu --json 2>>"$logs/eval.err") ||
      { echo "$1 eval GPU vs CPU: failed"; return; }
    echo "$line" | sed "s/^{/{\"eval_model\":\"$1\",/" >> "$OUT/eval.jsonl"
    echo "$line" | python3 -c 'import json,sys; j=json.load(sys.stdin)
print("%s eval GPU vs CPU: nll %.4f vs %.4f (diff %.4f), top-1 agreement %.4f, mean KL %.3g" % (
  sys.argv[1], j["nll"], j["baseline_nll"], j["nll"] - j["baseline_nll"], j["top1_agreement"],
  j["kl_mean"]))' "$1"
  }
  [[ -f $KIT/models/stories260K/config.json ]] && one stories260K "$KIT/models/stories260K"
  for spec in "$@"; do
    preset=${spec%:*} dtype=${spec#*:} model=$(dirname "$logs")/eval-$preset-$dtype
    "$PDSERVE" make-model --preset "$preset" --dtype "$dtype" --out "$model" > /dev/null 2>&1 ||
      { echo "$spec: make-model failed"; continue; }
    one "$spec" "$model"
    rm -rf "$model"
  done
}
# Waits for every entry of `pids`, adding each test's outcome to the
# summary (and the greedy and eval lines, from greedy.txt and eval.txt, when
# those were started).
collect() {
  local p rc name f
  for p in "${pids[@]}"; do
    wait "${p%%:*}"
    rc=$?
    name=${p#*:}
    [[ $name == greedy || $name == eval ]] && continue
    f=$logs/${name/memcheck /memcheck-}.log
    summary+=("$name: exit $rc, $(outcome "$f")")
  done
  for f in greedy eval; do
    if [[ -f $logs/$f.txt ]]; then
      mapfile -t lines < "$logs/$f.txt"
      summary+=("${lines[@]}")
    fi
  done
  pids=()
  pack
}
pids=()

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
} > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

if [[ $WHAT == all || $WHAT == tests ]]; then
  for t in backend_ops_test cuda_engine_test cuda_kv_transfer_test cuda_serving_test \
    cuda_fp8_gemm_test; do
    step "$t"
    if PDSERVE_BIN=$PDSERVE PDSERVE_REAL_MODEL_DIR=$KIT/models/stories260K \
      timeout -k 10 180 "$KIT/bin/$t" --gtest_brief=1 > "$OUT/$t.log" 2>&1; then r=pass; else r=FAIL; fi
    skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?[.,].*/\1/p' "$OUT/$t.log" | head -1)
    summary+=("$t: $r, ${skipped:-0} skipped")
  done
  for t in backend_ops_test; do
    step "compute-sanitizer memcheck $t"
    if timeout -k 10 300 compute-sanitizer --tool memcheck --error-exitcode 3 "$KIT/bin/$t" \
      --gtest_brief=1 \
      > "$OUT/memcheck-$t.log" 2>&1; then r=clean; else r=ERRORS; fi
    summary+=("memcheck $t: $r")
  done
fi

if [[ $WHAT == all || $WHAT == bench ]]; then
  : > "$OUT/bench.jsonl"
  for kv in fp16 bf16 fp8 nvfp4; do
    step "bench kernels, $kv KV"
    timeout -k 10 240 "$PDSERVE" bench kernels --batch 64 --context 1024,4096,16384 --kv-dtype "$kv" \
      2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
  done
  for kv in bf16 fp8; do
    step "bench engine, Llama-3.1-8B shapes, batch-1 decode, $kv KV"
    timeout -k 10 240 "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b --load-format dummy --device cuda \
      --kv-dtype "$kv" --batch 1 --prompt-tokens 512 --gen-tokens 64 --json \
      2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
    step "bench engine, Llama-3.1-8B shapes, 4096-token prefill, $kv KV"
    timeout -k 10 240 "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b --load-format dummy --device cuda \
      --kv-dtype "$kv" --batch 1 --prompt-tokens 4096 --gen-tokens 2 --max-batched-tokens 4096 \
      --json 2>>"$OUT/bench.err" | tee -a "$OUT/bench.jsonl"
  done
  summary+=("bench: $(grep -c . "$OUT/bench.jsonl") JSON lines in bench.jsonl")
fi

if [[ $WHAT == all || $WHAT == families ]]; then
  : > "$OUT/families.jsonl"
  for preset in tiny qwen3 qwen3-moe mixtral deepseek-v2-lite deepseek-v3; do
    step "greedy tokens of the $preset preset, GPU against CPU"
    "$PDSERVE" make-model --preset "$preset" --out "$OUT/model-$preset" > /dev/null
    tokens() {
      timeout -k 10 240 "$PDSERVE" generate --model "$OUT/model-$preset" --device "$1" --prompt "the quick brown fox" \
        --max-tokens 32 --temperature 0 --ignore-eos --json 2>>"$OUT/bench.err" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'
    }
    cpu=$(tokens cpu) gpu=$(tokens cuda)
    if [[ -n $cpu && $cpu == "$gpu" ]]; then r=equal; else r=DIFFERENT; fi
    summary+=("$preset greedy tokens, GPU vs CPU: $r")
    [[ $r == equal ]] || printf 'cpu %s\ngpu %s\n' "$cpu" "$gpu" >> "$OUT/families-$preset.txt"
  done
  for batch in 1 32; do
    step "bench engine, qwen3-moe preset, batch $batch"
    timeout -k 10 240 "$PDSERVE" bench engine --model "$OUT/model-qwen3-moe" --device cuda --batch "$batch" \
      --prompt-tokens 256 --gen-tokens 64 --json 2>>"$OUT/bench.err" | tee -a "$OUT/families.jsonl"
  done
  # The published shapes of Qwen3-30B-A3B (57 GiB of bf16) and
  # DeepSeek-V2-Lite (29 GiB), dummy weights: batch-1 decode against the
  # bytes it reads (active experts + KV; issue 29 goal 6).
  for cfg in qwen3-30b-a3b deepseek-v2-lite; do
    step "bench engine, $cfg shapes, batch 1"
    timeout -k 10 240 "$PDSERVE" bench engine --model "bench/configs/$cfg" --load-format dummy --device cuda \
      --kv-dtype bf16 --batch 1 --prompt-tokens 512 --gen-tokens 64 --json 2>>"$OUT/bench.err" |
      tee -a "$OUT/families.jsonl"
  done
  # Multi-head latent attention at a 4K context: kv_bytes_per_decode_step is
  # 4095 tokens x layers x (kv_lora_rank + qk_rope_head_dim) x 2 bytes.
  for batch in 1 32; do
    step "bench engine, deepseek-v3 preset, 4K context, batch $batch"
    timeout -k 10 240 "$PDSERVE" bench engine --model "$OUT/model-deepseek-v3" --device cuda --batch "$batch" \
      --kv-dtype bf16 --prompt-tokens 4094 --gen-tokens 2 --json 2>>"$OUT/bench.err" |
      tee -a "$OUT/families.jsonl"
  done
  rm -rf "$OUT"/model-*
fi

if [[ $WHAT == all || $WHAT == kv ]]; then
  : > "$OUT/kv.jsonl"
  models=()
  [[ -f $KIT/models/stories260K/config.json ]] && models+=("$KIT/models/stories260K")
  for preset in tiny qwen3 deepseek-v3; do
    "$PDSERVE" make-model --preset "$preset" --out "$OUT/model-$preset" > /dev/null
    models+=("$OUT/model-$preset")
  done
  for model in "${models[@]}"; do
    for kv in fp32 fp16 bf16 fp8 fp8_e5m2 nvfp4; do
      step "greedy tokens of $(basename "$model") with $kv KV, GPU against CPU"
      tokens() {
        timeout -k 10 240 "$PDSERVE" generate --model "$model" --device "$1" --kv-dtype "$kv" \
          --prompt "Once upon a time" --max-tokens 32 --temperature 0 --ignore-eos --json \
          2>>"$OUT/bench.err" | python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'
      }
      cpu=$(tokens cpu) gpu=$(tokens cuda)
      if [[ -n $cpu && $cpu == "$gpu" ]]; then r=equal; else r=DIFFERENT; fi
      summary+=("$(basename "$model") $kv KV greedy tokens, GPU vs CPU: $r")
      [[ $r == equal ]] || printf '%s %s\ncpu %s\ngpu %s\n' "$model" "$kv" "$cpu" "$gpu" \
        >> "$OUT/kv-different.txt"
    done
  done
  for kv in bf16 fp8 fp8_e5m2 nvfp4; do
    step "bench engine, Llama-3.1-8B shapes, $kv KV: batch-1 decode after 1024 tokens"
    timeout -k 10 240 "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b --load-format dummy --device cuda \
      --kv-dtype "$kv" --batch 1 --prompt-tokens 1024 --gen-tokens 32 --max-batched-tokens 1024 \
      --json 2>>"$OUT/bench.err" | tee -a "$OUT/kv.jsonl"
  done
  rm -rf "$OUT"/model-*
  summary+=("kv: $(grep -c . "$OUT/kv.jsonl") JSON lines in kv.jsonl")
fi

if [[ $WHAT == all || $WHAT == eviction ]]; then
  : > "$OUT/eviction.jsonl"
  run_filtered() {  # NAME BINARY FILTER [memcheck]
    local name=$1 bin=$2 filter=$3 r
    step "$name"
    if [[ ${4:-} == memcheck ]]; then
      timeout -k 10 300 compute-sanitizer --tool memcheck --error-exitcode 3 "$KIT/bin/$bin" --gtest_brief=1 \
        --gtest_filter="$filter" > "$OUT/$name.log" 2>&1 && r=clean || r=ERRORS
    else
      PDSERVE_REAL_MODEL_DIR=$KIT/models/stories260K timeout -k 10 180 "$KIT/bin/$bin" --gtest_brief=1 \
        --gtest_filter="$filter" > "$OUT/$name.log" 2>&1 && r=pass || r=FAIL
    fi
    local skipped
    skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?[.,].*/\1/p' "$OUT/$name.log" | head -1)
    summary+=("$name: $r, ${skipped:-0} skipped")
  }
  run_filtered eviction-ops backend_ops_test '*PagedAttention*:*Quest*'
  run_filtered eviction-ops-memcheck backend_ops_test '*PagedAttention*:*Quest*' memcheck
  run_filtered eviction-engine cuda_engine_test '*Streaming*:*Quest*:*SnapKv*'
  for sel in none 16 64; do
    step "bench engine, Llama-3.1-8B shapes, bf16 KV, batch 8 after 8192 tokens, Quest: $sel"
    flags=()
    [[ $sel == none ]] || flags=(--kv-selection quest --kv-selection-blocks "$sel")
    timeout -k 10 240 "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b --load-format dummy --device cuda \
      --kv-dtype bf16 --batch 8 --prompt-tokens 8192 --gen-tokens 64 --max-batched-tokens 8192 \
      "${flags[@]}" --json 2>>"$OUT/bench.err" |
      K=$sel CONFIG=bench/configs/llama-3.1-8b/config.json python3 -c '
import json, os, sys
# At most what a decode step of the attention reads per sequence: dense, every
# key and value; Quest, per query head its K selected blocks and its newest
# (no sharing within the GQA group assumed), plus every full block'"'"'s fp32
# key bounds once per KV head (the selection reads them once per group).
c = json.load(open(os.environ["CONFIG"]))
layers, heads, kvh = c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"]
hd = c.get("head_dim", c["hidden_size"] // heads)
for line in sys.stdin:
    r = json.loads(line)
    k, bs = os.environ["K"], r.get("block_size", 16)
    block_head = r["kv_bytes_per_block"] / (layers * kvh)  # K and V of one layer and KV head
    context = 8192 + 32
    if k == "none":
        bound = r["kv_bytes_per_decode_step"]
    else:
        newest = (context + bs - 1) // bs - 1
        bound = r["batch"] * layers * (heads * (int(k) + 1) * block_head + kvh * newest * 2 * hd * 4)
    r["attention_bytes_per_decode_step_bound"] = bound
    print(json.dumps(r), flush=True)' | tee -a "$OUT/eviction.jsonl"
  done
  summary+=("eviction: $(grep -c . "$OUT/eviction.jsonl") JSON lines in eviction.jsonl")
fi

if [[ $WHAT == all || $WHAT == tp ]]; then
  : > "$OUT/tp.jsonl"
  step "communicator_test (device-local, NCCL)"
  # Timeouts everywhere a collective may wait: a hang must not spend the
  # whole device budget.
  if timeout -k 10 120 "$KIT/bin/communicator_test" --gtest_brief=1 \
    > "$OUT/communicator_test.log" 2>&1; then
    r=pass
  else r=FAIL; fi
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?[.,].*/\1/p' "$OUT/communicator_test.log" | head -1)
  summary+=("communicator_test: $r, ${skipped:-0} skipped")
  # The NCCL KV transfer (two GPUs: whole blocks, head slices between TP
  # sizes); its log goes after the communicators' (no more files come back).
  step "cuda_kv_transfer_test NCCL cases"
  nccl_log=$(mktemp)
  if timeout -k 10 120 "$KIT/bin/cuda_kv_transfer_test" --gtest_filter='CudaKvTransferTest.Nccl*' \
    --gtest_brief=1 \
    > "$nccl_log" 2>&1; then r=pass; else r=FAIL; fi
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?[.,].*/\1/p' "$nccl_log" | head -1)
  summary+=("cuda_kv_transfer_test NCCL: $r, ${skipped:-0} skipped")
  cat "$nccl_log" >> "$OUT/communicator_test.log"
  rm -f "$nccl_log"
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c .)
  tp_devices=("cuda:0,cuda:0")
  [[ $gpus -ge 2 ]] && tp_devices+=("cuda:0,cuda:1")
  if [[ -f $KIT/models/stories260K/config.json ]]; then
    tokens() {
      timeout -k 10 60 "$PDSERVE" generate --model "$KIT/models/stories260K" "$@" \
        --prompt "Once upon a time" \
        --max-tokens 48 --temperature 0 --ignore-eos --json 2>>"$OUT/bench.err" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])'
    }
    cpu=$(tokens --device cpu)
    for d in "${tp_devices[@]}"; do
      step "stories260K greedy tokens at TP 2 on $d against the CPU"
      gpu=$(tokens --tensor-parallel 2 --devices "$d")
      if [[ -n $cpu && $cpu == "$gpu" ]]; then r=equal; else r=DIFFERENT; fi
      summary+=("stories260K TP 2 on $d greedy tokens vs CPU: $r")
      [[ $r == equal ]] || printf '%s\ncpu %s\ngpu %s\n' "$d" "$cpu" "$gpu" >> "$OUT/tp-different.txt"
    done
  fi
  for d in cuda:0 "${tp_devices[@]}"; do
    n=$(tr ',' '\n' <<< "$d" | grep -c .)
    for batch in 1 32; do
      step "bench engine, Llama-3.1-8B shapes, TP $n on $d, batch $batch"
      timeout -k 10 120 "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b \
        --load-format dummy --tensor-parallel "$n" --devices "$d" --kv-dtype bf16 --batch "$batch" \
        --prompt-tokens 512 --gen-tokens 64 --json 2>>"$OUT/bench.err" |
        tee -a "$OUT/tp.jsonl"
    done
  done
  summary+=("tp: $(grep -c . "$OUT/tp.jsonl") JSON lines in tp.jsonl")
fi

if [[ $WHAT == quick ]]; then
  : > "$OUT/perf.jsonl"
  step "bench kernels, fp16 KV"
  timeout 60 "$PDSERVE" bench kernels --batch 64 --context 4096 --kv-dtype fp16 \
    2>>"$logs/bench.err" | tee -a "$OUT/perf.jsonl"
  m=bench/configs/llama-3.1-8b
  engine "decode b1 graphs" 75 $m --kv-dtype bf16 --batch 1 --prompt-tokens 512 --gen-tokens 64
  engine "decode b1 eager" 75 $m --kv-dtype bf16 --batch 1 --prompt-tokens 512 --gen-tokens 64 \
    --cuda-graphs=false
  engine "decode b64 graphs" 75 $m --kv-dtype bf16 --batch 64 --prompt-tokens 1024 \
    --gen-tokens 32 --max-batched-tokens 8192
  engine "prefill 4096" 75 $m --kv-dtype bf16 --batch 1 --prompt-tokens 4096 --gen-tokens 2 \
    --max-batched-tokens 4096
  step "GPU tests, all at once"
  start_tests 120 '*' backend_ops_test cuda_engine_test cuda_kv_transfer_test cuda_serving_test \
    communicator_test cuda_fp8_gemm_test
  collect
fi

if [[ $WHAT == perf || $WHAT == profile ]]; then
  : > "$OUT/perf.jsonl"
  # PERF_TESTS=0 after a `verify` in the same session: its tests and
  # memcheck ran already, and the device minutes go to the benchmarks.
  step "GPU tests and greedy presets, all at once"
  if [[ ${PERF_TESTS:-1} != 0 ]]; then
    start_tests 120 '*' backend_ops_test cuda_engine_test cuda_serving_test communicator_test
  fi
  greedy_presets tiny:fp32 qwen3:fp32 qwen3-moe:fp32 mixtral:fp32 deepseek-v2-lite:fp32 \
    deepseek-v3:fp32 gemma3:fp32 tiny:bf16 qwen3:bf16 gemma3:bf16 mistral-window:bf16 \
    > "$logs/greedy.txt" 2>&1 &
  pids+=("$!:greedy")
  collect
  step "bench kernels, fp16 KV, decode at 1K/4K/16K, prefill at 4K and 16K"
  timeout 60 "$PDSERVE" bench kernels --batch 64 --context 1024,4096,16384 --kv-dtype fp16 \
    2>>"$logs/bench.err" | tee -a "$OUT/perf.jsonl"
  summary+=("bench kernels fp16: exit ${PIPESTATUS[0]}")
  for kv in bf16 fp8 nvfp4; do
    step "bench kernels, $kv KV"
    timeout 30 "$PDSERVE" bench kernels --batch 64 --context 4096 --kv-dtype "$kv" \
      --prefill-tokens 0 2>>"$logs/bench.err" | tee -a "$OUT/perf.jsonl"
    summary+=("bench kernels $kv: exit ${PIPESTATUS[0]}")
  done
  pack
  engine "decode b1-64 after 1024" 120 bench/configs/llama-3.1-8b --kv-dtype bf16 \
    --batch 1,8,32,64 --prompt-tokens 1024 --gen-tokens 32 --max-batched-tokens 8192
  # Sampling on the device: batch 64 at temperature 1 against the greedy
  # batch-64 row above (same settings); within a few percent is the goal.
  engine "decode b64 sampled" 90 bench/configs/llama-3.1-8b --kv-dtype bf16 --batch 64 \
    --prompt-tokens 1024 --gen-tokens 32 --max-batched-tokens 8192 --temperature 1
  engine "prefill 4096 + b1 decode" 60 bench/configs/llama-3.1-8b --kv-dtype bf16 --batch 1 \
    --prompt-tokens 4096 --gen-tokens 32 --max-batched-tokens 4096
  if [[ $WHAT == profile ]]; then
    for batch in 1 64; do
      step "ncu kernel durations, batch $batch, eager"
      timeout 90 ncu --metrics gpu__time_duration.sum --clock-control none --csv --page raw \
        --log-file "$logs/ncu-b$batch.csv" "$PDSERVE" bench engine \
        --model bench/configs/llama-3.1-8b --load-format dummy --device cuda --kv-dtype bf16 \
        --batch "$batch" --prompt-tokens 1024 --gen-tokens 5 --max-batched-tokens $((batch * 1024)) \
        --cuda-graphs=false --json >> "$logs/ncu.jsonl" 2>> "$logs/ncu.err"
      summary+=("ncu batch $batch: exit $?, $(wc -l < "$logs/ncu-b$batch.csv" 2>/dev/null) rows")
      pack
    done
  fi
  if [[ -f bench/configs/llama-3.1-8b-fp8/config.json ]]; then
    engine "fp8 weights b1 decode" 60 bench/configs/llama-3.1-8b-fp8 --kv-dtype bf16 --batch 1 \
      --prompt-tokens 512 --gen-tokens 32
  fi
  pack
fi

if [[ $WHAT == verify ]]; then
  : > "$OUT/perf.jsonl"
  for t in backend_ops_test cuda_engine_test cuda_fp8_gemm_test; do
    step "$t"
    PDSERVE_BIN=$PDSERVE PDSERVE_REAL_MODEL_DIR=$KIT/models/stories260K \
      timeout 120 "$KIT/bin/$t" --gtest_brief=1 > "$logs/$t.log" 2>&1
    summary+=("$t: exit $?, $(outcome "$logs/$t.log")")
    pack
  done
  step "bench engine b1-64 after 1024"
  timeout 90 "$PDSERVE" bench engine --model bench/configs/llama-3.1-8b --load-format dummy \
    --device cuda --json --kv-dtype bf16 --batch 1,8,32,64 --prompt-tokens 1024 --gen-tokens 32 \
    --max-batched-tokens 8192 2>>"$logs/bench.err" | tee -a "$OUT/perf.jsonl"
  summary+=("bench engine: exit ${PIPESTATUS[0]}")
  pack
  # MoE decode with graphs (the grouped kernels) and without, Qwen3-30B-A3B
  # shapes (57 GiB of dummy bf16; issue 29 goal 6).
  for graphs in true false; do
    step "bench engine qwen3-30b-a3b b1,8 graphs=$graphs"
    timeout 120 "$PDSERVE" bench engine --model bench/configs/qwen3-30b-a3b --load-format dummy \
      --device cuda --json --kv-dtype bf16 --batch 1,8 --prompt-tokens 512 --gen-tokens 32 \
      --cuda-graphs=$graphs 2>>"$logs/bench.err" | tee -a "$OUT/perf.jsonl"
    summary+=("bench engine qwen3-30b-a3b graphs=$graphs: exit ${PIPESTATUS[0]}")
    pack
  done
  # memcheck over the ops that have never run on a device (all of
  # backend_ops_test no longer fits its minute and a half).
  step "memcheck backend_ops_test, the new ops"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$KIT/bin/backend_ops_test" \
    --gtest_brief=1 \
    --gtest_filter='*MoeFfn*:*HeadsLinear*:*Embedding*:*SampleRows*:*AdjustLogits*:*Mla*' \
    > "$logs/memcheck-backend_ops_test.log" 2>&1
  summary+=("memcheck backend_ops_test (new ops): exit $?")
  pack
fi

# check: verify and perf in one call, for a session whose device minutes
# fit one start: every test binary, memcheck over the ops never run on a
# device and the greedy presets at once (each under a limit), then on a
# quiet GPU the kernels and the engine, most wanted first, packed after
# each step so that a call cut off at its limit still returns the rest.
if [[ $WHAT == check ]]; then
  : > "$OUT/perf.jsonl"
  step "GPU tests, memcheck of the new ops and greedy presets, all at once"
  start_tests 150 '*MoeFfn*:*MoeRoute*:*HeadsLinear*:*Embedding*:*SampleRows*:*AdjustLogits*:*Mla*' \
    backend_ops_test cuda_engine_test cuda_fp8_gemm_test cuda_serving_test communicator_test \
    cuda_kv_transfer_test
  greedy_presets tiny:fp32 qwen3:fp32 qwen3-moe:fp32 mixtral:fp32 deepseek-v2-lite:fp32 \
    deepseek-v3:fp32 gemma3:fp32 tiny:bf16 qwen3:bf16 qwen3-moe:bf16 deepseek-v2-lite:bf16 \
    gemma3:bf16 mistral-window:bf16 > "$logs/greedy.txt" 2>&1 &
  pids+=("$!:greedy")
  eval_presets tiny:fp32 tiny:bf16 qwen3:bf16 qwen3-moe:bf16 gemma3:bf16 \
    > "$logs/eval.txt" 2>&1 &
  pids+=("$!:eval")
  collect
  kernels() {  # LABEL SECONDS FLAGS...
    local label=$1 limit=$2
    shift 2
    step "bench kernels $label"
    timeout -k 5 "$limit" "$PDSERVE" bench kernels --batch 64 "$@" 2>>"$logs/bench.err" |
      tee -a "$OUT/perf.jsonl"
    summary+=("bench kernels $label: exit ${PIPESTATUS[0]}")
    pack
  }
  m=bench/configs/llama-3.1-8b
  engine "decode b1-64 after 1024" 100 $m --kv-dtype bf16 --batch 1,8,32,64 \
    --prompt-tokens 1024 --gen-tokens 32 --max-batched-tokens 8192
  kernels "fp16 KV, 4K" 60 --context 4096 --kv-dtype fp16
  kernels "fp8 KV" 30 --context 4096 --kv-dtype fp8 --prefill-tokens 0
  kernels "nvfp4 KV" 30 --context 4096 --kv-dtype nvfp4 --prefill-tokens 0
  engine "qwen3-30b-a3b b1,8 graphs" 120 bench/configs/qwen3-30b-a3b --kv-dtype bf16 \
    --batch 1,8 --prompt-tokens 512 --gen-tokens 32
  engine "decode b64 sampled" 80 $m --kv-dtype bf16 --batch 64 --prompt-tokens 1024 \
    --gen-tokens 32 --max-batched-tokens 8192 --temperature 1
  engine "prefill 4096 + b1 decode" 60 $m --kv-dtype bf16 --batch 1 --prompt-tokens 4096 \
    --gen-tokens 32 --max-batched-tokens 4096
  engine "fp8 weights b1 decode" 60 bench/configs/llama-3.1-8b-fp8 --kv-dtype bf16 --batch 1 \
    --prompt-tokens 512 --gen-tokens 32
  # Issue 29's remaining shapes: batch 128 after 1,024, batches 8 to 64
  # after 4,096 (batch 128 after 4,096 needs 68 GB of bf16 KV), and 16k and
  # 32k-token prompts chunked at 8,192 (effective TFLOPS).
  engine "decode b128 after 1024" 90 $m --kv-dtype bf16 --batch 128 --prompt-tokens 1024 \
    --gen-tokens 32 --max-batched-tokens 16384
  engine "decode b8-64 after 4096" 120 $m --kv-dtype bf16 --batch 8,32,64 --prompt-tokens 4096 \
    --gen-tokens 32 --max-batched-tokens 16384
  for tokens in 16384 32768; do
    engine "prefill $tokens chunked" 60 $m --kv-dtype bf16 --batch 1 --prompt-tokens "$tokens" \
      --gen-tokens 2 --max-batched-tokens 8192
  done
fi

# A GPU stack (router + 1 prefill + 1 decode worker, every prompt prefilled
# remotely) under `bench serve`; one JSON line per model and concurrency
# (CONCURRENCY: the list, default 16; each run sends 4 requests per client,
# at least 16).
serve_bench() {  # NAME MODEL_DIR UP_FLAGS... -- BENCH_FLAGS...
  local name=$1 model=$2 up=() bench=()
  shift 2
  while [[ $# -gt 0 && $1 != -- ]]; do up+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  bench=("$@")
  # The stack's logs outside $OUT, packed into one archive at the end (the
  # device tool returns at most 8 files).
  local dir
  dir=$(mktemp -d)/up-$name
  mkdir -p "$dir"
  "$PDSERVE" up --dir "$dir" --model "$model" --port 0 --control-port 0 --prefill-metrics-port 0 \
    --decode-metrics-port 0 --device cuda --max-local-prefill 0 --start-timeout 240 --stop-timeout 5 \
    "${up[@]}" \
    > "$dir/up.log" 2>&1 &
  local pid=$!
  until grep -q "Ctrl-C stops" "$dir/up.log"; do
    sleep 1
    kill -0 $pid 2>/dev/null || {
      echo "serve $name: the stack did not start" >&2
      tar -czf "$OUT/up-$name-logs.tar.gz" --exclude cluster-secret -C "$(dirname "$dir")" "up-$name"
      return 1
    }
  done
  local url
  url=$(grep -o 'ready at http://[0-9.:]*' "$dir/up.log" | cut -d' ' -f3)
  # python3 rather than jq: the GPU image has the one, not always the other.
  local c
  for c in ${CONCURRENCY:-16}; do
    timeout 240 "$PDSERVE" bench serve --json --url "$url" "${bench[@]}" --concurrency "$c" \
      --requests $((4 * c > 16 ? 4 * c : 16)) --timeout 60 2>>"$OUT/bench.err" |
      STACK=$name DEVICE=$(sed -n 3p "$OUT/device.txt") python3 -c '
import json, os, sys
for line in sys.stdin:
    r = json.loads(line)
    r.update(stack=os.environ["STACK"], device=os.environ["DEVICE"], prefill_workers=1,
             decode_workers=1)
    print(json.dumps(r), flush=True)' | tee -a "$OUT/serve.jsonl"
  done
  kill $pid
  wait $pid || true
  tar -czf "$OUT/up-$name-logs.tar.gz" --exclude cluster-secret -C "$(dirname "$dir")" "up-$name"
}

if [[ $WHAT == all || $WHAT == serve ]]; then
  : > "$OUT/serve.jsonl"
  if [[ -f $KIT/models/stories260K/config.json ]]; then
    step "bench serve, stories260K on the GPU"
    CONCURRENCY=16 serve_bench stories260K "$KIT/models/stories260K" --kv-cache-bytes 256MiB -- \
      --api completions --groups 8 --prefix-words 60 --suffix-words 20 --max-tokens 32
  fi
  if [[ -f $KIT/models/llama-3.1-8b/tokenizer.json ]]; then
    step "bench serve, Llama-3.1-8B shapes (dummy weights) on the GPU"
    # Issue 29 goal 7: concurrency 1, 16 and 64; at 1 the inter-token p50
    # against the engine's batch-1 step (perf.jsonl) is the server's share.
    CONCURRENCY="1 16 64" serve_bench llama-3.1-8b-dummy "$KIT/models/llama-3.1-8b" \
      --load-format dummy --kv-cache-bytes 8GiB -- \
      --groups 4 --prefix-words 600 --suffix-words 200 --max-tokens 64
  fi
  summary+=("serve: $(grep -c . "$OUT/serve.jsonl") JSON lines in serve.jsonl")
fi

echo
printf '%s\n' "${summary[@]}"
[[ -s $OUT/perf.jsonl ]] && { echo; python3 bench/gpu/summary.py "$OUT/perf.jsonl"; }
exit 0  # the summary above says what failed
