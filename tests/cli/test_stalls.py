#!/usr/bin/env python3
"""scripts/device/stalls.py on a small stand-in for Nsight Compute's source view: the shares by
reason, opcode and span, the busiest instructions, the kernel choice and the errors."""

import csv
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STALLS = os.path.join(ROOT, "scripts", "device", "stalls.py")
HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "stall_barrier", "stall_long_sb", "stall_barrier (Not Issued)"]


def run(*args):
    done = subprocess.run([sys.executable, STALLS, *args], capture_output=True, text=True, check=False)
    return done.returncode, done.stdout + done.stderr


def check(condition, message, output):
    if not condition:
        print(f"FAILED: {message}\n--- output ---\n{output}")
        sys.exit(1)


def write(path, kernels):
    with open(path, "w", newline="", encoding="utf-8") as handle:
        out = csv.writer(handle, quoting=csv.QUOTE_ALL)
        for name, rows in kernels:
            out.writerow(["Kernel Name", name])
            out.writerow(HEADER)
            out.writerows(rows)


def main():
    with tempfile.TemporaryDirectory() as folder:
        view = os.path.join(folder, "view.csv")
        # 100 samples: the wgmma wait 60 (barrier), a predicated branch 30 (long_sb), an FMUL 10.
        write(view, [
            ("first_kernel", [
                ["0x0", "WARPGROUP.DEPBAR.LE gsb0, 0x0", "60", "400", "60", "0", "1"],
                ["0x10", "@P0   BRA 0x40", "30", "800", "0", "30", "0"],
                ["0x20", "FMUL R1, R2, R3", "10", "800", "0", "0", "0"],
            ]),
            ("second_kernel", [["0x0", "FFMA R1, R2, R3, R4", "5", "1", "0", "5", "0"]]),
        ])
        status, output = run(view, "--top", "2", "--span", "2", "--min-percent", "0")
        check(status == 0, "exit 0 on a good view", output)
        check("first_kernel" in output and "100 warp samples over 3 instructions" in output,
              "the first kernel's totals", output)
        lines = output.splitlines()
        by_reason = lines[lines.index("by stall reason:") + 1:lines.index("by stall reason:") + 3]
        check("barrier" in by_reason[0] and "60.0 %" in by_reason[0] and "long_sb" in by_reason[1],
              "reasons by share, the not-issued columns left out", output)
        check(any(line.split()[:2] == ["BRA", "30.0"] for line in lines), "the predicate left out of the opcode",
              output)
        spans = [line for line in lines if line.strip().startswith(("0 ", "2 "))]
        check(len(spans) >= 2 and "90.0 %" in spans[0] and "800" in spans[0] and "10.0 %" in spans[1],
              "two spans of two instructions, with their busiest instruction's runs", output)
        top = lines[lines.index("top 2 instructions (index, share, runs, main reasons, source):") + 1:]
        check(len(top) == 2 and "WARPGROUP" in top[0] and "BRA" in top[1], "the two busiest, in order", output)

        status, output = run(view, "--kernel", "second")
        check(status == 0 and "second_kernel" in output and "5 warp samples" in output,
              "--kernel picks the matching kernel", output)
        status, output = run(view, "--kernel", "third")
        check(status != 0 and "no kernel matches" in output, "an unmatched --kernel is an error", output)

        empty = os.path.join(folder, "empty.csv")
        with open(empty, "w", encoding="utf-8") as handle:
            handle.write("nothing here\n")
        status, output = run(empty)
        check(status != 0 and "no kernel" in output, "a file without a kernel is an error", output)
    print("stalls.py: all checks passed")


if __name__ == "__main__":
    main()
