#!/usr/bin/env bash
# Sanitizer part of the device check: compute-sanitizer's memcheck, racecheck, synccheck and
# initcheck, each in one process over a few small GPU tests that cover the fused forward (with
# carried tails), the unfused forward, the layer backward, both GEMM engines (forward, dgrad,
# wgrad) and the communication kernels (schedule, dispatch, combine); memcheck also over the
# device-fault tests (a poisoned routing must not make a kernel touch memory out of bounds). One
# summary line per tool: tests run, findings. The suite in full under racecheck would take far
# too long; these cases run every kernel of those paths on small shapes.
#
#   OUT=/tmp/out scripts/device/sanitize.sh [BIN_DIR]
#
# BIN_DIR holds mok_gpu_tests (default $MOK_BUILD_DIR, set by scripts/device-check.sh). Results go
# to $MOK_RESULTS_DIR when device-check sets it, else $OUT: sanitize.log (the summary lines),
# sanitize-TOOL.log (each tool's whole output), sanitize-racecheck-handoff.log (see below).
# Environment: MOK_SANITIZE_TOOLS (default "memcheck racecheck synccheck initcheck"),
# MOK_SANITIZE_FILTER (a gtest filter instead of the cases below), MOK_SANITIZE_TIMEOUT (seconds
# per tool instead of each tool's default below).
#
# Exit status 0 when every tool ran, every test passed, at least one test ran, and there is no
# finding beyond the known one below; 1 otherwise.
#
# The one known finding (counted apart, not failed): racecheck reports the fused forward's task
# hand-off in kernels/megakernel/compute.cuh — the producer's write of the task into its ring
# slot (`handoff.task[cursor.slot] = task;`) against the consumers' read of it
# (`task = handoff.task[cursor.slot];`), one report per 4-byte word of the 44-byte Task. The
# hand-off is ordered: the write happens before the producer's mbarrier.arrive (release, CTA
# scope) on the slot's full barrier, which every consumer thread waits on (try_wait, acquire)
# before reading;
# every consumer warp's 32 reads happen before its __syncwarp, after which its lane 0 arrives
# (release) on the slot's empty barrier, which the producer waits on (acquire) before it writes
# the slot again. racecheck does not follow the second chain — reads by lanes 1-31 reach the
# empty barrier only through lane 0, across the __syncwarp — so it reports the next write as a
# hazard against them. docs/perf-notes/reliability.md has the argument and the restructuring that
# would let the tool see it. The known finding is recognised by its exact place: a report whose
# every access is a write on the first line or a read on the second (found in compute.cuh by
# their text, so that edits above them do not break it); any other report counts as a finding.
# When it shows, racecheck runs once more on one fused-forward test with --racecheck-report
# hazard (sanitize-racecheck-handoff.log): which hazard (RAW or WAR) and which lanes read, the
# evidence for the explanation above.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${MOK_RESULTS_DIR:-${OUT:?set OUT to the results folder}}
BIN=${1:-${MOK_BUILD_DIR:?pass the build folder}}
mkdir -p "$OUT"
SUMMARY="$OUT/sanitize.log"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# Small cases, a few seconds each without a sanitizer:
#   FusedForwardEp1.EqualsUnfusedBitwiseAndRepeats     fused kernel (trace on) and the unfused
#                                                      composition: schedule, dispatch, combine,
#                                                      grouped GEMMs with SwiGLU, reduce
#   FusedForwardTails.CarriedTailsEqualUnfusedBitwise  carried tails (wgmma m64n8), half tiles
#   LayerBackwardEp1.AccumulatesIntoMainGrad           the backward: dgrads, SwiGLU backward,
#                                                      wgrads into main_grad, d_topk_w
#   GroupedGemmForward.PingpongEqualsCooperativeBitwise   both engines, bf16 / fp32 / SwiGLU
#   GroupedGemmBackward.PingpongEqualsCooperativeBitwise  both engines, dgrad and wgrad
#   CommLayerEp1.MatchesReferenceOnOneGpu              the standalone communication kernels
# and, under memcheck and synccheck only,
#   GroupedGemmFp8Wgrad.ExactDataUnpaddedSpans         the FP8 wgrad: its store warp's staged
#                                                      tiles (mbarriers staged / free), TMA stores
#   LayerMxfp8.SaveModeGivesRecomputesBits             the mxfp8 layer, forward and backward, at
#                                                      EP 1 and 2: the round trips, both SwiGLUs
#   LayerBackwardChunks.AccumulatesAndReplaysInAGraph  the low-memory backward: chunk tables, the
#                                                      dispatch into a chunk's rows, GEMMs that
#                                                      leave experts out (count -1)
# (racecheck reports the FP8 engine's scale hand-off, the producer's cp.async writes of a stage's
# scales against the consumers' reads, which cp.async.mbarrier.arrive orders and the tool does not
# follow; docs/perf-notes/reliability.md. Seen 2026-12-03, not yet classified here.)
cases="FusedForwardEp1.EqualsUnfusedBitwiseAndRepeats:FusedForwardTails.CarriedTailsEqualUnfusedBitwise"
cases+=":LayerBackwardEp1.AccumulatesIntoMainGrad"
cases+=":GroupedGemmForward.PingpongEqualsCooperativeBitwise"
cases+=":GroupedGemmBackward.PingpongEqualsCooperativeBitwise:CommLayerEp1.MatchesReferenceOnOneGpu"
fault_cases="FaultRecovery.*:CommErrors.RepeatedExpertIdInTheFusedForwardBecomesHostError"
memcheck_synccheck_cases="GroupedGemmFp8Wgrad.ExactDataUnpaddedSpans:LayerMxfp8.SaveModeGivesRecomputesBits"
memcheck_synccheck_cases+=":LayerBackwardChunks.AccumulatesAndReplaysInAGraph"
handoff_case="FusedForwardEp1.EqualsUnfusedBitwiseAndRepeats"
tools=${MOK_SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}
declare -A limit=([memcheck]=90 [racecheck]=150 [synccheck]=60 [initcheck]=90)

sanitizer=$(command -v compute-sanitizer || true)
for candidate in "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" \
                 "${CUDA_HOME:-/usr/local/cuda}/compute-sanitizer/compute-sanitizer"; do
  [[ -z "$sanitizer" && -x "$candidate" ]] && sanitizer=$candidate
done
if [[ -z "$sanitizer" ]]; then
  say "sanitize: compute-sanitizer not found (PATH, \$CUDA_HOME): nothing checked"
  exit 1
fi
if [[ ! -x "$BIN/mok_gpu_tests" ]]; then
  say "sanitize: no $BIN/mok_gpu_tests: nothing checked"
  exit 1
fi
say "== sanitize: $("$sanitizer" --version 2>&1 | grep -m1 -i version), $BIN/mok_gpu_tests"

# The known finding's two lines, found by their text.
compute=src/kernels/megakernel/compute.cuh
write_line=$(grep -n 'handoff\.task\[cursor\.slot\] = task;' "$compute" | cut -d: -f1)
read_line=$(grep -n 'task = handoff\.task\[cursor\.slot\];' "$compute" | cut -d: -f1)
if [[ $(wc -w <<< "$write_line") != 1 || $(wc -w <<< "$read_line") != 1 ]]; then
  say "sanitize: the task hand-off's lines are not (once each) in $compute: no report is known"
  write_line=none read_line=none
fi

# gtest's totals in a log: "RUN PASSED FAILED SKIPPED", -1 for RUN when the totals line is missing
# (the process died before the end).
gtest_totals() {
  awk '/^\[==========\] [0-9]+ tests? from .* ran\./ { run = $2 }
       /^\[  PASSED  \] [0-9]+ test/ { passed = $4 }
       /^\[  FAILED  \] [0-9]+ tests?, listed below/ { failed = $4 }
       /^\[  SKIPPED \] [0-9]+ tests?, listed below/ { skipped = $4 }
       END { print (run == "" ? -1 : run), passed + 0, failed + 0, skipped + 0 }' "$1"
}

# racecheck's reports in a log (analysis mode): "KNOWN OTHER", and the other reports' first lines
# on stderr. A report is a "Race reported between" line and its "and ... access" lines; it is the
# known one when every access is the write at compute.cuh:W or the read at compute.cuh:R, and it
# has both.
racecheck_reports() {
  awk -v write="W:compute.cuh:$write_line" -v read="R:compute.cuh:$read_line" '
    function access_of(line,   kind, place) {
      sub(/[ \r]+$/, "", line)
      if (!match(line, /(Write|Read) access at /)) return "?"
      kind = substr(line, RSTART, 1)
      place = "?"
      if (match(line, /[^ \/]+:[0-9]+( \[[0-9]+ hazards?\])?$/)) {
        place = substr(line, RSTART, RLENGTH)
        sub(/ \[.*$/, "", place)
      }
      return kind ":" place
    }
    function flush(   i, ok, has_write, has_read) {
      if (!open) return
      open = 0
      ok = 1; has_write = 0; has_read = 0
      for (i = 1; i <= count; i++) {
        if (access[i] == write) has_write = 1
        else if (access[i] == read) has_read = 1
        else ok = 0
      }
      if (ok && has_write && has_read) known++
      else { other++; print "  " first > "/dev/stderr" }
    }
    /^========= (Error|Warning): Race reported between / {
      flush(); open = 1; count = 0; first = $0; access[++count] = access_of($0); next
    }
    open && /^=========     and / { access[++count] = access_of($0); next }
    { flush() }
    END { flush(); print known + 0, other + 0 }' "$1"
}

status=0
for tool in $tools; do
  if [[ -z "${limit[$tool]:-}" ]]; then
    say "sanitize $tool: unknown tool (memcheck, racecheck, synccheck, initcheck)"
    status=1
    continue
  fi
  filter=${MOK_SANITIZE_FILTER:-$cases}
  [[ "$tool" == memcheck && -z "${MOK_SANITIZE_FILTER:-}" ]] && filter+=":$fault_cases"
  [[ ("$tool" == memcheck || "$tool" == synccheck) && -z "${MOK_SANITIZE_FILTER:-}" ]] &&
    filter+=":$memcheck_synccheck_cases"
  seconds=${MOK_SANITIZE_TIMEOUT:-${limit[$tool]}}
  log="$OUT/sanitize-$tool.log"
  start=$(date +%s)
  timeout --kill-after=10 "$seconds" "$sanitizer" --tool "$tool" --print-limit 100 \
    --error-exitcode 86 "$BIN/mok_gpu_tests" --gtest_filter="$filter" > "$log" 2>&1
  rc=$?
  took=$(( $(date +%s) - start ))
  read -r run passed failed skipped < <(gtest_totals "$log")
  if [[ "$tool" == racecheck ]]; then
    summary=$(grep -m1 -oE 'RACECHECK SUMMARY: [0-9]+ hazards? displayed' "$log" | grep -oE '[0-9]+' | head -1)
    read -r known other < <(racecheck_reports "$log" 2> "$OUT/sanitize-racecheck-other.txt")
    findings=$(( ${summary:-0} - known ))
    (( findings < other )) && findings=$other
  else
    summary=$(grep -m1 -oE 'ERROR SUMMARY: [0-9]+ errors?' "$log" | grep -oE '[0-9]+' | head -1)
    known=0
    findings=${summary:-0}
  fi
  line="sanitize $tool: $run tests run ($passed passed, $failed failed, $skipped skipped), findings: $findings"
  ((known > 0)) && line+=", known: $known (the task hand-off, compute.cuh:$write_line write / :$read_line read: ordered, see the header of scripts/device/sanitize.sh)"
  line+=" [${took} s, sanitize-$tool.log]"
  problem=""
  if ((rc == 124 || rc == 137)); then problem="timed out after $seconds s"
  elif [[ -z "$summary" ]]; then problem="no $tool summary in the log (the tool did not run: $(grep -m1 -E '^========= (Error|ERROR)' "$log" || tail -n 1 "$log"))"
  elif ((run < 0)); then problem="the test process died (exit $rc)"
  elif ((run == 0 || run == skipped)); then problem="no test ran (none matched, or all skipped: $(grep -m1 -A1 ': Skipped$' "$log" | tail -n 1))"
  elif ((failed > 0)); then problem="tests failed"
  elif ((findings > 0)); then problem="findings"
  fi
  if [[ -n "$problem" ]]; then
    say "$line: FAILED ($problem)"
    status=1
    [[ "$tool" == racecheck && -s "$OUT/sanitize-racecheck-other.txt" ]] &&
      say "$(head -n 5 "$OUT/sanitize-racecheck-other.txt")"
    [[ "$tool" != racecheck && "$problem" == findings ]] && grep -m 5 -E '^========= (Invalid|Error|ERROR|Uninitialized|Barrier|Warning)' "$log" | tee -a "$SUMMARY"
  else
    say "$line"
  fi

  # The known finding's evidence: its hazards one by one, for one fused-forward test.
  if [[ "$tool" == racecheck ]] && ((known > 0)); then
    detail="$OUT/sanitize-racecheck-handoff.log"
    timeout --kill-after=10 60 "$sanitizer" --tool racecheck --racecheck-report hazard \
      --print-limit 200 "$BIN/mok_gpu_tests" --gtest_filter="$handoff_case" > "$detail" 2>&1
    say "$(awk -v write="compute.cuh:$write_line" -v read="compute.cuh:$read_line" '
      /Potential (RAW|WAR|WAW) hazard/ { match($0, /(RAW|WAR|WAW)/); kind = substr($0, RSTART, 3); hazards[kind]++; in_hazard = 1; next }
      in_hazard && /Read Thread/ && index($0, read) {
        match($0, /Read Thread \( *[0-9]+/); x = substr($0, RSTART, RLENGTH); gsub(/[^0-9]/, "", x)
        if (x % 32 == 0) lane0++; else other_lanes++
      }
      END {
        printf "sanitize racecheck, the hand-off one hazard at a time (%s): RAW %d, WAR %d, WAW %d; its reads by lane 0 of a warp %d, by lanes 1-31 %d [sanitize-racecheck-handoff.log]\n",
               "'"$handoff_case"'", hazards["RAW"], hazards["WAR"], hazards["WAW"], lane0, other_lanes
      }' "$detail")"
  fi
done
if ((status == 0)); then say "sanitize: passed"; else say "sanitize: FAILED"; fi
exit $status
