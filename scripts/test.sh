#!/usr/bin/env bash
# Builds everything and runs every test: the C++ suites, the command line, the GPU suites (which
# skip, each with its reason, without a GPU) and, where python3 imports torch, the PyTorch front
# end's pytest suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${MOK_BUILD_DIR:-$root/build}
have_torch=0
python3 -c "import torch, pytest" 2>/dev/null && have_torch=1
if ((have_torch)); then
  export MOK_CMAKE_ARGS="${MOK_CMAKE_ARGS:-} -DMOK_BUILD_TORCH=ON"
else
  export MOK_CMAKE_ARGS="${MOK_CMAKE_ARGS:-} -DMOK_BUILD_TORCH=OFF"
fi
"$root/scripts/build.sh"
(cd "$build_dir" && ctest --output-on-failure -j "$(nproc)")
if ((have_torch)); then
  MOK_TORCH_LIBRARY="$build_dir/_mok_torch.so" PYTHONPATH="$root/python" python3 -m pytest -q "$root/python/tests"
else
  echo "python tests: skipped (python3 here does not import torch and pytest)"
fi
