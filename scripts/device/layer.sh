#!/usr/bin/env bash
# Layer part of the device check: the GPU layer forward (LayerForward, fused kernel by default) and
# backward (LayerBackward) — their GPU tests, `mok run --backend cuda` with --check (forward and
# backward), bench_layer for the fused kernel and the backward (schedule
# in the kernel, and after the schedule's own kernels), the unfused composition, a sweep of
# communication CTAs and minibatch sizes, ring rounds — and the torch-native baseline
# (bench/baselines/torch_native.py: every variant checked, then timed forward and as a training
# step, with the dense GEMM rate, at EP 1 in one process and at EP 2 under torchrun), all in the
# same run. The EP 2 steps run only where there are 2 or more GPUs. Then FP8 (issue 24), where
# bench_layer has --precision: mok's FP8 layer forward and training step (the weights quantized to
# e4m3 in both layouts + forward + backward, recompute mode) beside its own bf16 forward and
# training step (save mode), and the torch-native rowwise FP8 layer's forward
# (torch._scaled_grouped_mm, the activations' quantization timed) on the same routing; torch-native
# has no FP8 training step, so the fp8 training step's baseline is torch's bf16 one.
# Results (stable names; the commit is inside each JSON):
#   layer.json, layer.png      mok-bench/2: mok beside the fastest torch-native variant, per case
#                              and phase (bench/baselines/layer_results.py, bench/report.py)
#   layer-mok.json, layer-mok-separate-schedule.json, layer-mok-unfused.json, layer-sweep.json,
#   layer-ring.json            bench_layer's own JSONs
#   layer-torch-ep1.json, layer-torch-ep2.json   torch_native.py's figures (every variant)
#   layer-mok-fp8.json         bench_layer --precision fp8 --backward 1: mok's FP8 forward
#                              (mok_ms), training step (fwdbwd_ms; on cached weights:
#                              fwdbwd_cached_weights_ms) and backward (backward_ms),
#                              its bf16 ones beside them (bf16_forward_ms, bf16_fwdbwd_ms,
#                              bf16_backward_ms); layer.json's "-fp8" entries, phases fwd, fwdbwd
#                              and bwd
#   layer-torch-fp8-ep1.json   torch-native's FP8 forward (every variant)
#   layer-mok-mxfp8.json       bench_layer --precision mxfp8 --backward 1, the same fields
#                              (qwen3-30b-a3b and mixtral-8x7b; MOK_MXFP8_CASES)
#   mok-run-cuda-{tiny,qwen3-30b}-ep{1,2}.json, layer.log
#
#   OUT=/tmp/out scripts/device/layer.sh [BIN_DIR]
# BIN_DIR holds mok, mok_gpu_tests and bench_layer (default $MOK_BUILD_DIR, set by
# scripts/device-check.sh). Results go to $MOK_RESULTS_DIR when device-check sets it, else $OUT.
# MOK_PART_TESTS=0 skips the GPU tests (device-check has run them). MOK_LAYER_CASES picks
# bench_layer cases (comma-separated names; default all); MOK_FP8_CASES the FP8 ones (default the
# same, less deepseek-v3 on a GPU of less than 100 GB). MOK_LAYER_QUICK=1 runs only what layer.json
# needs, for a short machine window: the fused bench_layer (forward and training step),
# torch-native, FP8 (MOK_LAYER_FP8=0: not), results and chart; it needs only mok and bench_layer in
# BIN_DIR (scripts/build-for-device.sh mok bench_layer).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${MOK_RESULTS_DIR:-${OUT:?set OUT to the results folder}}
BIN=${1:-${MOK_BUILD_DIR:?pass the build folder}}
COMMIT=${MOK_COMMIT:-$(cat "$BIN/COMMIT" 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
LOG="$OUT/layer.log"
: > "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
status=0
step() {  # step NAME TIMEOUT COMMAND...: runs it, logs it, remembers a failure
  local name=$1 limit=$2
  shift 2
  say "$name"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  ((code == 0)) || { say "$name: exit $code"; status=1; }
}

nvidia-smi --query-gpu=index,name,clocks.sm,temperature.gpu,power.draw --format=csv 2>&1 | tee -a "$LOG"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
gpu_memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)

quick=${MOK_LAYER_QUICK:-0}
if [ "${MOK_PART_TESTS:-1}" = 1 ] && [ "$quick" != 1 ]; then
  step "GPU tests (layer forward, fused and unfused; layer backward)" 240 "$BIN/mok_gpu_tests" \
    --gtest_filter='*LayerForward*:*Fused*:*LayerBackward*'
fi

if [ "$quick" != 1 ]; then
step "mok run --backend cuda, tiny, EP 1, --check (forward and backward; the low-memory one too)" 120 \
  "$BIN/mok" run --backend cuda --tokens 1000 --routing skewed:1.2 --low-memory-backward \
  --json "$OUT/mok-run-cuda-tiny-ep1.json"
step "mok run --backend cuda, qwen3-30b-a3b, EP 1, 4096 tokens, --check" 240 \
  "$BIN/mok" run --backend cuda --preset qwen3-30b-a3b --tokens 4096 \
  --json "$OUT/mok-run-cuda-qwen3-30b-ep1.json"
if ((gpus >= 2)); then
  step "mok run --backend cuda, tiny, EP 2, --check" 120 \
    "$BIN/mok" run --backend cuda --ep 2 --tokens 1000 --routing skewed:1.2 --json "$OUT/mok-run-cuda-tiny-ep2.json"
  step "mok run --backend cuda, qwen3-30b-a3b, EP 2, 4096 tokens/rank, --check" 240 \
    "$BIN/mok" run --backend cuda --preset qwen3-30b-a3b --ep 2 --tokens 4096 \
    --json "$OUT/mok-run-cuda-qwen3-30b-ep2.json"
else
  say "mok run --backend cuda at EP 2: skipped ($gpus GPU)"
fi
fi  # quick

routing_dir=$(mktemp -d)
cases=()
if [ -n "${MOK_LAYER_CASES:-}" ]; then cases=(--cases "$MOK_LAYER_CASES"); fi
# (--chunked-backward: save mode again with the low-memory backward, where this bench_layer has it)
chunked=()
if [[ $("$BIN/bench_layer" --help 2>&1) == *--chunked-backward* ]]; then
  chunked=(--chunked-backward 1)
fi
step "bench_layer (mok, fused)" 260 "$BIN/bench_layer" --iters 20 --out "$OUT/layer-mok.json" \
  --routing-dir "$routing_dir" "${cases[@]}" "${chunked[@]}"
if [ "$quick" != 1 ]; then
step "bench_layer (mok, fused after the schedule kernels; forward)" 200 "$BIN/bench_layer" \
  --iters 20 --backward 0 --schedule-in-kernel 0 --out "$OUT/layer-mok-separate-schedule.json" \
  "${cases[@]}"
step "bench_layer (mok, unfused; forward)" 200 "$BIN/bench_layer" --iters 20 --backward 0 --fused 0 \
  --out "$OUT/layer-mok-unfused.json" "${cases[@]}"
if ((gpus >= 2)); then
  # Forward parameters: the sweeps time the forward alone (--backward 0) to keep the check short.
  step "bench_layer sweep (communication CTAs x minibatch rows)" 240 "$BIN/bench_layer" --iters 10 \
    --backward 0 --cases "${MOK_SWEEP_CASES:-deepseek-v3-ep2,qwen3-30b-a3b-ep2}" --comm-ctas 0,8,16,24 \
    --minibatch-rows 2048,4096,8192 --out "$OUT/layer-sweep.json"
  step "bench_layer ring rounds (ring rows; 0 = one round)" 180 "$BIN/bench_layer" --iters 10 \
    --backward 0 --cases deepseek-v3-ep2,qwen3-30b-a3b-ep2 --ring-rows 32768,8192 \
    --out "$OUT/layer-ring.json"
else
  say "bench_layer sweep and ring rounds (EP 2 cases): skipped ($gpus GPU)"
fi
fi  # quick
# The torch-native baseline on bench_layer's routing: every variant checked, then fwd, the
# forward under autograd and the training step timed (20 iterations after 500 ms of warm-up
# each), peak memory, clock and power; the dense GEMM rate in the EP 1 process.
step "torch-native, EP 1 (variants, forward and training step, dense GEMM)" 300 \
  python3 bench/baselines/torch_native.py measure --mok "$OUT/layer-mok.json" --ep 1 \
  --out "$OUT/layer-torch-ep1.json"
torch_results=(--torch "$OUT/layer-torch-ep1.json")
if ((gpus >= 2)); then
  step "torch-native, EP 2 (torchrun)" 300 torchrun --standalone --nproc-per-node=2 \
    bench/baselines/torch_native.py measure --mok "$OUT/layer-mok.json" --ep 2 \
    --out "$OUT/layer-torch-ep2.json"
  torch_results+=(--torch "$OUT/layer-torch-ep2.json")
else
  say "torch-native at EP 2: skipped ($gpus GPU)"
fi
# FP8: bench_layer times mok's FP8 forward and training step (recompute mode) and its bf16 ones
# (save mode) in the same process; the torch-native rowwise FP8 variants are checked, then their
# forward timed, on its routing.
fp8_results=()
rm -f "$OUT/layer-mok-fp8.json" "$OUT/layer-torch-fp8-ep1.json"  # no stale figures from a past run
bench_layer_help=$("$BIN/bench_layer" --help 2>&1)
fp8_cases=("${cases[@]}")
if [ -n "${MOK_FP8_CASES:-}" ]; then
  fp8_cases=(--cases "$MOK_FP8_CASES")
elif [ -z "${MOK_LAYER_CASES:-}" ] && ((${gpu_memory_mib:-0} < 100000)); then
  # deepseek-v3's bf16 and fp8 weights together need more than an H100's 80 GB.
  fp8_cases=(--cases "qwen3-30b-a3b-ep1,qwen3-235b-a22b-ep1,mixtral-8x7b-ep1")
  say "FP8: deepseek-v3 left out (${gpu_memory_mib:-no} MiB of GPU memory)"
fi
if [ "${MOK_LAYER_FP8:-1}" = 0 ]; then
  say "FP8: skipped (MOK_LAYER_FP8=0)"
elif [[ $bench_layer_help == *--precision* ]]; then
  mkdir -p "$routing_dir/fp8"
  step "bench_layer (mok, FP8 forward and training step; its bf16 ones beside them)" 400 \
    "$BIN/bench_layer" --iters 20 --backward 1 --precision fp8 --out "$OUT/layer-mok-fp8.json" \
    --routing-dir "$routing_dir/fp8" "${fp8_cases[@]}"
  if [ -f "$OUT/layer-mok-fp8.json" ]; then
    step "torch-native FP8, EP 1 (rowwise torch._scaled_grouped_mm; forward, dense FP8 GEMM)" 300 \
      python3 bench/baselines/torch_native.py measure --mok "$OUT/layer-mok-fp8.json" --ep 1 \
      --precision fp8 --out "$OUT/layer-torch-fp8-ep1.json"
    fp8_results=(--mok-fp8 "$OUT/layer-mok-fp8.json" --torch-fp8 "$OUT/layer-torch-fp8-ep1.json")
  fi
else
  say "FP8: skipped (this bench_layer has no --precision)"
fi
# mxfp8 (a numerics mode on the bf16 engine: its cost beside bf16) on the shapes whose two
# round-tripped weight copies fit one GPU beside the bf16 weights.
rm -f "$OUT/layer-mok-mxfp8.json"
if [[ $bench_layer_help == *mxfp8* && $quick != 1 ]]; then
  step "bench_layer (mok, mxfp8 forward and training step; its bf16 ones beside them)" 240 \
    "$BIN/bench_layer" --iters 10 --backward 1 --precision mxfp8 \
    --cases "${MOK_MXFP8_CASES:-qwen3-30b-a3b-ep1,mixtral-8x7b-ep1}" --out "$OUT/layer-mok-mxfp8.json"
fi
step "results (mok-bench/2)" 60 python3 bench/baselines/layer_results.py --mok "$OUT/layer-mok.json" \
  "${torch_results[@]}" "${fp8_results[@]}" --commit "$COMMIT" --out "$OUT/layer.json"
step "chart and table" 60 python3 bench/report.py --results-dir "$OUT" --kinds layer
rm -rf "$routing_dir"
exit $status
