#!/usr/bin/env bash
# Transformers part of the device check (issue 26's benchmark): the training step of models
# shaped like Qwen3-30B-A3B and DeepSeek-V3's MoE layers, experts_implementation="mok" against
# "grouped_mm" on the same model and batch (bench/baselines/transformers_train.py), with the
# package installed by `scripts/device/python.sh install` (prebuilt libraries when they travelled).
# One process a model, each under its own time limit, so that a model that runs out of time or
# memory keeps the others' figures; their cases are gathered into one JSON (--append).
#
#   OUT=/tmp/out scripts/device/transformers.sh [BIN_DIR]    (BIN_DIR: unused, for device-check)
# MOK_TRANSFORMERS_MODELS: comma-separated models (default qwen3-30b-a3b, and deepseek-v3 where
# the GPU has 100 GB or more: at 16384 tokens it does not fit an H100's 80 GB);
# MOK_TRANSFORMERS_ARGS: more arguments for every model (e.g. "--steps 8 --warmup-ms 2000");
# MOK_TRANSFORMERS_TIMEOUT: seconds a model may take (default 300).
# Results: transformers-train.json (mok-bench/2, a case a model), transformers-train.log.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${MOK_RESULTS_DIR:-${OUT:?set OUT to the results folder}}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MOK_RESULTS_DIR="$OUT"
log="$OUT/transformers-train.log"
json="$OUT/transformers-train.json"
: >"$log"
rm -f "$json"  # no stale figures from a past run

memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
models=${MOK_TRANSFORMERS_MODELS:-}
if [[ -z $models ]]; then
  models=qwen3-30b-a3b
  if ((${memory_mib:-0} >= 100000)); then
    models+=,deepseek-v3
  else
    echo "== deepseek-v3: skipped (${memory_mib:-no} MiB of GPU memory; it needs an H200)" | tee -a "$log"
  fi
fi

target=$("$root/scripts/device/python.sh" install | tail -n 1)
[[ -n $target ]] || exit 1
export PYTHONPATH="$target"
read -r -a extra <<<"${MOK_TRANSFORMERS_ARGS:-}"
status=0
cd "$root/bench/baselines" || exit 1
for model in ${models//,/ }; do
  echo "== transformers training step: $model" | tee -a "$log"
  timeout "${MOK_TRANSFORMERS_TIMEOUT:-300}" python3 transformers_train.py --models "$model" \
    "${extra[@]}" --append --out "$json" 2>&1 | tee -a "$log"
  code=${PIPESTATUS[0]}
  ((code == 0)) || { echo "== $model: exit $code" | tee -a "$log"; status=1; }
done
exit $status
