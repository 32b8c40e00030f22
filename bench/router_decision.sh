#!/usr/bin/env bash
# Router decision time (docs/routing.md, "Decision time"): `pdserve bench
# router` at 64 workers, 1M indexed blocks and 128-block prompts in four
# configurations (no loads; loads; loads with the copy rule at price 0.1;
# loads with stored and evicted events), ROUNDS rounds, each round running
# every configuration with every binary given, interleaved so that a
# change in the machine's speed hits them alike. One JSON line per run on
# stdout, with `args`, `build` (the binary as given) and `round` added;
# progress on stderr.
#
#   bench/router_decision.sh ROUNDS BINARY [BINARY ...]
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bench/router_decision.sh ROUNDS BINARY [BINARY ...]" >&2
  exit 2
fi
rounds=$1
shift
configs=("" "--loads" "--loads --replication-copy-cost 0.1"
  "--loads --stored-events-after 100 --evicted-after 2000")
for ((r = 1; r <= rounds; r++)); do
  for args in "${configs[@]}"; do
    for bin in "$@"; do
      echo "round $r/$rounds: $bin ${args:-(no loads)}" >&2
      # shellcheck disable=SC2086
      "$bin" bench router --workers 64 --indexed-blocks 1000000 --prompt-blocks 128 $args --json \
        2>/dev/null | python3 -c '
import json, sys
j = json.loads(sys.stdin.read())
j.update(args=sys.argv[1], build=sys.argv[2], round=int(sys.argv[3]))
print(json.dumps(j))' "$args" "$bin" "$r"
    done
  done
done
