#!/usr/bin/env bash
# Builds mok (CUDA included) into build-cuda/ here, with the commit in build-cuda/COMMIT, and packs
# the programs a GPU machine runs into build-pack/build-cuda.tar.xz (small enough to travel with
# the working tree; object files and static libraries stay here), so that the GPU machine can run
# them without building:
#   (here)                     [MOK_PACK_TORCH=1] scripts/build-for-device.sh [TARGET...]
#                              (default: every target)
#   (GPU machine, repo root)   MOK_BUILD_DIR=$PWD/build-cuda MOK_PREBUILT=1 scripts/device-check.sh [PART...]
# device-check.sh unpacks build-pack/build-cuda.tar.xz into $MOK_BUILD_DIR when that folder holds no
# COMMIT file. With TARGETs (e.g. `mok bench_layer` for scripts/device/layer.sh's quick mode) only
# those are built and packed beside what an earlier build left. ctest's files name absolute paths:
# the tests part needs the repo at the same absolute path there.
# MOK_PACK_TORCH=1 also builds the torch extension's core (scripts/device/python.sh prebuild) and
# puts its static libraries in build-pack/torch/ (~16 MB), where `scripts/device/python.sh install`
# finds them: the python and transformers parts then compile only src/torch there.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export MOK_BUILD_DIR=$root/build-cuda
"$root/scripts/build.sh" "$@"
git -C "$root" rev-parse --short=12 HEAD >"$MOK_BUILD_DIR/COMMIT"
git -C "$root" diff --quiet HEAD || echo "build-for-device: note: the working tree differs from $(cat "$MOK_BUILD_DIR/COMMIT")"
mkdir -p "$root/build-pack"
tar -C "$MOK_BUILD_DIR" --exclude='*.o' --exclude='*.a' --exclude='CMakeFiles/[0-9]*' \
  --exclude='python-env' -cf - . | xz -T0 -3 >"$root/build-pack/build-cuda.tar.xz"
echo "build-for-device: packed $(du -h "$root/build-pack/build-cuda.tar.xz" | cut -f1) into build-pack/build-cuda.tar.xz ($(cat "$MOK_BUILD_DIR/COMMIT"))"
if [[ ${MOK_PACK_TORCH:-0} == 1 ]]; then
  "$root/scripts/device/python.sh" prebuild
  rm -rf "$root/build-pack/torch" && mkdir -p "$root/build-pack/torch"
  cp "${MOK_TORCH_PREBUILT_DIR:-$root/build-torch-prebuilt}"/lib*.a "$root/build-pack/torch/"
  echo "build-for-device: packed the torch extension's core into build-pack/torch ($(du -sh "$root/build-pack/torch" | cut -f1))"
fi
