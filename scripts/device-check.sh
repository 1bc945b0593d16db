#!/usr/bin/env bash
# The one script for a GPU machine: builds mok there, runs every test (GPU tests included), runs
# the benchmarks and collects logs and results under $OUT.
#
#   scripts/device-check.sh [PART...]     PART: tests, run, or a scripts/device/PART.sh (gemm, comm,
#                                         layer, python, transformers, ...)
# MOK_BUILD_DIR names the build folder (default build-device); with MOK_PREBUILT=1 the binaries in
# it (built elsewhere, e.g. carried in, or packed by scripts/build-for-device.sh) are used as they
# are.
#
# With no PART it runs all of them. Each part's files land in $OUT/results/ (packed into
# $OUT/device-results.tar.gz at the end, since only a few files come back); the whole log is
# $OUT/device-check.log. A part that fails is reported and the others still run; the exit code
# says whether all passed.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-$root/device-out}
results="$out/results"
mkdir -p "$results"
exec > >(tee -a "$out/device-check.log") 2>&1

# NVLink multicast stays off (it can take a shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1

export MOK_BUILD_DIR=${MOK_BUILD_DIR:-$root/build-device}
# Binaries packed by scripts/build-for-device.sh travel as build-pack/build-cuda.tar.xz.
pack="$root/build-pack/build-cuda.tar.xz"
if [[ "${MOK_PREBUILT:-0}" == 1 && ! -f "$MOK_BUILD_DIR/COMMIT" && -f "$pack" ]]; then
  mkdir -p "$MOK_BUILD_DIR" && xz -dc "$pack" | tar -x -C "$MOK_BUILD_DIR" || exit 1
  echo "== unpacked $pack into $MOK_BUILD_DIR"
fi
# The commit: from the COMMIT file that scripts/build-for-device.sh leaves beside carried
# binaries (a checkout there may hold some other history), else from git.
if [[ "${MOK_PREBUILT:-0}" == 1 && -f "$MOK_BUILD_DIR/COMMIT" ]]; then
  MOK_COMMIT=$(cat "$MOK_BUILD_DIR/COMMIT")
else
  MOK_COMMIT=$(git -C "$root" rev-parse --verify -q --short=12 HEAD 2>/dev/null || echo unknown)
fi
export MOK_COMMIT
echo "== mok device check, $(date -u +%FT%TZ), commit $MOK_COMMIT"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true

# NCCL: the one torch bundles, so that one NCCL lives in every process.
nccl_root=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null || true)
if [[ -n "$nccl_root" ]]; then
  export LD_LIBRARY_PATH="$nccl_root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "NCCL from torch: $nccl_root"
fi

export MOK_RESULTS_DIR="$results"
# One install of the Python package for every part that needs it (scripts/device/python.sh install).
MOK_PYTHON_TARGET=${MOK_PYTHON_TARGET:-$(mktemp -d)}
export MOK_PYTHON_TARGET
start=$(date +%s)
if [[ "${MOK_PREBUILT:-0}" == 1 ]]; then
  echo "== using the binaries in $MOK_BUILD_DIR as they are"
else
  cmake -S "$root" -B "$MOK_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)" \
    ${nccl_root:+-DMOK_NCCL_ROOT=$nccl_root} >"$results/cmake.log" 2>&1 || { cat "$results/cmake.log"; exit 1; }
  if ! cmake --build "$MOK_BUILD_DIR" -j "$(nproc)" >"$results/build.log" 2>&1; then
    tail -n 60 "$results/build.log"
    exit 1
  fi
  echo "== built in $(( $(date +%s) - start )) s"
fi
export MOK_PART_TESTS=0 MOK_GEMM_NCU=${MOK_GEMM_NCU:-0}

parts=("$@")
if ((${#parts[@]} == 0)); then
  parts=(tests run)
  for script in "$root"/scripts/device/*.sh; do
    [[ -e "$script" ]] && parts+=("$(basename "$script" .sh)")
  done
fi

failed=()
for part in "${parts[@]}"; do
  echo "== part: $part"
  part_start=$(date +%s)
  case "$part" in
    tests)
      # CPU suites in parallel, then the GPU suites in one process (the comm tests hold both GPUs),
      # the GPU suites whatever the CPU ones gave, so that one failure does not hide the other.
      # (The source checks lint and format need the package registries, which the GPU machine
      # does not reach; they run with the test command, in CI.)
      (cd "$MOK_BUILD_DIR" && ctest -LE gpu -E '^(lint|format)$' --output-on-failure -j 8 2>&1 |
        tee "$results/ctest.log")
      cpu_status=$?
      # (the binary sets these two itself; named here too, as the emulated EP tests need them)
      CUDA_MODULE_LOADING=EAGER CUDA_DEVICE_MAX_CONNECTIONS=32 "$MOK_BUILD_DIR/mok_gpu_tests" 2>&1 |
        tee "$results/gpu-tests.log"
      gpu_status=$?
      echo "== tests: CPU suites exit $cpu_status, GPU suites exit $gpu_status"
      ((cpu_status == 0 && gpu_status == 0)) ;;
    run)
      "$MOK_BUILD_DIR/mok" run --ep 2 --json "$results/mok-run-cpu.json" ;;
    *)
      OUT="$results" bash "$root/scripts/device/$part.sh" "$MOK_BUILD_DIR" ;;
  esac
  status=$?
  echo "== part $part: exit $status in $(( $(date +%s) - part_start )) s"
  ((status == 0)) || failed+=("$part")
done

tar -czf "$out/device-results.tar.gz" -C "$out" results && rm -rf "$results"
if ((${#failed[@]})); then
  echo "== FAILED parts: ${failed[*]}"
  exit 1
fi
echo "== all parts passed"
