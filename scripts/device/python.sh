#!/usr/bin/env bash
# The PyTorch front end on the GPU machine: `pip install .` the way a user would (no network
# there, so without build isolation), then the pytest suites (the CPU one, and the CUDA one under
# torchrun on 2 GPUs) and the training example (CPU; CUDA at EP 1, in bf16 and fp8, and, under
# torchrun, EP 2). The transformers benchmark is a part of its own (transformers.sh).
#
#   scripts/device/python.sh prebuild   HERE (no GPU, no torch needed): builds the core and the
#                                       torch bridge, position-independent, into
#                                       $MOK_TORCH_PREBUILT_DIR (default build-torch-prebuilt/) from
#                                       the committed core (git HEAD) and the working tree's
#                                       src/torch + CMakeLists.txt; its lib*.a travel (carry, or
#                                       MOK_PACK_TORCH=1 scripts/build-for-device.sh, which puts
#                                       them in build-pack/torch/).
#   scripts/device/python.sh install    THERE: installs the package into $MOK_PYTHON_TARGET
#                                       (default a new temporary folder) unless it holds one
#                                       already (device-check.sh sets one folder for all its
#                                       parts), and prints the folder on its last line. The
#                                       prebuilt libraries are taken from $MOK_TORCH_PREBUILT_DIR,
#                                       else build-pack/torch/, else build-torch-prebuilt/, where
#                                       they exist (only src/torch/*.cpp compile there); else the
#                                       whole core is compiled (about 30 s on 32 cores).
#   scripts/device/python.sh            THERE: installs (as above), runs everything, logs
#                                       to $MOK_RESULTS_DIR (default /tmp): python-pip-install.log,
#                                       python-pytest-cpu.log, python-pytest-cuda.log,
#                                       python-pytest-cuda-backward.log,
#                                       python-pytest-integrations.log (transformers, quantizers),
#                                       python-example-cuda.log (EP 1, then EP 2),
#                                       python-example-cuda-fp8.log (EP 1, fp8 beside bf16),
#                                       python-example-cuda-mxfp8.log (the same in mxfp8), and
#                                       python-example-cpu.log where there is no GPU.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
prebuilt=${MOK_TORCH_PREBUILT_DIR:-$root/build-torch-prebuilt}

if [[ ${1:-} == prebuild ]]; then
  source_dir=$(mktemp -d)
  git -C "$root" archive HEAD include src tools CMakeLists.txt | tar -x -C "$source_dir"
  rm -rf "$source_dir/src/torch"
  cp -r "$root/src/torch" "$source_dir/src/torch"
  cp "$root/CMakeLists.txt" "$source_dir/CMakeLists.txt"
  "$root/scripts/bootstrap.sh"
  # The sources sit in a fresh temporary folder each time: a cache made from another one is stale.
  rm -rf "$prebuilt"
  cmake -S "$source_dir" -B "$prebuilt" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_BUILD_TESTS=OFF \
    -DCMAKE_POSITION_INDEPENDENT_CODE=ON >/dev/null
  cmake --build "$prebuilt" -j "$(nproc)" --target mok_torch_bridge
  echo "prebuilt core for the torch extension: $prebuilt (core at $(git -C "$root" rev-parse --short=12 HEAD))"
  ls -l "$prebuilt"/lib*.a
  exit 0
fi

results=${MOK_RESULTS_DIR:-/tmp}
if [[ ${1:-} == install ]]; then
  target=${MOK_PYTHON_TARGET:-$(mktemp -d)}
  if compgen -G "$target/mok/_mok_torch*.so" >/dev/null; then
    echo "pip install: the package in $target is installed already" >&2
  else
    if [[ -z ${MOK_TORCH_PREBUILT_DIR:-} && -f $root/build-pack/torch/libmok_torch_bridge.a ]]; then
      prebuilt=$root/build-pack/torch
    fi
    define=()
    if [[ -f $prebuilt/libmok_torch_bridge.a ]]; then
      define=(-C "cmake.define.MOK_TORCH_PREBUILT_DIR=$prebuilt")
    fi
    mkdir -p "$target"
    start=$SECONDS
    python3 -m pip install --no-build-isolation --no-deps --no-index --target "$target" "${define[@]}" \
      "$root" >"$results/python-pip-install.log" 2>&1 ||
      { tail -n 60 "$results/python-pip-install.log" >&2; exit 1; }
    echo "pip install: ok in $((SECONDS - start)) s ($(ls "$target"/mok/_mok_torch*.so)${define:+, prebuilt core})" >&2
  fi
  echo "$target"
  exit 0
fi
target=$("$root/scripts/device/python.sh" install | tail -n 1)
[[ -n $target ]] || exit 1
cd "$root"
export PYTHONPATH="$target" PYTHONUNBUFFERED=1
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

# The CPU suite and the 2-GPU suite at once (the CPU one uses one GPU for one test only).
timeout 170 python3 -m pytest -q python/tests/test_torch_cpu.py >"$results/python-pytest-cpu.log" 2>&1 &
cpu_suite=$!
cuda_status=0
if ((gpus >= 2)); then
  timeout 170 torchrun --nproc-per-node=2 -m pytest -q -p no:cacheprovider python/tests/test_torch_cuda.py \
    >"$results/python-pytest-cuda.log" 2>&1 || cuda_status=$?
else
  python3 -m pytest -q python/tests/test_torch_cuda.py >"$results/python-pytest-cuda.log" 2>&1 || cuda_status=$?
fi
cpu_status=0
wait $cpu_suite || cpu_status=$?
# The GPU backward through torch on one GPU (EP = 1): gradients against an fp64 oracle next to
# bf16 autograd's, bitwise repeats, a graph of a training step, no host sync.
# And fp8 through torch (forward and training step) against the CPU backend's fp8 mode.
backward_status=0
timeout 170 python3 -m pytest -q python/tests/test_torch_cuda_backward.py python/tests/test_torch_cuda_fp8.py \
  >"$results/python-pytest-cuda-backward.log" 2>&1 || backward_status=$?
# The Hugging Face transformers integration (CPU and CUDA variants) and the FP8 quantizer ops.
integrations_status=0
timeout 240 python3 -m pytest -q -rs python/tests/test_transformers_experts.py \
  python/tests/test_quantize_ops.py >"$results/python-pytest-integrations.log" 2>&1 ||
  integrations_status=$?
echo "== pytest CPU suite (exit $cpu_status)"; tail -n 25 "$results/python-pytest-cpu.log"
echo "== pytest transformers integration and quantizer ops (exit $integrations_status)"
tail -n 25 "$results/python-pytest-integrations.log"
echo "== pytest GPU backward suite, one GPU (exit $backward_status)"
tail -n 25 "$results/python-pytest-cuda-backward.log"
echo "== pytest CUDA suite, torchrun 2 ranks (exit $cuda_status)"; tail -n 40 "$results/python-pytest-cuda.log"

steps=${MOK_EXAMPLE_STEPS:-300}
example_status=0
if ((gpus >= 1)); then
  echo "== example, cuda, EP 1"
  timeout 70 python3 examples/train_moe_block.py --device cuda --steps "$steps" 2>&1 \
    | tee "$results/python-example-cuda.log" || example_status=1
fi
if ((gpus >= 1)); then
  echo "== example, cuda, EP 1, fp8 (beside mok bf16 and torch-native, from the same start)"
  timeout 120 python3 examples/train_moe_block.py --device cuda --precision fp8 --steps "$steps" 2>&1 \
    | tee "$results/python-example-cuda-fp8.log" || example_status=1
  echo "== example, cuda, EP 1, mxfp8 (beside mok bf16 and torch-native, from the same start)"
  timeout 120 python3 examples/train_moe_block.py --device cuda --precision mxfp8 --steps "$steps" \
    2>&1 | tee "$results/python-example-cuda-mxfp8.log" || example_status=1
fi
if ((gpus >= 2)); then
  echo "== example, cuda, EP 2 (torchrun)"
  timeout 80 torchrun --nproc-per-node=2 examples/train_moe_block.py --device cuda --steps "$steps" 2>&1 \
    | tee -a "$results/python-example-cuda.log" || example_status=1
fi
if ((gpus == 0)); then
  python3 examples/train_moe_block.py --steps 200 2>&1 | tee "$results/python-example-cpu.log" || example_status=1
fi
exit $((cpu_status || cuda_status || backward_status || example_status || integrations_status))
