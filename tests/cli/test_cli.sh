#!/usr/bin/env bash
# The mok command line as a user meets it: exit codes, one-line errors, the PASS line, JSON.
# usage: test_cli.sh PATH/TO/mok
set -u
mok="$1"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$(dirname "${BASH_SOURCE[0]}")/expect.sh"

expect 0 '^PASS$' -- "$mok" run
expect 0 'EP 2 vs EP 1: .* bitwise equal' -- "$mok" run --backend cpu --ep 2 --tokens 64 --routing single-expert
expect 0 'done \(not checked\)' -- "$mok" run --tokens 32 --routing skewed:1.5 --no-check --threads 1
expect 0 'deepseek-v3 +7168 +2048 +2048 +256 +8' -- "$mok" presets
expect 0 'usage: mok run' -- "$mok" run --help
expect 0 'commands:' -- "$mok" --help
expect 2 'usage: mok' -- "$mok"
expect 2 '^mok run: error: --bogus: unknown option' -- "$mok" run --bogus
expect 2 'ep: E = 16 experts do not divide over 3 ranks' -- "$mok" run --ep 3
expect 2 "routing: unknown routing 'zipf'" -- "$mok" run --routing zipf
expect 2 "--tokens: expected an integer, got '12x'" -- "$mok" run --tokens 12x
expect 2 '--tokens: must be in \[1, ' -- "$mok" run --tokens 0
expect 2 'precision: fp8 is not implemented in this version' -- "$mok" run --precision fp8
# The CUDA backend runs where Hopper GPUs are, and says why not elsewhere.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c 'GPU [0-9]')
if ((gpus >= 1)); then
  expect 0 'bwd +not run' -- "$mok" run --backend cuda --tokens 200
  expect 0 '^PASS$' -- "$mok" run --backend cuda --tokens 200 --routing skewed:1.5
else
  expect 2 'backend: cuda cannot run here: (EP 1 needs 1 Hopper GPU|this build has no CUDA backend)' -- "$mok" run --backend cuda
fi
if ((gpus >= 2)); then
  expect 0 'EP 2 vs EP 1 on the GPU: .* bitwise equal' -- "$mok" run --backend cuda --ep 2 --tokens 300
fi
expect 2 "unknown preset 'nope'" -- "$mok" run --preset nope
expect 2 "unknown command 'fly'" -- "$mok" fly

# Same seed, same bits; the JSON record follows the benchmark schema.
first=$("$mok" run --tokens 64 --seed 5 --no-check | grep checksum)
second=$("$mok" run --tokens 64 --seed 5 --no-check --threads 1 | grep checksum)
other=$("$mok" run --tokens 64 --seed 6 --no-check | grep checksum)
if [[ "$first" == "$second" && "$first" != "$other" ]]; then
  echo "ok:   checksum repeats for a seed and changes with it"; passes=$((passes + 1))
else
  echo "FAIL: checksums '$first' '$second' '$other'"; failures=$((failures + 1))
fi
expect 0 '^PASS$' -- "$mok" run --backend cpu --tokens 32 --json "$work/run.json"
if grep -q '"schema": "mok-bench/1"' "$work/run.json" && grep -q '"phase": "fwdbwd"' "$work/run.json"; then
  echo "ok:   --json writes a mok-bench/1 record"; passes=$((passes + 1))
else
  echo "FAIL: --json record:"; cat "$work/run.json"; failures=$((failures + 1))
fi

echo "cli: $passes passed, $failures failed"
[[ $failures -eq 0 ]]
