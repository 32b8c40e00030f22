#!/usr/bin/env bash
# Starts Debian's Prometheus server (package `prometheus`) scraping the local
# pdserve stack with deploy/local/prometheus.yml and the pdserve alert rules.
#
#   deploy/local/prometheus.sh [--router HOST:PORT] [--prefill HOST:PORT,...]
#                              [--decode HOST:PORT,...] [--listen HOST:PORT]
#                              [--dir DIR] [--check]
#
# Targets are the /metrics addresses (defaults: the local stack's router on
# 127.0.0.1:8000, prefill worker on 127.0.0.1:9100, decode worker on
# 127.0.0.1:9200). DIR (default .deps/prometheus in the checkout) receives
# prometheus.yml, the rules, targets/pdserve.json and the data; rerunning with
# other targets while a server runs updates its targets within seconds.
# --check validates the prepared configuration with promtool and exits.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
router=127.0.0.1:8000
prefill=127.0.0.1:9100
decode=127.0.0.1:9200
listen=127.0.0.1:9090
dir="$root/.deps/prometheus"
check=false

die() { echo "prometheus.sh: $*" >&2; exit 2; }
while (($#)); do
  case "$1" in
    --router | --prefill | --decode | --listen | --dir)
      (($# >= 2)) || die "$1 needs a value (see --help)"
      declare "${1#--}=$2"
      shift 2 ;;
    --check) check=true; shift ;;
    -h | --help) sed -n '2,15s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done

# One file_sd group per pool: ["a:1","b:2"] with labels {pool: ...}.
group() {
  local pool="$1" list="$2" out="" t
  [ -n "$list" ] || return 0
  IFS=, read -r -a addrs <<<"$list"
  for t in "${addrs[@]}"; do out+="${out:+, }\"$t\""; done
  printf '  {"targets": [%s], "labels": {"pool": "%s"}}' "$out" "$pool"
}
for pool in router prefill decode; do
  IFS=, read -r -a addrs <<<"${!pool}"
  for t in "${addrs[@]}"; do
    [[ "$t" =~ ^[^:/[:space:]\"]+:[0-9]+$ ]] || die "--$pool: '$t' is not HOST:PORT"
  done
done
[[ "$listen" =~ ^[^:/[:space:]]*:[0-9]+$ ]] || die "--listen: '$listen' is not HOST:PORT"

mkdir -p "$dir/targets" "$dir/data"
cp "$here/prometheus.yml" "$dir/prometheus.yml"
cp "$root/deploy/prometheus/pdserve-alerts.yaml" "$dir/pdserve-alerts.yaml"
groups=()
for g in "$(group router "$router")" "$(group prefill "$prefill")" "$(group decode "$decode")"; do
  [ -n "$g" ] && groups+=("$g")
done
# Written aside, then renamed: the running server never reads half a file.
{
  echo "["
  (IFS=$'\n'; printf '%s\n' "${groups[*]}" | sed '$!s/$/,/')
  echo "]"
} >"$dir/targets/.pdserve.json.tmp"
mv "$dir/targets/.pdserve.json.tmp" "$dir/targets/pdserve.json"

if $check; then
  exec promtool check config "$dir/prometheus.yml"
fi
command -v prometheus >/dev/null || die "the prometheus server is missing: run deploy/local/install-deps.sh"
echo "prometheus.sh: scraping router=$router prefill=$prefill decode=$decode"
echo "prometheus.sh: UI and API on http://$listen (Ctrl-C stops it); data in $dir/data"
exec prometheus \
  --config.file="$dir/prometheus.yml" \
  --storage.tsdb.path="$dir/data" \
  --storage.tsdb.retention.time=2d \
  --web.listen-address="$listen" \
  --web.enable-lifecycle
