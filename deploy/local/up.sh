#!/usr/bin/env bash
# `make up`: start the local stack with the embedded default (tiny) model.
# Uses the most complete thing the pdserve binary offers: the full local stack
# (`pdserve up`), else an offline generation on the tiny model, else the KV
# capacity planner for a well-known model shape.
set -euo pipefail
bin="${1:?usage: up.sh PATH_TO_PDSERVE}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
has() { "$bin" --help | grep -qE "^  $1 "; }

if has up; then
  exec "$bin" up
elif has generate && has make-model; then
  model="$root/.deps/models/tiny"
  [ -f "$model/config.json" ] || "$bin" make-model --preset tiny --out "$model"
  exec "$bin" generate --model "$model" --prompt "Hello, pdserve!" --max-tokens 32
else
  echo "up.sh: the serving stack is not built yet; showing the KV capacity planner instead"
  exec "$bin" plan --layers 28 --kv-heads 4 --head-dim 128 --kv-dtype fp16 --context 131072
fi
