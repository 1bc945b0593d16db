#!/usr/bin/env bash
# Configures and builds mok into build/ (or $MOK_BUILD_DIR). Extra arguments are build targets;
# extra CMake arguments come from $MOK_CMAKE_ARGS.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${MOK_BUILD_DIR:-$root/build}
"$root/scripts/bootstrap.sh"
generator=()
[[ -f "$build_dir/CMakeCache.txt" ]] || generator=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
# shellcheck disable=SC2086  # MOK_CMAKE_ARGS is a list of words
cmake -S "$root" -B "$build_dir" "${generator[@]}" ${MOK_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" -j "$(nproc)" ${1:+--target "$@"}
