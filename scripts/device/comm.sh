#!/usr/bin/env bash
# The communication part of the device check, on a machine with 2 NVLink-connected GPUs:
# the comm GPU tests, then bench_comm (deepseek-v3, EP 2, 8192 tokens/rank) for both copy methods
# next to torch.distributed.all_to_all_single, then the mok-bench/1 JSON and its chart.
#
#   scripts/device/comm.sh [BIN_DIR]     BIN_DIR holds mok_gpu_tests and bench_comm (built with
#                                        the same NCCL major version); default build-comm-bin
# Writes under $OUT (or ./comm-out), under stable names (the commit is inside the JSON): comm.json
# (mok-bench/1), comm.png, comm.log, and bench_comm's and torch's own figures comm-mok-vector.json,
# comm-splits.json, comm-torch.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
BIN=${1:-build-comm-bin}
OUT=${OUT:-comm-out}
mkdir -p "$OUT"
LOG="$OUT/comm.log"
NCCL_DIR=$(python3 -c "import nvidia.nccl as n; print(list(n.__path__)[0])" 2>/dev/null)
[ -n "$NCCL_DIR" ] && export LD_LIBRARY_PATH="$NCCL_DIR/lib:${LD_LIBRARY_PATH:-}"
export MOK_COMMIT=${MOK_COMMIT:-$(cat "$BIN/COMMIT" 2>/dev/null || git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}
status=0
{
  echo "== $(date -u +%FT%TZ) commit $MOK_COMMIT, NCCL from ${NCCL_DIR:-system}"
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader
  nvidia-smi topo -m | head -4
} 2>&1 | tee "$LOG"

run() {  # run NAME TIMEOUT COMMAND...: logs, records failure, never stops the script
  local name=$1 limit=$2; shift 2
  echo "== $name: $*" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || status=1
}

# Binaries built elsewhere may not run here (other system libraries): build here then.
if ! "$BIN/mok_gpu_tests" --gtest_list_tests >/dev/null 2>&1 || ! [ -x "$BIN/bench_comm" ]; then
  echo "== carried binaries do not run here; building" | tee -a "$LOG"
  { cmake -S . -B build-device -G Ninja -DMOK_NCCL_ROOT="$NCCL_DIR" >/dev/null &&
    ninja -C build-device mok_gpu_tests bench_comm; } 2>&1 | tail -20 | tee -a "$LOG"
  BIN=build-device
fi

if [ "${MOK_PART_TESTS:-1}" = 1 ]; then  # device-check runs every GPU test itself and sets 0
  run tests 150 "$BIN/mok_gpu_tests" --gtest_filter='*Comm*'
fi
run bench-vector 120 "$BIN/bench_comm" --methods vector:1024,vector:512 \
  --sms 4,8,12,16,20,24,28,32,132 --out "$OUT/comm-mok-vector.json" --splits "$OUT/comm-splits.json"
run torch-baseline 120 torchrun --nproc-per-node=2 bench/baselines/torch_all_to_all.py measure \
  --splits "$OUT/comm-splits.json" --out "$OUT/comm-torch.json"
mok_jsons=()
for json in "$OUT"/comm-mok-*.json; do
  if [ -f "$json" ]; then mok_jsons+=("$json"); fi
done
if [ ${#mok_jsons[@]} -gt 0 ] && [ -f "$OUT/comm-torch.json" ]; then
  run report 60 python3 bench/baselines/torch_all_to_all.py report --mok "${mok_jsons[@]}" \
    --torch "$OUT/comm-torch.json" --json "$OUT/comm.json" --png "$OUT/comm.png"
fi
echo "== comm.sh: $([ $status -eq 0 ] && echo all passed || echo FAILURES above)" | tee -a "$LOG"
exit $status
