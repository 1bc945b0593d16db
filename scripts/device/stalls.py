#!/usr/bin/env python3
"""Where one kernel's warps wait: a summary of Nsight Compute's source view of it, per SASS line.

Make the view on the GPU machine (one launch of the kernel, the clocks left alone):

    ncu --clock-control none -k regex:KERNEL --launch-count 1 --import-source no \\
        --section SourceCounters --section WarpStateStats -o report PROGRAM ARGS
    ncu -i report.ncu-rep --page source --csv --print-source sass > kernel-sass.csv

then, anywhere:

    scripts/device/stalls.py kernel-sass.csv [--top 30] [--span 40] [--min-percent 0.5]

It prints the warp samples by stall reason, by opcode, by span of --span consecutive
instructions (with how many times the span's busiest instruction ran: once a tile, once a k-block,
...), and the --top instructions with their two main reasons, each as a share of all samples. The
samples count every warp, the producer's too. With several kernels in the file, --kernel REGEX
picks the first whose name matches (default: the first).
"""

import argparse
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
SOURCE = "Source"


def read_kernels(path):
    """[(kernel name, header, rows)] from the CSV: each kernel starts with a "Kernel Name" line."""
    kernels = []
    with open(path, newline="", encoding="utf-8", errors="replace") as handle:
        lines = list(csv.reader(handle))
    index = 0
    while index < len(lines):
        line = lines[index]
        if line and line[0] == "Kernel Name":
            name = line[1] if len(line) > 1 else "?"
            header = lines[index + 1] if index + 1 < len(lines) else []
            rows = []
            index += 2
            while index < len(lines) and not (lines[index] and lines[index][0] == "Kernel Name"):
                if len(lines[index]) == len(header):
                    rows.append(lines[index])
                index += 1
            kernels.append((name, header, rows))
        else:
            index += 1
    return kernels


def number(text):
    try:
        return int(float(text))
    except ValueError:
        return 0


def opcode(source):
    """The SASS line's opcode, without its predicate (`@P0 BRA ...` gives BRA)."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0] if words else "?"


def summarize(name, header, rows, top, span, min_percent, out):
    for column in (SAMPLES, EXECUTED, SOURCE):
        if column not in header:
            raise SystemExit(f"stalls: no '{column}' column (make the view with --page source --csv)")
    samples_at = header.index(SAMPLES)
    executed_at = header.index(EXECUTED)
    source_at = header.index(SOURCE)
    reasons = [(i, column[len("stall_"):]) for i, column in enumerate(header)
               if column.startswith("stall_") and "Not Issued" not in column]
    samples = [number(row[samples_at]) for row in rows]
    total = sum(samples)
    if total == 0:
        raise SystemExit("stalls: the view has no warp samples (was SourceCounters collected?)")

    def share(value):
        return 100.0 * value / total

    print(f"{name}\n{total} warp samples over {len(rows)} instructions", file=out)
    by_reason = {label: sum(number(row[i]) for row in rows) for i, label in reasons}
    print("\nby stall reason:", file=out)
    for label, value in sorted(by_reason.items(), key=lambda item: -item[1]):
        if share(value) >= min_percent:
            print(f"  {label:22s} {share(value):5.1f} %", file=out)

    by_opcode = {}
    for row, value in zip(rows, samples):
        key = opcode(row[source_at])
        by_opcode[key] = by_opcode.get(key, 0) + value
    print("\nby opcode:", file=out)
    for key, value in sorted(by_opcode.items(), key=lambda item: -item[1]):
        if share(value) >= min_percent:
            print(f"  {key:34s} {share(value):5.1f} %", file=out)

    print(f"\nby span of {span} instructions (first, share, runs of its busiest, main reasons, opcodes):",
          file=out)
    for first in range(0, len(rows), span):
        chunk = rows[first:first + span]
        value = sum(samples[first:first + span])
        if share(value) < min_percent:
            continue
        runs = max(number(row[executed_at]) for row in chunk)
        main = sorted(((sum(number(row[i]) for row in chunk), label) for i, label in reasons), reverse=True)[:2]
        counts = {}
        for row in chunk:
            counts[opcode(row[source_at])] = counts.get(opcode(row[source_at]), 0) + 1
        common = ", ".join(f"{key} {count}" for key, count in sorted(counts.items(), key=lambda item: -item[1])[:3])
        reasons_text = ", ".join(f"{label} {share(amount):.1f}" for amount, label in main if amount)
        print(f"  {first:6d} {share(value):5.1f} % {runs:>10d}  {reasons_text:32s} {common}", file=out)

    print(f"\ntop {top} instructions (index, share, runs, main reasons, source):", file=out)
    busiest = sorted(range(len(rows)), key=lambda i: -samples[i])[:top]
    for i in sorted(busiest):
        row = rows[i]
        main = sorted(((number(row[j]), label) for j, label in reasons), reverse=True)[:2]
        reasons_text = ", ".join(f"{label} {amount}" for amount, label in main if amount)
        print(f"  {i:6d} {share(samples[i]):5.2f} % {number(row[executed_at]):>10d}  {reasons_text:34s} "
              f"{row[source_at].strip()[:70]}", file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source sass")
    parser.add_argument("--top", type=int, default=30, help="instructions listed (default 30)")
    parser.add_argument("--span", type=int, default=40, help="instructions a span (default 40)")
    parser.add_argument("--min-percent", type=float, default=0.5,
                        help="leave out reasons, opcodes and spans below this share (default 0.5)")
    parser.add_argument("--kernel", default=None, help="the first kernel whose name matches")
    args = parser.parse_args(argv)
    if args.top < 0 or args.span < 1:
        parser.error("--top must be >= 0 and --span >= 1")
    kernels = read_kernels(args.csv)
    if not kernels:
        raise SystemExit(f"stalls: no kernel in {args.csv} (no 'Kernel Name' line)")
    chosen = kernels[0]
    if args.kernel is not None:
        matching = [kernel for kernel in kernels if re.search(args.kernel, kernel[0])]
        if not matching:
            raise SystemExit(f"stalls: no kernel matches {args.kernel!r} among {len(kernels)}")
        chosen = matching[0]
    try:
        summarize(*chosen, args.top, args.span, args.min_percent, sys.stdout)
    except BrokenPipeError:  # (piped into head)
        sys.stderr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
