#!/usr/bin/env python3
"""scripts/device/ab.py on stand-in commands: the order of the rounds, the figures and their
ratios, and the exit status when a command fails or prints no matching line."""

import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AB = os.path.join(ROOT, "scripts", "device", "ab.py")


def ab(*args):
    done = subprocess.run([sys.executable, AB, *args], capture_output=True, text=True,
                          check=False)
    return done.returncode, done.stdout + done.stderr


def check(condition, message, output):
    if not condition:
        print(f"FAILED: {message}\n--- output ---\n{output}")
        sys.exit(1)


def main():
    with tempfile.TemporaryDirectory() as folder:
        order = os.path.join(folder, "order")
        report = os.path.join(folder, "report")
        # A prints 2.0 then 4.0 for x (rounds 1 and 2), B 3.0 and 5.0; each appends its label to
        # `order`; a second matching line (case 2) has y.
        stand_in = ("echo {label} >> {order}; n=$(grep -c {label} {order}); "
                    "echo \"phases: x $(({base} + 2 * (n - 1))).0 other 7\"; "
                    "echo \"phases: y {y}\"; echo \"noise x 99\"")
        a = stand_in.format(label="A", order=order, base=2, y="1.5")
        b = stand_in.format(label="B", order=order, base=3, y="3")
        status, output = ab("--rounds", "3", "--match", "^phases", "--out", report,
                            f"a={a}", f"b={b}")
        check(status == 0, "exit 0 when every command matched", output)
        with open(order, encoding="utf-8") as handle:
            ran = handle.read().split()
        check(ran == ["A", "B", "B", "A", "A", "B"], f"rounds alternate the order: {ran}", output)
        check("[1] x" in output and "a: 2 4 6 (mean 4)" in output, "a's x over rounds", output)
        check("b: 3 5 7 (mean 5)" in output and "b/a 1.250" in output, "b's x and ratio", output)
        check("[2] y" in output and "b/a 2.000" in output, "the second line's figure", output)
        check("99" not in output.split("== figures")[1], "unmatched lines ignored", output)
        with open(report, encoding="utf-8") as handle:
            check("b/a 1.250" in handle.read(), "--out holds the report", output)

        # bench_gemm's lines: each value before its unit is named by the unit; "ms/rank" is not
        # a unit of its own (the word before the value names it).
        line = "deepseek-v3 gemm-wgrad fp8 r0 E 256 rows 256 n 4096 k 7168  {ms} ms  {tf} TFLOP/s"
        status, output = ab("--rounds", "1", "--match", "TFLOP|rank",
                            "a=echo '" + line.format(ms="9.700", tf="600.0") + "'; "
                            "echo 'save mode: backward 29.661 ms/rank 437.9 useful TFLOP/s'",
                            "b=echo '" + line.format(ms="9.215", tf="631.6") + "'; "
                            "echo 'save mode: backward 28.000 ms/rank 463.9 useful TFLOP/s'")
        check(status == 0, "unit-named figures: exit 0", output)
        check("[1] ms " in output and "a: 9.7 (mean 9.7) | b: 9.215" in output,
              "the ms value named by its unit", output)
        check("[1] TFLOP/s" in output and "b: 631.6" in output, "TFLOP/s named by its unit",
              output)
        check("[2] backward " in output and "b: 28 (mean 28)" in output,
              "ms/rank stays named by the word before it", output)
        check("[2] useful " not in output and "[1] k " in output,
              "a unit's value is not also named by the word before it", output)

        status, output = ab("--rounds", "1", "--match", "^phases", "a=echo phases: x 1",
                            "b=exit 3")
        check(status == 1 and "exit 3" in output, "a failing command fails the run", output)
        status, output = ab("--rounds", "1", "--match", "^phases", "a=echo nothing")
        check(status == 1 and "no line matched" in output, "no matching line fails", output)
        status, output = ab("nolabel")
        check(status == 2 and "LABEL=COMMAND" in output, "a variant without a label", output)
        status, output = ab("a=true", "a=true")
        check(status == 2 and "own label" in output, "duplicate labels refused", output)
    print("ab.py: all checks passed")


if __name__ == "__main__":
    main()
