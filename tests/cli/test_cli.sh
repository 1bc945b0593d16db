#!/usr/bin/env bash
# The mok command line as a user meets it: exit codes, one-line errors that name the option, the
# PASS line, shapes from flags, the memory pre-check, JSON to a file or standard output, and the
# progress line on a terminal.
# usage: test_cli.sh PATH/TO/mok
set -u
shopt -s extglob
mok="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# shellcheck source-path=SCRIPTDIR source=expect.sh
source "$(dirname "${BASH_SOURCE[0]}")/expect.sh"

# A literal text as an extended regular expression.
literal() { sed 's/[][\.*^$+?(){}|/]/\\&/g' <<<"$1"; }

# MemAvailable in GiB (0 when unknown): some refusals can only be tested where memory is short.
available_gib=$(awk '/^MemAvailable:/ {print int($2 / 1048576)}' /proc/meminfo 2>/dev/null)
available_gib=${available_gib:-0}

# --- runs -------------------------------------------------------------------------------------
expect 0 '^PASS$' -- "$mok" run
expect 0 'EP 2 vs EP 1: .* bitwise equal' -- "$mok" run --backend cpu --ep 2 --tokens 64 --routing single-expert
expect 0 'done \(not checked\)' -- "$mok" run --tokens 32 --routing skewed:1.5 --no-check --threads 1
expect 0 '^backend: cpu \(reference, 1 thread\);' -- "$mok" run --backend cpu --tokens 8 --no-check --threads 1
expect 0 '^backend: cpu \(reference, 2 threads\);' -- "$mok" run --backend cpu --tokens 8 --no-check --threads 2
expect 0 '^PASS$' -- "$mok" run --backend cpu --tokens 16 --seed 0 --threads 0 --check
expect 0 'deepseek-v3 +7168 +2048 +2048 +256 +8' -- "$mok" presets

# --- help for every command, even beside a mistake ---------------------------------------------
for command in run presets; do
  expect 0 "^usage: mok $command" -- "$mok" "$command" --help
  expect 0 "^usage: mok $command" -- "$mok" "$command" -h
  expect 0 "^usage: mok $command" -- "$mok" "$command" --bogus --help
done
expect 0 'commands:' -- "$mok" --help
expect 2 'usage: mok' -- "$mok"
expect_error "^mok: unknown command 'fly'" -- "$mok" fly

# --- one strict parser: exit 2, one line, starting with the option as typed ---------------------
expect_error '^mok run: error: --bogus: unknown option \(see --help\)$' -- "$mok" run --bogus
expect_error '^mok presets: error: --bogus: unknown option \(see --help\)$' -- "$mok" presets --bogus
expect_error '^mok run: error: stray: unexpected argument' -- "$mok" run stray
expect_error '^mok run: error: --ep: given twice$' -- "$mok" run --ep 2 --ep 4
expect_error '^mok run: error: --ep: given twice$' -- "$mok" run --ep=2 --ep 2
expect_error '^mok run: error: --check: given twice$' -- "$mok" run --check --check
expect_error '^mok run: error: --no-check: does not go with --check$' -- "$mok" run --check --no-check
expect_error '^mok run: error: --no-check: does not go with --check$' -- "$mok" run --no-check --check
expect_error "^mok run: error: --check: takes no value, got '1'$" -- "$mok" run --check=1
expect_error '^mok run: error: --tokens: needs a value$' -- "$mok" run --tokens
expect_error "^mok run: error: --json: needs a value, got the option '--no-check'" -- "$mok" run --json --no-check
for number in +64 064 00 0x1p3 0x10 1e3 '' ' 64' 64.0 -1 12x; do
  expect_error "^mok run: error: --tokens: expected an integer \(decimal digits, no sign or leading zero\), got '$(literal "$number")'$" -- \
    "$mok" run --tokens "$number"
done
expect_error "^mok run: error: --ep: expected an integer .*, got '\+2'$" -- "$mok" run --ep=+2
expect_error '^mok run: error: --tokens: must be in \[1, 16777216\], got 0$' -- "$mok" run --tokens 0
expect_error '^mok run: error: --seed: must be in \[0, 9223372036854775807\], got 99999999999999999999$' -- \
  "$mok" run --seed 99999999999999999999
expect_error '^mok run: error: --ep: E = 16 experts do not divide over 3 ranks$' -- "$mok" run --ep 3
expect_error "^mok run: error: --routing: unknown routing 'zipf'" -- "$mok" run --routing zipf
expect_error "^mok run: error: --routing: skewed:ALPHA needs ALPHA in \[0, 10\], got 'x'$" -- "$mok" run --routing skewed:x
expect_error "^mok run: error: --precision: unknown precision 'fp4' \\(bf16, fp8, mxfp8\\)$" -- "$mok" run --precision fp4
expect_error "^mok run: error: --preset: unknown preset 'nope'" -- "$mok" run --preset nope
expect_error "^mok run: error: --backend: unknown backend 'tpu'" -- "$mok" run --backend tpu
# The low-memory backward is the GPU backward's mode, in bf16 at EP 1.
expect_error "^mok run: error: --low-memory-backward: the GPU backward's mode, and this run is on the cpu backend \\(asked for\\)$" \
  -- "$mok" run --backend cpu --low-memory-backward
expect_error "^mok run: error: --low-memory-backward: the low-memory backward runs in bf16 at EP 1; this run is fp8 at EP 1$" \
  -- "$mok" run --precision fp8 --hidden 128 --intermediate 128 --shared-intermediate 128 --low-memory-backward
expect_error "^mok run: error: --low-memory-backward: the low-memory backward runs in bf16 at EP 1; this run is bf16 at EP 2$" \
  -- "$mok" run --ep 2 --low-memory-backward
expect 0 '^  --low-memory-backward$' -- "$mok" run --help
expect_error "^mok run: error: MOK_PROGRESS: expected auto, always or never, got 'x'$" -- env MOK_PROGRESS=x "$mok" run

# --- FP8 modes: the CPU reference, checked against the quantize-then-fp64 yardstick ------------
for precision in fp8 mxfp8; do
  expect 0 "^  grad_down +rel-L2 .* \\(yardstick .*\\)  ok$" -- "$mok" run --backend cpu --precision "$precision" --tokens 128
  expect 0 "EP 2 vs EP 1: .* bitwise equal" -- "$mok" run --backend cpu --precision "$precision" --ep 2 --tokens 96 --routing skewed:1.5
  expect 0 "^mok run: .*, EP 1, $precision, routing uniform" -- "$mok" run --backend cpu --precision "$precision" --tokens 8 --no-check
done
expect 0 '^  --precision P +bf16 \(default\), fp8 \(E4M3, DeepSeek-V3 blocks of 128' -- "$mok" run --help
expect 0 '^PASS$' -- "$mok" run --backend cpu --precision mxfp8 --hidden 96 --intermediate 32 --shared-intermediate 0 --tokens 40
# A few tokens: the bounds widen (mok/compare.hpp), and below 16 an FP8 run's errors are shown, not
# judged. Each of these failed the fixed bounds once (d_topk_w over three tokens' sums; an mxfp8
# weight gradient over five tokens).
expect 0 '^check against the fp64 oracle \(pass: every element written; the errors are shown, not judged' -- \
  "$mok" run --backend cpu --precision fp8 --hidden 128 --intermediate 128 --experts 2 --top-k 1 --tokens 4
expect 0 '^  y +rel-L2 .* \(yardstick .*\)  written$' -- \
  "$mok" run --backend cpu --precision fp8 --hidden 128 --intermediate 128 --experts 2 --top-k 1 --tokens 4
expect 0 '^PASS$' -- "$mok" run --backend cpu --precision bf16 --hidden 16 --intermediate 8 --shared-intermediate 8 \
  --experts 1 --top-k 1 --tokens 3 --seed 8 --check
expect 0 '^PASS$' -- "$mok" run --backend cpu --precision mxfp8 --hidden 64 --intermediate 96 --shared-intermediate 64 \
  --experts 4 --top-k 2 --tokens 5 --routing single-expert --seed 3 --check
expect 0 'pass: rel-L2 within 5 % \+ 40 % / sqrt\(tokens\) = 7\.5 % at 256 tokens' -- \
  "$mok" run --backend cpu --precision mxfp8 --hidden 64 --intermediate 64 --tokens 256
expect_error '^mok run: error: --hidden: fp8 needs a multiple of 128, got 96$' -- "$mok" run --precision fp8 --hidden 96
expect_error '^mok run: error: --intermediate: mxfp8 needs a multiple of 32, got 48$' -- "$mok" run --precision mxfp8 --intermediate 48
expect_error '^mok run: error: --shared-intermediate: fp8 needs a multiple of 128, got 64$' -- \
  "$mok" run --precision fp8 --shared-intermediate 64

# --- any shape: the preset gives defaults, flags override --------------------------------------
expect 0 'preset tiny with --hidden 64 --intermediate 40 --shared-intermediate 0 --experts 6 --top-k 3 \(H 64, I 40, E 6, top-3, I_s 0\)' -- \
  "$mok" run --backend cpu --hidden 64 --intermediate 40 --shared-intermediate 0 --experts 6 --top-k 3 --tokens 33 --no-check
expect 0 'EP 3 vs EP 1: .* bitwise equal' -- \
  "$mok" run --backend cpu --hidden 72 --intermediate 24 --shared-intermediate 16 --experts 6 --top-k 6 --ep 3 --tokens 17
expect 0 '^PASS$' -- "$mok" run --backend cpu --preset qwen3-30b-a3b --hidden 64 --intermediate 32 --experts 8 --tokens 9
expect_error '^mok run: error: --hidden: must be a multiple of 8 \(16-byte rows\), got 60$' -- "$mok" run --hidden 60
expect_error '^mok run: error: --intermediate: must be a multiple of 8, got 12$' -- "$mok" run --intermediate 12
expect_error '^mok run: error: --shared-intermediate: must be a multiple of 8, got 4$' -- "$mok" run --shared-intermediate 4
expect_error '^mok run: error: --top-k: k = 17 exceeds the number of experts E = 16$' -- "$mok" run --top-k 17
expect_error '^mok run: error: --top-k: k = 4 exceeds the number of experts E = 2$' -- "$mok" run --experts 2
expect_error '^mok run: error: --top-k: must be in \[1, 1048576\], got 0$' -- "$mok" run --top-k 0
expect_error '^mok run: error: --experts: must be in \[1, 1048576\], got 0$' -- "$mok" run --experts 0
expect_error '^mok run: error: --hidden: must be in \[1, 1048576\], got 2000000$' -- "$mok" run --hidden 2000000
expect_error '^mok run: error: --ep: E = 6 experts do not divide over 4 ranks$' -- "$mok" run --experts 6 --ep 4

# --- the CPU backend's memory: refused before the run, naming what to change -------------------
# Far more than any machine has: the refusal names --tokens and a count that fits.
expect_error '^mok run: error: --tokens: the CPU backend needs about .* at 16777216 tokens/rank, more than the .* usable \(90 % of the .* available\); --tokens [0-9]+ fits$' -- \
  "$mok" run --backend cpu --tokens 16777216 --top-k 16
# Even one token does not fit: the refusal names the shape flag.
expect_error '^mok run: error: --experts: the CPU backend needs about .* \(the preset.s default\).* even 1 token/rank does not fit' -- \
  "$mok" run --backend cpu --preset deepseek-v3 --experts 4096
if ((available_gib > 0 && available_gib < 30)); then  # as the issue met them
  expect_error '^mok run: error: --tokens: .* at 1048576 tokens/rank, .*; --tokens [0-9]+ fits' -- \
    "$mok" run --backend cpu --tokens 1048576
fi
if ((available_gib > 0 && available_gib < 140)); then
  expect_error '^mok run: error: --preset: .*even 1 token/rank does not fit' -- "$mok" run --backend cpu --preset deepseek-v3
fi
# The plan bounds what the run takes.
output=$("$mok" run --backend cpu --ep 2 --tokens 1024 2>&1)
to_mib() { awk -v value="$1" -v unit="$2" 'BEGIN {print (unit == "GiB") ? value * 1024 : value}'; }
if [[ $output =~ memory:\ peak\ ([0-9.]+)\ (MiB|GiB)\ \(planned\ at\ most\ ([0-9.]+)\ (MiB|GiB)\) ]]; then
  peak=$(to_mib "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}")
  planned=$(to_mib "${BASH_REMATCH[3]}" "${BASH_REMATCH[4]}")
  if awk -v peak="$peak" -v planned="$planned" 'BEGIN {exit !(peak <= planned)}'; then
    pass "peak memory $peak MiB within the planned $planned MiB"
  else
    fail "peak memory $peak MiB above the planned $planned MiB"
  fi
else
  fail "no 'memory: peak ... (planned at most ...)' line:"; indent <<<"$output" | tail -n 5
fi

# --- the CUDA backend runs where Hopper GPUs are, and says why not elsewhere ------------------
gpus=$(nvidia-smi -L 2>/dev/null | grep -c 'GPU [0-9]')
if ((gpus >= 1)); then
  expect 0 'bwd +[0-9.]+ ms/rank' -- "$mok" run --backend cuda --tokens 200
  expect 0 '^PASS$' -- "$mok" run --backend cuda --tokens 200 --routing skewed:1.5
  expect 0 '^  dx \(sample\) .*  ok$' -- "$mok" run --backend cuda --precision fp8 --tokens 300
  expect 0 '^PASS$' -- "$mok" run --backend cuda --precision fp8 --tokens 173 --routing skewed:1.5
  expect 0 '^  dx \(sample\) .*  ok$' -- "$mok" run --backend cuda --precision mxfp8 --tokens 300
  # mxfp8's blocks of 32: H, I and I_s multiples of 32 that fp8's 128 would refuse.
  expect 0 '^PASS$' -- "$mok" run --backend cuda --precision mxfp8 --tokens 173 --hidden 96 --intermediate 160 \
    --shared-intermediate 64 --routing skewed:1.5
  expect 0 '^PASS$' -- "$mok" run --backend cuda --tokens 173 --hidden 512 --intermediate 192 \
    --shared-intermediate 64 --experts 16 --top-k 6
else
  expect_error '^mok run: error: --backend: cuda cannot run here: (EP 1 needs 1 Hopper GPU|this build has no CUDA backend)' -- \
    "$mok" run --backend cuda
  expect_error '^mok run: error: --backend: cuda cannot run here: (EP 1 needs 1 Hopper GPU|this build has no CUDA backend)' -- \
    "$mok" run --backend cuda --precision fp8
  expect_error '^mok run: error: --backend: cuda cannot run here: (EP 1 needs 1 Hopper GPU|this build has no CUDA backend)' -- \
    "$mok" run --backend cuda --precision mxfp8
fi
if ((gpus >= 2)); then
  expect 0 'EP 2 vs EP 1 on the GPU: .* bitwise equal' -- "$mok" run --backend cuda --ep 2 --tokens 300
  expect 0 'EP 2 vs EP 1 on the GPU: .* bitwise equal' -- "$mok" run --backend cuda --precision fp8 --ep 2 \
    --tokens 300
  expect 0 'EP 2 vs EP 1 on the GPU: .* bitwise equal' -- "$mok" run --backend cuda --precision mxfp8 --ep 2 \
    --tokens 300
fi

# --- same seed, same bits ----------------------------------------------------------------------
first=$("$mok" run --tokens 64 --seed 5 --no-check | grep checksum)
second=$("$mok" run --tokens 64 --seed 5 --no-check --threads 1 | grep checksum)
other=$("$mok" run --tokens 64 --seed 6 --no-check | grep checksum)
if [[ "$first" == "$second" && "$first" != "$other" ]]; then
  pass "checksum repeats for a seed and changes with it"
else
  fail "checksums '$first' '$second' '$other'"
fi

# --- JSON: the path checked before any work, write errors reported, - is standard output -------
expect 0 '^PASS$' -- "$mok" run --backend cpu --tokens 32 --json "$work/run.json"
if grep -q '"schema": "mok-bench/1"' "$work/run.json" && grep -q '"phase": "fwdbwd"' "$work/run.json" &&
   grep -q '"preset": "tiny"' "$work/run.json" && grep -q '"precision": "bf16"' "$work/run.json"; then
  pass "--json writes a mok-bench/1 record"
else
  fail "--json record:"; cat "$work/run.json"
fi
expect 0 '^done' -- "$mok" run --backend cpu --tokens 8 --top-k 2 --no-check --json "$work/custom.json"
if grep -q '"name": "custom-ep1-fwd", "preset": "custom"' "$work/custom.json"; then
  pass "--json names a shape changed by flags 'custom'"
else
  fail "--json record of a custom shape:"; cat "$work/custom.json"
fi
expect 0 '^done' -- "$mok" run --backend cpu --tokens 8 --precision mxfp8 --no-check --json "$work/mxfp8.json"
if grep -q '"precision": "mxfp8"' "$work/mxfp8.json" && ! grep -q '"precision": "bf16"' "$work/mxfp8.json"; then
  pass "--json reports the precision run"
else
  fail "--json record of an mxfp8 run:"; cat "$work/mxfp8.json"
fi
# Refused at once: nothing on standard output means nothing ran.
expect_error '^mok run: error: --json: empty path \(a file name, or - for standard output\)$' -- "$mok" run --json ''
expect_error '^mok run: error: --json: empty path' -- "$mok" run --json=
expect_error "^mok run: error: --json: cannot create '$(literal "$work")/missing/x.json': directory '$(literal "$work")/missing': No such file or directory$" -- \
  "$mok" run --json "$work/missing/x.json"
expect_error "^mok run: error: --json: '$(literal "$work")' is a directory$" -- "$mok" run --json "$work"
touch "$work/file"
expect_error "^mok run: error: --json: cannot write '$(literal "$work")/file/x.json': Not a directory$" -- \
  "$mok" run --json "$work/file/x.json"
if [[ -w /dev/full ]]; then
  expect 2 "^mok run: error: --json: cannot write '/dev/full': No space left on device$" -- \
    "$mok" run --tokens 8 --no-check --json /dev/full
fi
# --json -: standard output holds the JSON alone, the report goes to standard error.
json=$(cd "$work" && "$mok" run --backend cpu --tokens 32 --ep 2 --json - 2>"$work/report.txt")
status=$?
if ((status == 0)) && [[ ! -e "$work/-" && ${json:0:1} == "{" && ${json: -1} == "}" ]] &&
   grep -q '"schema": "mok-bench/1"' <<<"$json" && ! grep -q '^PASS\|^checksum \|^mok run' <<<"$json" &&
   grep -q '^PASS$' "$work/report.txt" && grep -q '^checksum ' "$work/report.txt" &&
   { ! command -v jq >/dev/null || jq -e '.cases | length == 3' <<<"$json" >/dev/null; }; then
  pass "--json - writes the JSON alone to standard output, the report to standard error"
else
  fail "--json - (exit $status): standard output:"; indent <<<"$json" | head -n 5
  echo "    standard error:"; indent <"$work/report.txt" | tail -n 5
fi

# --- progress: labelled, and on a terminal cleared before the next line ------------------------
expect 0 '^  check \(fp64 oracle\) forward: routed experts +[0-9]+/[0-9]+ +\(100%\)$' -- \
  env MOK_PROGRESS=always "$mok" run --backend cpu --tokens 32 --ep 2
expect 0 '^  check \(EP 1 run\) backward: wgrad down +[0-9]+/[0-9]+ +\(100%\)$' -- \
  env MOK_PROGRESS=always "$mok" run --backend cpu --tokens 32 --ep 2
if command -v script >/dev/null; then
  MOK_PROGRESS=always script -qec "$(printf '%q' "$mok") run --backend cpu --tokens 32 --ep 2" /dev/null \
    >"$work/terminal.txt" 2>&1
  terminal=$(<"$work/terminal.txt")
  if [[ $terminal == *$'\r  check (fp64 oracle) forward: routed experts'* &&
        $terminal == *$'\r'+(' ')$'\r''fwd '* &&
        $terminal == *$'\r'+(' ')$'\r''check against the fp64 oracle'* &&
        $terminal != *'%)'[[:alnum:]]* ]]; then
    pass "on a terminal the progress line is labelled and cleared before the next line"
  else
    fail "progress on a terminal:"; sed 's/\r/<CR>\n/g' "$work/terminal.txt" | head -n 30
  fi
fi

# Nothing was left behind in the working folder of the JSON runs.
expect 0 '^$' -- find "$work" -name '-'

echo "cli: $passes passed, $failures failed"
[[ $failures -eq 0 ]]
