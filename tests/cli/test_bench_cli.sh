#!/usr/bin/env bash
# The benchmark programs' command lines, on any machine (no GPU needed): --help, and one-line
# errors with exit status 2 for a wrong command line, before anything is measured.
# usage: test_bench_cli.sh BUILD_DIR
set -u
bin=$(cd "$1" && pwd) || exit 1
# shellcheck source-path=SCRIPTDIR source=expect.sh
source "$(dirname "${BASH_SOURCE[0]}")/expect.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work" || exit 1

for program in bench_gemm bench_gemm_fp8 bench_layer bench_comm bench_soak; do
  expect 0 "^usage: $program " -- "$bin/$program" --help
  expect 0 "^usage: $program " -- "$bin/$program" -h
  expect 2 "^$program: error: --bogus: unknown option \(see --help\)$" -- "$bin/$program" --bogus 1
  expect 2 "^$program: error: --out: needs a value" -- "$bin/$program" --out
  expect 2 "^$program: error: expected --name value, got 'stray'" -- "$bin/$program" stray
done
expect 2 "--iterations: expected an integer, got '2x'" -- "$bin/bench_gemm" --iterations 2x
expect 2 "--iterations: must be >= 1" -- "$bin/bench_gemm" --iterations 0
expect 2 "--engine: expected cooperative or pingpong, got 'fast'" -- "$bin/bench_gemm" --engine fast
expect 2 "--only: no case is called 'deepseek-v3/gemm-up'" -- "$bin/bench_gemm" --only deepseek-v3/gemm-up
expect 2 "--only: does not go with --swiglu-cost" -- "$bin/bench_gemm" --swiglu-cost cost.json --only deepseek-v3/gemm-gateup
expect 2 "--cases: no case is called 'deepseek-v3-ep4'" -- "$bin/bench_layer" --cases deepseek-v3-ep1,deepseek-v3-ep4
expect 2 "--comm-ctas: expected an integer, got 'x'" -- "$bin/bench_layer" --comm-ctas 8,x
expect 2 "--iters: must be >= 1" -- "$bin/bench_layer" --iters 0
expect 2 "--sms: expected an integer, got ''" -- "$bin/bench_comm" --sms 4,,8
expect 2 "--tokens: must be >= 1" -- "$bin/bench_comm" --tokens 0
expect 2 "--methods: expected an integer, got 'x'" -- "$bin/bench_comm" --methods vector:x
expect 2 "--methods: vector:THREADS needs a multiple of 32 in .32, 1024., got 48" -- \
  "$bin/bench_comm" --methods vector:1024,vector:48
expect 2 "--methods: unknown method 'tma'" -- "$bin/bench_comm" --methods tma
expect 2 "--l2-tickets: expected an integer, got 'on'" -- "$bin/bench_layer" --l2-tickets on
expect 2 "--ep: must be 1, 2, 4 or 8" -- "$bin/bench_gemm_fp8" --ep 3
expect 2 "--jitter: must be >= 0 and below 256" -- "$bin/bench_gemm_fp8" --ep 1 --jitter 256
# Nothing was written by any of these.
expect 0 '^$' -- find . -type f

echo "bench command lines: $passes passed, $failures failed"
((failures == 0))
