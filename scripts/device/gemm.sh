#!/usr/bin/env bash
# GEMM part of the device check: runs the grouped GEMM GPU tests, the benchmark next to torch
# (mok on both engines, cooperative and ping-pong, and torch timed in two passes each), the
# chart, the SwiGLU epilogue's cost (fused against plain gate/up launched alternately, 5 rounds,
# gemm-swiglu-cost.json; and in blocks of 64 launches, gemm-swiglu-cost-block64.json), the clock,
# power and TFLOP per joule at the power cap of deepseek-v3 gate/up beside torch (gemm-power.json),
# a SASS check and Nsight Compute profiles of deepseek-v3's gate/up and qwen3-235b's plain and
# SwiGLU-fused gate/up GEMMs on each engine of $MOK_GEMM_NCU_ENGINES (default: cooperative
# pingpong), on GPU 0. Results and logs go to the results folder, under stable names (the
# commit is inside each JSON): gemm.json (mok-bench/1), gemm.png, gemm.log, gemm-torch.json,
# gemm-tests.txt, gemm-swiglu-cost.json, gemm-swiglu-cost-block64.json, gemm-power.json,
# gemm-ncu.txt.
#
#   OUT=/tmp/out scripts/device/gemm.sh [BIN_DIR]
# BIN_DIR holds mok_gpu_tests (or a GEMM-only mok_gemm_tests) and bench_gemm, e.g. built here with
#   cmake -S . -B build-gemm -G Ninja && ninja -C build-gemm mok_gpu_tests bench_gemm
# and copied into an ignored folder carried to the GPU machine. Default: $MOK_BUILD_DIR (set by
# scripts/device-check.sh), else build-gemm-bin. When the binaries are missing or do not start
# there, the script builds them into build-gemm-device first. Results go to $MOK_RESULTS_DIR when
# device-check sets it, else to $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
OUT=${MOK_RESULTS_DIR:-${OUT:?set OUT to the results folder}}
BIN=${1:-${MOK_BUILD_DIR:-build-gemm-bin}}
mkdir -p "$OUT"
LOG="$OUT/gemm.log"
: > "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }

TESTS="$BIN/mok_gemm_tests"
[ -x "$TESTS" ] || TESTS="$BIN/mok_gpu_tests"
if ! "$TESTS" --gtest_list_tests > /dev/null 2>&1; then
  say "carried binaries missing or not runnable here: building"
  BIN=build-gemm-device
  if ! { cmake -S . -B "$BIN" -G Ninja -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc >> "$LOG" 2>&1 &&
    ninja -C "$BIN" -j16 mok_gpu_tests bench_gemm >> "$LOG" 2>&1; }; then
    say "build failed"
    exit 1
  fi
  TESTS="$BIN/mok_gpu_tests"
fi

say "device"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"

say "SASS: HGMMA count and local-memory traffic per kernel"
if command -v cuobjdump > /dev/null; then
  cuobjdump --dump-sass "$BIN/bench_gemm" 2>/dev/null |
    awk '/Function :/ {name=$3} /\/\*[0-9a-f]+\*\// {count[name]++} /HGMMA/ {hgmma[name]++}
         /STL|LDL/ {local[name]++}
         END {for (n in hgmma) printf "%-100s SASS %d HGMMA %d local %d\n", n, count[n], hgmma[n], local[n]}' |
    tee -a "$LOG"
fi

test_status=0
if [ "${MOK_PART_TESTS:-1}" = 1 ]; then  # device-check runs every GPU test itself and sets 0
  say "tests"
  timeout 240 "$TESTS" --gtest_filter='GroupedGemm*:GemmSwiGlu*' 2>&1 | tee "$OUT/gemm-tests.txt" | tail -25 | tee -a "$LOG"
  test_status=${PIPESTATUS[0]}
fi

say "benchmark (mok)"
timeout 120 "$BIN/bench_gemm" --out /tmp/gemm-mok-1.json --iterations 20 2>&1 | tee -a "$LOG"

nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active --format=csv 2>&1 | tee -a "$LOG"

say "baseline (torch) and results"
RESULTS="$OUT/gemm.json"
timeout 240 python3 bench/baselines/torch_grouped_mm.py measure --mok /tmp/gemm-mok-1.json \
  --torch "$OUT/gemm-torch.json" --passes 2 2>&1 | tee -a "$LOG"
say "benchmark (mok), second pass"
timeout 120 "$BIN/bench_gemm" --out /tmp/gemm-mok-2.json --iterations 20 2>&1 | tee -a "$LOG"
python3 bench/baselines/torch_grouped_mm.py combine --mok /tmp/gemm-mok-1.json --mok /tmp/gemm-mok-2.json \
  --torch "$OUT/gemm-torch.json" --out "$RESULTS" \
  --commit "${MOK_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}" 2>&1 | tee -a "$LOG"
python3 bench/plot_gemm.py "$RESULTS" "$OUT/gemm.png" 2>&1 | tee -a "$LOG"
say "SwiGLU cost: the SwiGLU-fused gate/up against the plain one, launched alternately (5 rounds)"
timeout 170 "$BIN/bench_gemm" --swiglu-cost "$OUT/gemm-swiglu-cost.json" --iterations 30 --rounds 5 2>&1 |
  tee -a "$LOG"
say "SwiGLU cost with blocks of 64 launches of each alternated (each kernel at its own clock; 3 rounds)"
timeout 120 "$BIN/bench_gemm" --swiglu-cost "$OUT/gemm-swiglu-cost-block64.json" --engine cooperative \
  --iterations 4 --rounds 3 --block 64 2>&1 | tee -a "$LOG"

say "At the power cap: clock, power and TFLOP per joule of deepseek-v3 gate/up, mok beside torch (2 rounds)"
timeout 150 python3 bench/baselines/gemm_power.py --bench "$BIN/bench_gemm" --out "$OUT/gemm-power.json" \
  --gpu "${CUDA_VISIBLE_DEVICES%%,*}" --commit "${MOK_COMMIT:-unknown}" 2>&1 | tee -a "$LOG"

if [ "${MOK_GEMM_NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  : > "$OUT/gemm-ncu.txt"
  NCU_SECTIONS=${MOK_GEMM_NCU_SECTIONS:-SpeedOfLight MemoryWorkloadAnalysis Occupancy LaunchStats WarpStateStats SchedulerStats}
  NCU_SECTION_ARGS=()  # one --section per word
  for NCU_SECTION in $NCU_SECTIONS; do NCU_SECTION_ARGS+=(--section "$NCU_SECTION"); done
  for NCU_CASE in ${MOK_GEMM_NCU_CASES:-deepseek-v3/gemm-gateup qwen3-235b-a22b/gemm-gateup qwen3-235b-a22b/gemm-gateup-swiglu}; do
    for NCU_ENGINE in ${MOK_GEMM_NCU_ENGINES:-cooperative pingpong}; do
      say "Nsight Compute: $NCU_CASE ($NCU_ENGINE)"
      echo "==== $NCU_CASE ($NCU_ENGINE)" >> "$OUT/gemm-ncu.txt"
      timeout 120 ncu --clock-control none "${NCU_SECTION_ARGS[@]}" \
        -k regex:'grouped_gemm|pingpong_gemm' --launch-skip 2 --launch-count 1 \
        "$BIN/bench_gemm" --only "$NCU_CASE" --engine "$NCU_ENGINE" --iterations 1 \
        --out /tmp/ncu.json >> "$OUT/gemm-ncu.txt" 2>&1
    done
  done
  grep -E "^====|Duration|SM Frequency|Elapsed Cycles|Compute \(SM\)|L2 Cache Throughput|DRAM Throughput|Issued Warp" \
    "$OUT/gemm-ncu.txt" | tee -a "$LOG"
fi
exit "$test_status"
