#!/usr/bin/env bash
# Configures and builds mok into build/ (or $MOK_BUILD_DIR). Extra arguments are build targets.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${MOK_BUILD_DIR:-$root/build}
"$root/scripts/bootstrap.sh"
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${MOK_CMAKE_ARGS:-} >/dev/null
fi
cmake --build "$build_dir" -j "$(nproc)" ${1:+--target "$@"}
