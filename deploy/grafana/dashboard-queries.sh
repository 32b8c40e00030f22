#!/usr/bin/env bash
# Lists every PromQL expression of a Grafana dashboard, one JSON object per
# line: {"panel": title, "refId": "A", "legend": ..., "expr": ...}.
#
#   dashboard-queries.sh [--resolve] [DASHBOARD_JSON]
#
# --resolve replaces the dashboard variables with values Prometheus itself
# accepts, so each expression can be sent to its HTTP API unchanged:
# $__rate_interval -> $RATE_INTERVAL (default 1m), $namespace -> .* (all).
# DASHBOARD_JSON defaults to the pdserve dashboard next to this script.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
resolve=false
file="$here/pdserve-dashboard.json"
for arg in "$@"; do
  case "$arg" in
    --resolve) resolve=true ;;
    -h | --help) sed -n '2,10s/^# \{0,1\}//p' "$0"; exit 0 ;;
    -*) echo "dashboard-queries.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *) file="$arg" ;;
  esac
done
[ -r "$file" ] || { echo "dashboard-queries.sh: cannot read $file" >&2; exit 2; }

jq -c --argjson resolve "$resolve" --arg interval "${RATE_INTERVAL:-1m}" '
  [.. | objects | select(has("panels")) | .panels[]?]
  | map(select(.targets?) | . as $p | .targets[] | select(.expr?)
        | {panel: $p.title, refId: .refId, legend: (.legendFormat // ""), expr: .expr})
  | .[]
  | if $resolve then
      .expr |= (gsub("\\$__rate_interval"; $interval) | gsub("\\$namespace"; ".*"))
    else . end
' "$file"
