#!/usr/bin/env bash
# The PyTorch front end on the GPU machine: `pip install .` the way a user would (no network
# there, so without build isolation), then the pytest suite and the training example.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
results=${MOK_RESULTS_DIR:-/tmp}
target=$(mktemp -d)
python3 -m pip install --no-build-isolation --no-deps --no-index --target "$target" "$root" \
  >"$results/pip-install.log" 2>&1 || { tail -n 40 "$results/pip-install.log"; exit 1; }
echo "pip install: ok ($(ls "$target"/mok/_mok_torch*.so))"
cd "$root"
PYTHONPATH="$target" python3 -m pytest -q python/tests 2>&1 | tee "$results/pytest.log"
PYTHONPATH="$target" python3 examples/train_moe_block.py --steps 200 2>&1 | tee "$results/example.log"
