#!/usr/bin/env bash
# Builds everything (CUDA included) into build-cuda/ here, with the commit in build-cuda/COMMIT,
# so that a GPU machine can run it without building:
#   (GPU machine, repo root)  MOK_BUILD_DIR=$PWD/build-cuda MOK_PREBUILT=1 scripts/device-check.sh
# The repo must sit at the same absolute path there (ctest's files name it).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MOK_BUILD_DIR=$root/build-cuda
"$root/scripts/build.sh"
git -C "$root" rev-parse --short=12 HEAD >"$MOK_BUILD_DIR/COMMIT"
git -C "$root" diff --quiet HEAD || echo "build-for-device: note: the working tree differs from $(cat "$MOK_BUILD_DIR/COMMIT")"
