#!/usr/bin/env bash
# Soak part of the device check: bench_soak's 10,000 forward + backward training steps on one GPU
# with a new routing every step, a probe bitwise the same before and after, device memory flat,
# no fault recorded, and the time per step's drift reported (bench/bench_soak.cu).
#
#   OUT=/tmp/out scripts/device/soak.sh [BIN_DIR]
# BIN_DIR holds bench_soak (default $MOK_BUILD_DIR, set by scripts/device-check.sh). Results:
# soak.json and soak.log in $MOK_RESULTS_DIR when device-check sets it, else $OUT.
# MOK_SOAK_STEPS overrides the step count.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${MOK_RESULTS_DIR:-${OUT:?set OUT to the results folder}}
BIN=${1:-${MOK_BUILD_DIR:?pass the build folder}}
mkdir -p "$OUT"
timeout 300 "$BIN/bench_soak" --steps "${MOK_SOAK_STEPS:-10000}" --out "$OUT/soak.json" 2>&1 |
  tee "$OUT/soak.log"
exit "${PIPESTATUS[0]}"
