#!/usr/bin/env python3
"""Side-by-side A/B of benchmark commands in one run, as docs/perf-notes ask for every ratio.

Each variant is LABEL=COMMAND (run by bash). The variants run in turn for --rounds rounds, the
order reversed every other round (A B, B A, ...), so that a clock drifting over the run does not
favour the one that runs first. Every output line that matches --match is kept; its "name number"
pairs (e.g. "gate-up-dgrad 8.229") are the figures. The report gives, for each figure, every
round's value per variant, their mean, and each variant's mean against the first variant's.

    scripts/device/ab.py --rounds 2 --match 'backward phases, save' \\
        old='./bench_layer.old --cases deepseek-v3-ep1 --backward 1' \\
        new='./bench_layer --cases deepseek-v3-ep1 --backward 1'

A figure is named by the matching line it comes from (1 for the first such line of the command's
output, e.g. one per benchmark case) and its name. A value followed by a unit of its own ("5.796 ms",
"664.0 TFLOP/s", as bench_gemm and bench_gemm_fp8 print them) is named by that unit ("ms",
"TFLOP/s") instead of by the word before it. The report is printed and, with --out, written
there too. Exit status: 0, or 1 when a command failed or printed no matching line.
"""

import argparse
import re
import subprocess
import sys
import time

FIGURE = re.compile(r"([A-Za-z][A-Za-z0-9_+-]*)[ :=]+(-?[0-9]+(?:\.[0-9]+)?)")
# A value and its unit ("5.796 ms", not "ms/rank": those are named by the word before them).
UNIT_FIGURE = re.compile(r"(?<![\w.])(-?[0-9]+(?:\.[0-9]+)?) +(ms|TFLOP/s)(?![\w/])")


def parse_variant(text):
    label, sep, command = text.partition("=")
    if not sep or not label or not command:
        raise argparse.ArgumentTypeError(f"expected LABEL=COMMAND, got {text!r}")
    return label, command


def figures(lines):
    """{(line number, name): value} over the matching lines, numbered from 1."""
    found = {}
    for number, line in enumerate(lines, start=1):
        # Values with their own unit first; the unit then names no value after it.
        for value, unit in UNIT_FIGURE.findall(line):
            found.setdefault((number, unit), float(value))
        for name, value in FIGURE.findall(UNIT_FIGURE.sub(" ", line)):
            found.setdefault((number, name), float(value))
    return found


def run(command, pattern, timeout):
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                              timeout=timeout, check=False)
        output, status = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        captured = expired.stdout or b""  # bytes, even with text=True
        output = captured.decode(errors="replace") if isinstance(captured, bytes) else captured
        status = 124
    lines = [line.strip() for line in output.splitlines() if pattern.search(line)]
    return status, lines, time.monotonic() - started


def report(variants, values):
    """values[label] = list over rounds of {(line, name): value}."""
    labels = [label for label, _ in variants]
    keys = []
    for label in labels:
        for round_values in values[label]:
            keys.extend(key for key in round_values if key not in keys)
    out = []
    first = labels[0]
    for key in keys:
        line, name = key
        parts = []
        means = {}
        for label in labels:
            series = [round_values[key] for round_values in values[label] if key in round_values]
            if not series:
                parts.append(f"{label}: -")
                continue
            means[label] = sum(series) / len(series)
            rounds = " ".join(f"{v:g}" for v in series)
            parts.append(f"{label}: {rounds} (mean {means[label]:.4g})")
        ratios = [f"{label}/{first} {means[label] / means[first]:.3f}" for label in labels[1:]
                  if label in means and first in means and means[first] != 0]
        out.append(f"[{line}] {name:<24} " + " | ".join(parts) +
                   (("   " + ", ".join(ratios)) if ratios else ""))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="LABEL=COMMAND: a name for the variant and the command bash runs for it.")
    parser.add_argument("variants", nargs="+", type=parse_variant, metavar="LABEL=COMMAND")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every variant (2)")
    parser.add_argument("--match", default=".", help="regular expression of the lines to keep")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds one command may run (300)")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    labels = [label for label, _ in args.variants]
    if len(set(labels)) != len(labels):
        parser.error("each variant needs its own label")
    pattern = re.compile(args.match)

    values = {label: [] for label in labels}
    log = []
    failed = False
    for round_index in range(args.rounds):
        order = args.variants if round_index % 2 == 0 else list(reversed(args.variants))
        for label, command in order:
            status, lines, seconds = run(command, pattern, args.timeout)
            head = f"== round {round_index + 1} {label}: exit {status} in {seconds:.1f} s"
            print(head, flush=True)
            log.append(head)
            for line in lines:
                print("   " + line, flush=True)
                log.append("   " + line)
            if status != 0 or not lines:
                failed = True
                note = "   (failed)" if status != 0 else "   (no line matched)"
                print(note, flush=True)
                log.append(note)
            values[label].append(figures(lines))
    summary = ["== figures: each round's value, the mean, and the mean against " + labels[0]]
    summary += report(args.variants, values)
    print("\n".join(summary))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write("\n".join(log + summary) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
