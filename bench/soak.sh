#!/usr/bin/env bash
# Soak: `pdserve up` under mixed load for MINUTES, the resident memory of the
# router and of every worker sampled all along. Prints ONE JSON line: the RSS
# slope of each process (least squares over the samples after the warm-up,
# MB/hour), the requests sent by kind, the unexpected failures (apart from the
# 4xx answers that bad requests must get), whether every worker's KV usage
# went back to 0 once the load stopped, the machine and the settings.
# Progress goes to stderr.
#
#   bench/soak.sh [options] MINUTES
#     --bin PATH            pdserve binary (default build/pdserve)
#     --clients N           concurrent clients (default 6)
#     --prefill N --decode N  workers (default 1 and 1)
#     --max-local-prefill N   prompt tokens a decode worker computes itself (default 64)
#     --sample-seconds S    RSS sampling period (default 5)
#     --warmup-seconds S    samples before this are left out of the slopes
#                           (default a fifth of the run, at most 300)
#     --dir DIR             where the stack's logs go (default a fresh temporary folder, kept)
#
# Each client loops over: plain completions and chat completions (prompts
# sharing long prefixes, so that remote prefill and prefix hits happen),
# long streamed generations read to [DONE], streams cut by the client
# mid-way, and bad requests that must get a 4xx with an OpenAI-style body.
set -euo pipefail

bin=build/pdserve clients=6 prefill=1 decode=1 max_local_prefill=64 sample_s=5 warmup_s=""
dir=""
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --clients) clients="$2"; shift 2 ;;
    --prefill) prefill="$2"; shift 2 ;;
    --decode) decode="$2"; shift 2 ;;
    --max-local-prefill) max_local_prefill="$2"; shift 2 ;;
    --sample-seconds) sample_s="$2"; shift 2 ;;
    --warmup-seconds) warmup_s="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    -h|--help) usage ;;
    -*) echo "soak.sh: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -eq 1 ] || usage
minutes="$1"
[[ "$minutes" =~ ^[0-9]+$ && "$minutes" -ge 1 ]] || { echo "soak.sh: MINUTES must be a positive integer" >&2; exit 2; }
for tool in curl jq awk; do
  command -v "$tool" >/dev/null || { echo "soak.sh: needs $tool" >&2; exit 2; }
done
[ -x "$bin" ] || { echo "soak.sh: no pdserve binary at $bin (see --bin)" >&2; exit 2; }
duration_s=$((minutes * 60))
[ -n "$warmup_s" ] || warmup_s=$(( duration_s / 5 < 300 ? duration_s / 5 : 300 ))
[ -n "$dir" ] || dir="$(mktemp -d /tmp/pdserve-soak.XXXXXX)"
mkdir -p "$dir/results"
log() { echo "soak: $*" >&2; }

up_pid="" sampler_pid="" client_pids=()
cleanup() {
  for p in "${client_pids[@]}" $sampler_pid; do kill "$p" 2>/dev/null || true; done
  if [ -n "$up_pid" ] && kill -0 "$up_pid" 2>/dev/null; then
    kill -TERM "$up_pid" 2>/dev/null || true
    wait "$up_pid" 2>/dev/null || true
  fi
}
trap cleanup EXIT

# --- the stack -------------------------------------------------------------
"$bin" up --dir "$dir" --port 0 --control-port 0 --prefill-metrics-port 0 \
  --decode-metrics-port 0 --prefill "$prefill" --decode "$decode" \
  --max-local-prefill "$max_local_prefill" >"$dir/up.log" 2>&1 &
up_pid=$!
until grep -q "Ctrl-C stops" "$dir/up.log" 2>/dev/null; do
  kill -0 "$up_pid" 2>/dev/null || { cat "$dir/up.log" >&2; log "pdserve up failed"; exit 1; }
  sleep 0.2
done
url="$(grep -o 'ready at http://[0-9.:]*' "$dir/up.log" | cut -d' ' -f3)"
model="$(curl -s "$url/v1/models" | jq -r '.data[0].id')"
# "started NAME (pid N, ..." and "http://ADDR/metrics (NAME)" for each child.
declare -A pid_of metrics_of
while read -r name pid; do pid_of[$name]=$pid; done < <(
  sed -n 's/^pdserve up: started \([^ ]*\) (pid \([0-9]*\),.*/\1 \2/p' "$dir/up.log")
while read -r addr name; do metrics_of[$name]=$addr; done < <(
  sed -n 's|^ *\(http://[0-9.:]*/metrics\) (\([a-z]*-[0-9]*\))$|\1 \2|p' "$dir/up.log")
workers=("${!metrics_of[@]}")
log "stack at $url (model $model; ${!pid_of[*]}), logs in $dir; $minutes min, $clients clients"

# --- RSS sampler -----------------------------------------------------------
start_s=$(date +%s.%N)
sample() {
  while true; do
    now=$(date +%s.%N)
    for name in "${!pid_of[@]}"; do
      kb=$(awk '/^VmRSS:/ {print $2}' "/proc/${pid_of[$name]}/status" 2>/dev/null || true)
      [ -n "$kb" ] && echo "$(awk -v a="$now" -v b="$start_s" 'BEGIN {printf "%.3f", a - b}') $name $kb"
    done
    sleep "$sample_s"
  done >>"$dir/rss.txt"
}
sample &
sampler_pid=$!

# --- clients ----------------------------------------------------------------
words() {  # $1 words from a fixed vocabulary, shifted by $2
  local s="" i
  for ((i = 0; i < $1; i++)); do s+=" w$(( ($2 * 31 + i * 7) % 97 ))"; done
  echo "$s"
}
prefixes=()
for g in 0 1 2 3; do prefixes+=("system $g:$(words 60 "$g")"); done

end_at=$(( $(date +%s) + duration_s ))
client() {
  local id=$1 k=0 kind out code rc body prompt suffix
  local res="$dir/results/client-$id.txt"
  while [ "$(date +%s)" -lt "$end_at" ]; do
    k=$((k + 1))
    suffix="$(words $(( RANDOM % 24 + 2 )) $RANDOM)"
    prompt="${prefixes[$(( RANDOM % 4 ))]} | user $id-$k:$suffix"
    out="$dir/results/body-$id"
    rc=0
    case $(( (id + k) % 6 )) in
      0) kind=completion
         body="{\"model\":\"$model\",\"prompt\":\"$prompt\",\"max_tokens\":16,\"temperature\":0}"
         code=$(curl -s -o "$out" -w '%{http_code}' --max-time 120 "$url/v1/completions" \
           -H 'Content-Type: application/json' -d "$body") || rc=$?
         if [ "$code" = 200 ] && jq -e '.choices[0].text | type == "string"' "$out" >/dev/null 2>&1
         then echo "$kind ok"; else echo "$kind error code=$code rc=$rc $(head -c 200 "$out" | tr '\n' ' ')"; fi ;;
      1) kind=chat
         body="{\"model\":\"$model\",\"messages\":[{\"role\":\"system\",\"content\":\"${prefixes[$((k % 4))]}\"},{\"role\":\"user\",\"content\":\"$suffix\"}],\"max_tokens\":16}"
         code=$(curl -s -o "$out" -w '%{http_code}' --max-time 120 "$url/v1/chat/completions" \
           -H 'Content-Type: application/json' -d "$body") || rc=$?
         if [ "$code" = 200 ] && jq -e '.choices[0].message.content | type == "string"' "$out" >/dev/null 2>&1
         then echo "$kind ok"; else echo "$kind error code=$code rc=$rc $(head -c 200 "$out" | tr '\n' ' ')"; fi ;;
      2) kind=long_stream
         body="{\"model\":\"$model\",\"prompt\":\"$prompt\",\"max_tokens\":512,\"ignore_eos\":true,\"stream\":true}"
         code=$(curl -sN -o "$out" -w '%{http_code}' --max-time 300 "$url/v1/completions" \
           -H 'Content-Type: application/json' -d "$body") || rc=$?
         if [ "$code" = 200 ] && [ "$(tail -c 14 "$out")" = "data: [DONE]" ] &&
            ! grep -q '^data: {"error"' "$out"
         then echo "$kind ok"; else echo "$kind error code=$code rc=$rc $(tail -c 200 "$out" | tr '\n' ' ')"; fi ;;
      3) kind=cancelled_stream  # the client hangs up mid-way (curl's timer)
         body="{\"model\":\"$model\",\"prompt\":\"$prompt\",\"max_tokens\":3000,\"ignore_eos\":true,\"stream\":true}"
         code=$(curl -sN -o "$out" -w '%{http_code}' --max-time "0.$(( RANDOM % 7 + 2 ))" \
           "$url/v1/completions" -H 'Content-Type: application/json' -d "$body") || rc=$?
         # 28: cut by the timer; 0: the stream ended first. Either way a 200.
         if [ "$code" = 200 ] && { [ "$rc" = 28 ] || [ "$rc" = 0 ]; }
         then echo "$kind ok"; else echo "$kind error code=$code rc=$rc $(head -c 200 "$out" | tr '\n' ' ')"; fi ;;
      4) kind=bad_request  # each must get a 4xx with an OpenAI-style error body
         local method=POST path=/v1/completions
         case $(( k % 7 )) in
           0) body='{"prompt": "unterminated' ;;
           1) body="{\"model\":\"$model\",\"max_tokens\":4}" ;;
           2) body="{\"model\":\"$model\",\"prompt\":\"x\",\"max_tokens\":-1}" ;;
           3) body="{\"model\":\"no-such-model\",\"prompt\":\"x\"}" ;;
           4) body="{\"model\":\"$model\",\"prompt\":\"x\",\"temperature\":\"hot\"}" ;;
           5) body="{\"model\":\"$model\",\"messages\":\"not a list\"}"; path=/v1/chat/completions ;;
           6) body=""; path=/v1/no-such-endpoint ;;
         esac
         code=$(curl -s -o "$out" -w '%{http_code}' --max-time 30 -X "$method" "$url$path" \
           -H 'Content-Type: application/json' -d "$body") || rc=$?
         if [[ "$code" =~ ^4[0-9][0-9]$ ]] && jq -e '.error.message | type == "string"' "$out" >/dev/null 2>&1
         then echo "$kind ok"; else echo "$kind error code=$code rc=$rc $(head -c 200 "$out" | tr '\n' ' ')"; fi ;;
      5) kind=completion_stream
         body="{\"model\":\"$model\",\"prompt\":\"$prompt\",\"max_tokens\":32,\"stream\":true}"
         code=$(curl -sN -o "$out" -w '%{http_code}' --max-time 120 "$url/v1/completions" \
           -H 'Content-Type: application/json' -d "$body") || rc=$?
         if [ "$code" = 200 ] && [ "$(tail -c 14 "$out")" = "data: [DONE]" ] &&
            ! grep -q '^data: {"error"' "$out"
         then echo "$kind ok"; else echo "$kind error code=$code rc=$rc $(tail -c 200 "$out" | tr '\n' ' ')"; fi ;;
    esac >>"$res"
  done
}
for ((c = 0; c < clients; c++)); do
  client "$c" &
  client_pids+=($!)
done

# --- progress ---------------------------------------------------------------
while [ "$(date +%s)" -lt "$end_at" ]; do
  sleep 10
  kill -0 "$up_pid" 2>/dev/null || { log "pdserve up exited; last lines:"; tail -20 "$dir/up.log" >&2; break; }
  done_n=$(cat "$dir"/results/client-*.txt 2>/dev/null | wc -l)
  err_n=$(cat "$dir"/results/client-*.txt 2>/dev/null | grep -c ' error' || true)
  rss=$(tail -n "${#pid_of[@]}" "$dir/rss.txt" 2>/dev/null | awk '{printf "%s %.0fMB ", $2, $3 / 1024}')
  left=$(( end_at - $(date +%s) ))
  log "$(( left > 0 ? left : 0 ))s left: $done_n requests, $err_n unexpected failures; RSS $rss"
done
for p in "${client_pids[@]}"; do wait "$p" 2>/dev/null || true; done
client_pids=()
kill "$sampler_pid" 2>/dev/null || true
wait "$sampler_pid" 2>/dev/null || true
sampler_pid=""
stack_alive=true
kill -0 "$up_pid" 2>/dev/null || stack_alive=false

# --- idle: every worker's KV usage back to 0 -------------------------------
metric() {  # metric URL NAME: the sum over label sets
  curl -s --max-time 5 "$1" | awk -v n="$2" '$1 == n || index($1, n "{") == 1 {s += $NF; found = 1}
    END {print (found ? s + 0 : "null")}'
}
kv_idle=false
kv_after="{}"
if $stack_alive; then
  log "load stopped; waiting for the workers' KV usage to return to 0"
  for _ in $(seq 1 60); do
    kv_after="{}" all_zero=true
    for w in "${workers[@]}"; do
      u=$(metric "${metrics_of[$w]}" pdserve_kv_cache_usage_ratio)
      kv_after=$(jq -c --arg w "$w" --argjson u "$u" '. + {($w): $u}' <<<"$kv_after")
      awk -v u="$u" 'BEGIN {exit !(u == 0)}' || all_zero=false
    done
    if $all_zero; then kv_idle=true; break; fi
    sleep 0.5
  done
fi
# The router's own counts: requests by status, routing decisions by kind.
by_label() {  # by_label METRIC LABEL: {"value": count, ...} from the router's /metrics
  awk -v m="$1" -v l="$2" '
    index($0, m "{") == 1 && match($0, l "=\"[^\"]*\"") {
      n[substr($0, RSTART + length(l) + 2, RLENGTH - length(l) - 3)] += $NF }
    END { printf "{"; sep = ""; for (v in n) { printf "%s\"%s\":%d", sep, v, n[v]; sep = "," } printf "}" }' \
    <<<"$router_metrics"
}
router_metrics=""
$stack_alive && router_metrics=$(curl -s --max-time 5 "$url/metrics")
router_status=$(by_label pdserve_router_requests_total status)
router_decisions=$(by_label pdserve_router_decisions_total kind)

# --- the JSON line ----------------------------------------------------------
slopes=$(awk -v w="$warmup_s" '
  $1 >= w { n[$2]++; x = $1 / 3600; y = $3 / 1024
            sx[$2] += x; sy[$2] += y; sxx[$2] += x * x; sxy[$2] += x * y }
  { if (!($2 in first)) first[$2] = $3 / 1024; last[$2] = $3 / 1024
    if ($3 / 1024 > max[$2]) max[$2] = $3 / 1024 }
  END {
    printf "{"; sep = ""
    for (p in first) {
      d = n[p] * sxx[p] - sx[p] * sx[p]
      slope = (n[p] >= 2 && d > 0) ? (n[p] * sxy[p] - sx[p] * sy[p]) / d : "null"
      printf "%s\"%s\":{\"slope_mb_per_hour\":%s,\"first_mb\":%.1f,\"last_mb\":%.1f,\"max_mb\":%.1f,\"fitted_samples\":%d}",
        sep, p, (slope == "null" ? slope : sprintf("%.2f", slope)), first[p], last[p], max[p], n[p]
      sep = ","
    }
    printf "}"
  }' "$dir/rss.txt")
samples=$(wc -l <"$dir/rss.txt")
results=$(cat "$dir"/results/client-*.txt)
by_kind=$(awk '{n[$1]++} END {printf "{"; s = ""; for (k in n) {printf "%s\"%s\":%d", s, k, n[k]; s = ","} printf "}"}' <<<"$results")
expected_4xx=$(grep -c '^bad_request ok' <<<"$results" || true)
errors=$(grep -c ' error' <<<"$results" || true)
error_examples=$(awk '/ error/ && n++ < 5' <<<"$results" | jq -R . | jq -sc .)
cpu=$(awk -F': ' '/^model name/ {print $2; exit}' /proc/cpuinfo)
elapsed=$(awk -v a="$(date +%s.%N)" -v b="$start_s" 'BEGIN {printf "%.0f", a - b}')
jq -nc \
  --argjson minutes "$minutes" --argjson elapsed "$elapsed" \
  --argjson rss "$slopes" --argjson samples "$samples" --argjson requests "$by_kind" \
  --argjson total "$(wc -l <<<"$results")" --argjson expected_4xx "$expected_4xx" \
  --argjson errors "$errors" --argjson error_examples "$error_examples" \
  --argjson kv_idle "$kv_idle" --argjson kv_after "$kv_after" \
  --argjson router_status "$router_status" --argjson router_decisions "$router_decisions" \
  --argjson alive "$stack_alive" \
  --argjson nproc "$(nproc)" --arg cpu "$cpu" --arg bin "$bin" \
  --argjson clients "$clients" --argjson prefill "$prefill" --argjson decode "$decode" \
  --argjson mlp "$max_local_prefill" --argjson sample_s "$sample_s" --argjson warmup_s "$warmup_s" \
  '{bench: "soak", minutes: $minutes, elapsed_s: $elapsed, rss: $rss, samples: $samples,
    requests: $requests, requests_total: $total, expected_4xx: $expected_4xx, errors: $errors,
    error_examples: $error_examples, kv_usage_idle_zero: $kv_idle, kv_usage_after: $kv_after,
    router_requests_by_status: $router_status, router_decisions: $router_decisions,
    stack_alive: $alive,
    machine: {nproc: $nproc, cpu: $cpu},
    settings: {bin: $bin, clients: $clients, prefill: $prefill, decode: $decode,
               max_local_prefill: $mlp, sample_seconds: $sample_s, warmup_seconds: $warmup_s}}'
log "done; logs in $dir"
