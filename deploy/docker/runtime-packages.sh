#!/usr/bin/env bash
# Prints, one per line, the Debian/Ubuntu packages that own the shared
# libraries BINARY loads (per ldd). The final stage of the container images
# installs exactly these, so it carries runtime libraries and no build tools.
# Fails, naming the library, when a library belongs to no package (it could
# not be installed in the final stage) or cannot be found.
#
#   runtime-packages.sh BINARY
set -euo pipefail
bin="${1:?usage: runtime-packages.sh BINARY}"
[ -x "$bin" ] || { echo "runtime-packages.sh: $bin is not an executable" >&2; exit 2; }

ldd_out="$(ldd "$bin")"
if grep -q 'not found' <<<"$ldd_out"; then
  echo "runtime-packages.sh: $bin needs libraries that are not installed:" >&2
  grep 'not found' <<<"$ldd_out" >&2
  exit 1
fi

# dpkg records paths as the package shipped them; with merged /usr a library
# may be found as /lib/... or /usr/lib/..., and through symlinks.
owner() {
  local lib="$1" p
  for p in "$lib" "$(readlink -f "$lib")" "/usr${lib}" "${lib#/usr}"; do
    dpkg-query -S "$p" 2>/dev/null | head -n 1 | cut -d: -f1 && return 0
  done
  return 1
}

status=0
packages=()
while read -r lib; do
  # The CUDA runtime comes with the CUDA base image, not from a package here.
  case "$lib" in /usr/local/cuda*) continue ;; esac
  if pkg="$(owner "$lib")" && [ -n "$pkg" ]; then
    packages+=("$pkg")
  else
    echo "runtime-packages.sh: $lib belongs to no installed package" >&2
    status=1
  fi
done < <(awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}' <<<"$ldd_out" | sort -u)
((status == 0)) || exit "$status"
printf '%s\n' "${packages[@]}" | sort -u
