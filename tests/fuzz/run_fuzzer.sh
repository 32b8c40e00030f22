#!/usr/bin/env bash
# Builds one libFuzzer target with clang++ (libFuzzer + ASan + UBSan) and runs
# it for a bounded time on a copy of its checked-in seed corpus. CMakeLists.txt
# in this folder holds the table of targets and calls this script for each.
#
# Exit status: 0 when the fuzzer finds nothing, non-zero on any crash, leak,
# timeout, out-of-memory, sanitizer report or contract violation (the input is
# kept in OUT/artifacts and printed as hex, with the command that replays it).
#
# usage: run_fuzzer.sh --name NAME --clang CLANGXX --source-dir SRC --binary-dir BIN
#                      --out OUT --seconds N --fuzzer FILE --corpus DIR
#                      [--source FILE]... [--lib LIB]...
#   FILE, DIR  relative to SRC, or absolute (generated code in BIN: compiled
#              with warnings off, since it is not ours)
#   --source   project code the target needs; compiled with the same
#              instrumentation as the target itself
#   --lib      pkg:<pkg-config module>, a static library of the main build
#              (linked as it is, uninstrumented: code the target needs but
#              does not test), or a linker flag such as -lpthread
# PDSERVE_FUZZ_SECONDS in the environment overrides --seconds. A dictionary
# tests/fuzz/NAME.dict, when present, is passed to the fuzzer.
set -euo pipefail

name="" clangxx="" src="" bin="" out="" seconds="" fuzzer="" corpus=""
sources=() libs=()
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name="$2" ;;
    --clang) clangxx="$2" ;;
    --source-dir) src="$2" ;;
    --binary-dir) bin="$2" ;;
    --out) out="$2" ;;
    --seconds) seconds="$2" ;;
    --fuzzer) fuzzer="$2" ;;
    --corpus) corpus="$2" ;;
    --source) sources+=("$2") ;;
    --lib) libs+=("$2") ;;
    *) echo "run_fuzzer.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift 2
done
for v in name clangxx src bin out seconds fuzzer corpus; do
  if [ -z "${!v}" ]; then echo "run_fuzzer.sh: missing --${v}" >&2; exit 2; fi
done
seconds="${PDSERVE_FUZZ_SECONDS:-$seconds}"

abs() { case "$1" in /*) echo "$1" ;; *) echo "$src/$1" ;; esac; }
fuzzer="$(abs "$fuzzer")"
corpus="$(abs "$corpus")"

mkdir -p "$out/obj" "$out/corpus" "$out/artifacts"
rm -f "$out/artifacts"/*  # only this run's findings are reported
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(ccache)
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer-no-link,address,undefined
  -fno-sanitize-recover=undefined -fno-omit-frame-pointer -I"$src" -I"$bin")
link_args=()
for lib in "${libs[@]}"; do
  case "$lib" in
    pkg:*)
      read -r -a cflags <<<"$(pkg-config --cflags "${lib#pkg:}")"
      read -r -a lflags <<<"$(pkg-config --libs "${lib#pkg:}")"
      flags+=("${cflags[@]}")
      link_args+=("${lflags[@]}")
      ;;
    -*) link_args+=("$lib") ;;
    *)
      if [ ! -f "$lib" ]; then
        echo "fuzz: $lib is missing; build the project first" >&2
        exit 1
      fi
      link_args+=("$lib")
      ;;
  esac
done

# Compiles every source in parallel (one job per core); ccache makes a rebuild
# of unchanged code cost nothing.
compile_list=("$fuzzer" "${sources[@]}")
objects=()
jobs_max="$(nproc)"
echo "fuzz: compiling ${#compile_list[@]} file(s) with $("$clangxx" --version | head -1)"
for source in "${compile_list[@]}"; do
  source="$(abs "$source")"
  if [ ! -f "$source" ]; then
    echo "fuzz: $source is missing; build the project first (generated files come from the main build)" >&2
    exit 1
  fi
  case "$source" in
    "$bin"/*) warnings=(-w) ;;
    *) warnings=(-Wall -Wextra -Werror) ;;
  esac
  rel="${source#"$src"/}"
  rel="${rel#"$bin"/}"
  object="$out/obj/${rel//\//_}.o"
  objects+=("$object")
  rm -f "$object"
  extra=()
  [ "$source" = "$fuzzer" ] && extra=(-DPDSERVE_SOURCE_DIR="\"$src\"")
  "${launcher[@]}" "$clangxx" "${flags[@]}" "${warnings[@]}" "${extra[@]}" \
    -c "$source" -o "$object" &
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
done
wait
for object in "${objects[@]}"; do
  [ -f "$object" ] || { echo "fuzz: compilation failed" >&2; exit 1; }
done
binary="$out/${name}_fuzzer"
"$clangxx" -fsanitize=fuzzer,address,undefined "${objects[@]}" \
  -Wl,--start-group "${link_args[@]}" -Wl,--end-group -lpthread -o "$binary"

options=(-max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
  -artifact_prefix="$out/artifacts/")
[ -f "$src/tests/fuzz/$name.dict" ] && options+=(-dict="$src/tests/fuzz/$name.dict")
echo "fuzz: running $name for ${seconds}s"
cd "$out"
status=0
# detect_leaks stays on: a leak fails the run like a crash. New inputs go to
# the first folder (a scratch copy), never into the checked-in corpus.
"$binary" "${options[@]}" "$out/corpus" "$corpus" || status=$?
if [ "$status" -ne 0 ]; then
  echo "fuzz: $name FAILED (exit $status); reproducer(s), replay with $binary FILE:" >&2
  for f in "$out"/artifacts/*; do
    [ -f "$f" ] || continue
    echo "  $f: $(od -An -tx1 -v "$f" | tr -d '\n' | head -c 400)" >&2
  done
fi
exit "$status"
