"""The benchmarks' latest results as a reader sees them: one PNG chart per benchmark and the
Markdown performance table of the README.

  python3 bench/report.py                          charts into bench/results/, table on stdout
  python3 bench/report.py --readme README.md       also the table into README.md, between
                                                   <!-- perf-table:begin --> and <!-- perf-table:end -->
  python3 bench/report.py --results-dir OUT --kinds layer --no-table    (a device run's chart)
  python3 bench/report.py --no-png                 no matplotlib needed

Reads every JSON of schema mok-bench/1 or mok-bench/2 (DESIGN.md §5) in --results-dir; the
benchmark is the file's `benchmark` field, else its name without a device or commit suffix
(`layer-fwd-h200x2-8aa8ed148919.json` -> layer); the newest of each (by `date`) is reported.
Charts (matplotlib, Agg): for the layer and GEMM benchmarks ms and the fraction of the dense bf16
GEMM rate of the same run, mok beside the fastest baseline, one column per phase of the layer;
for communication, GB/s against the SMs moving rows, torch's all_to_all_single as a line.
Table rows: the layer's cases and phases; per GEMM and phase the faster of mok's engines; per
communication phase and copy method mok's fastest SM count. An fp8 layer row's fastest baseline
(table and chart) is the fastest torch-native layer of either precision: torch's bf16 layer where
it is faster, and always for the fp8 training step and backward, which torch-native does not run
in FP8. Every absolute figure is at the clock the GPUs' power cap (700 W on H200) leaves, which
the table says.
"""
import argparse
import glob
import json
import os
import re
import sys

BEGIN_MARKER = "<!-- perf-table:begin -->"
END_MARKER = "<!-- perf-table:end -->"
KIND_ALIASES = {"layer-fwd": "layer"}  # mok-bench/1 layer results were forward-only
LAYER_PHASES = ("fwd", "fwdbwd", "bwd")
DEFAULT_POWER_CAP_W = 700  # H200's, DESIGN.md §4; a result's power_limit_w takes precedence
COMM_TARGET_GBPS = 300  # the dispatch / combine target the communication chart has shown


def kind_of(path, record):
    """The benchmark a results file belongs to."""
    if record.get("benchmark"):
        return record["benchmark"]
    stem = os.path.splitext(os.path.basename(path))[0]
    stem = re.sub(r"-run\d+", "", stem)
    stem = re.sub(r"(-[0-9a-f]{7,40}|-\d{4}-\d{2}-\d{2})$", "", stem)
    stem = re.sub(r"-h\d+\w*$", "", stem)  # device suffix: -h200, -h200x2
    return KIND_ALIASES.get(stem, stem)


def latest_results(results_dir, kinds=None):
    """{kind: (path, record)}: the newest mok-bench record of each benchmark in results_dir."""
    latest = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        try:
            with open(path) as file:
                record = json.load(file)
        except (OSError, ValueError):
            continue
        if not isinstance(record, dict) or not str(record.get("schema", "")).startswith("mok-bench/"):
            continue
        kind = kind_of(path, record)
        if kinds and kind not in kinds:
            continue
        if kind not in latest or record.get("date", "") > latest[kind][1].get("date", ""):
            latest[kind] = (path, record)
    return latest


# ---------------------------------------------------------------------------------------------
# Table


def case_label(entry):
    """A case's name without the phase some mok-bench/1 names carry."""
    name = entry["name"]
    suffix = f"-{entry['phase']}"
    return name[: -len(suffix)] if name.endswith(suffix) else name


def fraction_of_dense(entry, record):
    if entry.get("fraction_of_dense") is not None:
        return entry["fraction_of_dense"]
    dense = entry.get("dense_gemm_tflops") or record.get("dense_gemm_tflops")
    useful = entry.get("useful_tflops")
    return useful / dense if useful and dense else None


def rate(value, unit):
    """'506 TFLOP/s'; three significant digits below 10."""
    if not value:
        return ""
    return f"{value:.0f} {unit}" if value >= 10 else f"{value:.3g} {unit}"


def fastest_baseline(entry):
    """(name, ms, speedup) of an entry's fastest baseline. An FP8 entry's is the fastest
    torch-native layer of either precision: torch's FP8 layer is slower than its bf16 one at some
    shapes, and torch-native has no FP8 training step (fwdbwd, bwd: its bf16 one alone)."""
    baseline = entry.get("baseline") or ""
    baseline_ms, speedup = entry.get("baseline_ms"), entry.get("speedup")
    bf16_ms = entry.get("baseline_bf16_ms")
    if bf16_ms and (not baseline_ms or bf16_ms < baseline_ms):
        baseline, baseline_ms = f"{entry.get('baseline_bf16')}, bf16", bf16_ms
        speedup = round(bf16_ms / entry["mok_ms"], 2) if entry.get("mok_ms") else None
    return baseline, baseline_ms, speedup


def layer_rows(record):
    order = {phase: index for index, phase in enumerate(LAYER_PHASES)}
    entries = sorted(record["cases"], key=lambda e: order.get(e["phase"], 9))
    names = []
    for entry in record["cases"]:
        if case_label(entry) not in names:
            names.append(case_label(entry))
    entries.sort(key=lambda e: (names.index(case_label(e)), order.get(e["phase"], 9)))
    rows = []
    for entry in entries:
        baseline, baseline_ms, speedup = fastest_baseline(entry)
        if baseline and not baseline.startswith("torch"):  # a torch_native.py variant's name
            baseline = f"torch-native {baseline}"
        rows.append({"case": case_label(entry), "phase": entry["phase"], "mok_ms": entry["mok_ms"],
                     "baseline_ms": baseline_ms, "baseline": baseline,
                     "speedup": speedup,
                     "rate": rate(entry.get("useful_tflops"), "TFLOP/s"),
                     "fraction": fraction_of_dense(entry, record)})
    return rows


def gemm_rows(record):
    """Per GEMM (preset and phase): the faster of mok's engines."""
    best = {}
    for entry in record["cases"]:
        key = (entry["preset"], entry["phase"])
        if key not in best or entry["mok_ms"] < best[key]["mok_ms"]:
            best[key] = entry
    rows = []
    for (preset, phase), entry in best.items():
        engine = f" ({entry['engine']})" if entry.get("engine") else ""
        rows.append({"case": f"{preset}{engine}", "phase": phase, "mok_ms": entry["mok_ms"],
                     "baseline_ms": entry.get("baseline_ms"), "baseline": entry.get("baseline") or "",
                     "speedup": entry.get("speedup"),
                     "rate": rate(entry.get("useful_tflops"), "TFLOP/s"),
                     "fraction": fraction_of_dense(entry, record)})
    return rows


def comm_rows(record):
    """Per phase and copy method: mok's fastest SM count."""
    best = {}
    for entry in record["cases"]:
        key = (entry["phase"], entry.get("method", ""))
        if key not in best or entry["mok_ms"] < best[key]["mok_ms"]:
            best[key] = entry
    rows = []
    for (phase, method), entry in sorted(best.items()):
        sms = f", {entry['num_sms']} SMs" if entry.get("num_sms") else ""
        baseline = entry.get("baseline") or ""
        rows.append({"case": f"{entry['preset']} EP{entry['ep']} ({method}{sms})", "phase": phase,
                     "mok_ms": entry["mok_ms"], "baseline_ms": entry.get("baseline_ms"),
                     "baseline": baseline.split(" (")[0], "speedup": entry.get("speedup"),
                     "rate": rate(entry.get("gbps"), "GB/s"),
                     "fraction": None})
    return rows


ROWS = {"layer": layer_rows, "gemm": gemm_rows, "comm": comm_rows}
TITLES = {"layer": "MoE layer", "gemm": "Grouped expert GEMMs (one rank of EP 2)",
          "comm": "NVLink dispatch / combine"}


def number(value, digits, suffix=""):
    return "n/a" if value is None else f"{value:.{digits}f}{suffix}"


def markdown_table(rows):
    lines = ["| case | phase | mok | rate | fastest baseline | speedup | fraction of dense |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        baseline = (f"{row['baseline_ms']:.2f} ms ({row['baseline']})" if row["baseline_ms"]
                    else "n/a")
        lines.append(f"| {row['case']} | {row['phase']} | {number(row['mok_ms'], 2, ' ms')} | "
                     f"{row['rate'] or 'n/a'} | {baseline} | {number(row['speedup'], 2, '×')} | "
                     f"{number(row['fraction'], 2)} |")
    return lines


def run_line(record):
    """Date, device, commit, dense rate, clock and power of one record."""
    parts = [f"{record.get('device', 'unknown device')}", f"{str(record.get('date', ''))[:16]} UTC",
             f"commit {str(record.get('commit', 'unknown'))[:12]}"]
    dense = record.get("dense_gemm_tflops")
    if dense is None:
        values = {e.get("dense_gemm_tflops") for e in record["cases"]} - {None}
        dense = values.pop() if len(values) == 1 else None
    if dense:
        parts.append(f"dense bf16 GEMM (8192³) {dense:.0f} TFLOP/s in the same run")
    clocks = [e["clock_mhz"] for e in record["cases"] if e.get("clock_mhz")]
    powers = [e["power_w"] for e in record["cases"] if e.get("power_w")]
    if clocks and powers:
        parts.append(f"baseline loops sampled at {min(clocks):.0f}–{max(clocks):.0f} MHz, "
                     f"{min(powers):.0f}–{max(powers):.0f} W")
    mok_clocks = [e["mok_clock_mhz"] for e in record["cases"] if e.get("mok_clock_mhz")]
    mok_powers = [e["mok_power_w"] for e in record["cases"] if e.get("mok_power_w")]
    if mok_clocks and mok_powers:
        parts.append(f"mok's at {min(mok_clocks):.0f}–{max(mok_clocks):.0f} MHz, "
                     f"{min(mok_powers):.0f}–{max(mok_powers):.0f} W")
    return "; ".join(parts)


def report_text(latest, png_paths, readme_dir):
    """The Markdown block: per benchmark a heading line, the run line, the table, the chart."""
    caps = {record.get("power_limit_w") for _, record in latest.values()} - {None}
    cap = f"{max(caps):.0f}" if caps else f"{DEFAULT_POWER_CAP_W}"
    lines = [f"The GPUs run at their {cap} W power cap: every time below is at the clock that cap "
             "leaves, and each speedup is against the fastest baseline measured in the same run "
             "(generated by `bench/report.py` from `bench/results/`)."]
    for kind in sorted(latest, key=lambda k: (list(ROWS).index(k) if k in ROWS else 9, k)):
        path, record = latest[kind]
        rows = ROWS.get(kind, layer_rows)(record)
        if not rows:
            continue
        lines += ["", f"**{TITLES.get(kind, kind)}** — {run_line(record)} "
                      f"(`{os.path.relpath(path, readme_dir)}`)", ""]
        lines += markdown_table(rows)
        if kind in png_paths:
            lines += ["", f"![{kind}]({os.path.relpath(png_paths[kind], readme_dir)})"]
    return "\n".join(lines) + "\n"


def replace_in_readme(readme, text):
    """Puts `text` between the markers of `readme`; False where the markers are missing."""
    with open(readme) as file:
        content = file.read()
    begin, end = content.find(BEGIN_MARKER), content.find(END_MARKER)
    if begin < 0 or end < begin:
        return False
    content = content[: begin + len(BEGIN_MARKER)] + "\n" + text + content[end:]
    with open(readme, "w") as file:
        file.write(content)
    return True


# ---------------------------------------------------------------------------------------------
# Charts


def chart(kind, record, path):
    """Draws `record`'s chart into `path` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if kind == "comm" or all(e.get("gbps") for e in record["cases"]):
        figure = chart_comm(plt, record)
    else:
        figure = chart_cases(plt, kind, record)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def chart_columns(kind, record):
    """[(column title, [(x label, entry)])]: the layer's by phase, the GEMMs' by preset."""
    cases = record["cases"]
    if cases and all(e["phase"] in LAYER_PHASES for e in cases):
        return [(phase, [(case_label(e), e) for e in cases if e["phase"] == phase])
                for phase in LAYER_PHASES if any(e["phase"] == phase for e in cases)]
    if cases and all(e["phase"].startswith("gemm-") for e in cases):
        presets = list(dict.fromkeys(e["preset"] for e in cases))
        return [(preset, [(e["phase"][len("gemm-"):] + (f" [{e['engine']}]" if e.get("engine") else ""), e)
                          for e in cases if e["preset"] == preset]) for preset in presets]
    return [("", [(e["name"], e) for e in cases])]


def chart_cases(plt, kind, record):
    """ms (top) and fraction of dense (bottom), mok beside the fastest baseline; a column per
    phase of the layer, per preset of the GEMMs."""
    import textwrap

    columns = chart_columns(kind, record)
    widths = [max(3.5, 0.42 * len(entries) + 1.5) for _, entries in columns]
    figure, axes = plt.subplots(2, len(columns), figsize=(min(sum(widths), 26), 8), squeeze=False,
                                gridspec_kw={"width_ratios": widths})
    dense_rate = record.get("dense_gemm_tflops")
    for column, (title, labelled) in enumerate(columns):
        names = [name for name, _ in labelled]
        entries = [entry for _, entry in labelled]
        positions = list(range(len(entries)))
        top, bottom = axes[0][column], axes[1][column]
        mok_ms = [e["mok_ms"] for e in entries]
        fastest = [fastest_baseline(e) for e in entries]  # (name, ms, speedup), as the table's
        base_ms = [ms or 0.0 for _, ms, _ in fastest]
        top.bar([p - 0.2 for p in positions], mok_ms, width=0.4, label="mok")
        top.bar([p + 0.2 for p in positions], base_ms, width=0.4, label="fastest baseline")
        for p, (name, _, speedup) in zip(positions, fastest):
            label = f"{speedup:.2f}×" if speedup else ""
            if name and kind == "layer":
                label += f"\n{name}"
            top.text(p + 0.2, base_ms[p], label, ha="center", va="bottom", fontsize=7)
        top.set_ylim(0, 1.25 * max(mok_ms + base_ms))  # room for the labels and the legend
        top.set_title(f"{TITLES.get(kind, kind)}{': ' + title if title else ''}", fontsize=10)
        mok_fraction = [fraction_of_dense(e, record) or 0.0 for e in entries]
        base_fraction = []
        for e, (_, ms, _) in zip(entries, fastest):
            value = e.get("baseline_fraction_of_dense")
            dense = e.get("dense_gemm_tflops") or dense_rate
            if value is None and e.get("baseline_tflops") and dense:
                value = e["baseline_tflops"] / dense
            if ms and ms != e.get("baseline_ms"):  # an FP8 entry's bf16 baseline: the same FLOPs
                mok_fraction_of_dense = fraction_of_dense(e, record)  # and dense rate as mok's
                value = mok_fraction_of_dense * e["mok_ms"] / ms if mok_fraction_of_dense else None
            base_fraction.append(value or 0.0)
        bottom.bar([p - 0.2 for p in positions], mok_fraction, width=0.4, label="mok")
        bottom.bar([p + 0.2 for p in positions], base_fraction, width=0.4, label="fastest baseline")
        bottom.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="dense bf16 GEMM rate")
        bottom.set_ylim(0, 1.15)
        for axis in (top, bottom):
            axis.set_xlim(-0.7, max(len(positions), 2) - 0.3)
            axis.set_xticks(positions)
            axis.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
            axis.grid(axis="y", alpha=0.3)
        if column == 0:
            top.set_ylabel("ms per rank (lower is better)")
            bottom.set_ylabel("useful TFLOP/s ÷ dense GEMM rate")
            top.legend(fontsize=7, loc="upper left")
            bottom.legend(fontsize=7, loc="lower left")
    cap = record.get("power_limit_w") or DEFAULT_POWER_CAP_W
    heading = f"{run_line(record)}; GPUs at their {cap:.0f} W power cap"
    figure.suptitle(textwrap.fill(heading, int(12 * min(sum(widths), 26))), fontsize=9)
    figure.tight_layout()
    return figure


def chart_comm(plt, record):
    """GB/s against SMs per copy method and phase, torch's all_to_all_single as a line."""
    phases = sorted({e["phase"] for e in record["cases"]}, reverse=True)  # dispatch, combine
    figure, axes = plt.subplots(1, len(phases), figsize=(5.5 * len(phases), 4.2), sharey=True,
                                squeeze=False)
    for axis, phase in zip(axes[0], phases):
        entries = [e for e in record["cases"] if e["phase"] == phase]
        for method, style in zip(sorted({e.get("method", "") for e in entries}), ("o-", "s-", "^-", "d-", "v-")):
            points = sorted((e for e in entries if e.get("method", "") == method),
                            key=lambda e: e.get("num_sms", 0))
            axis.plot([e.get("num_sms", 0) for e in points], [e["gbps"] for e in points], style,
                      label=f"mok {method}")
        baselines = [e for e in entries if e.get("baseline_ms")]
        if baselines:  # the same bytes: GB/s scale with the time
            e = baselines[0]
            axis.axhline(e["gbps"] * e["mok_ms"] / e["baseline_ms"], color="gray", linestyle="--",
                         label="torch all_to_all_single")
        axis.axhline(COMM_TARGET_GBPS, color="red", linestyle=":", label=f"target {COMM_TARGET_GBPS} GB/s")
        axis.set_title(f"{phase} ({'pull' if phase == 'dispatch' else 'push'}), both directions at once"
                       if phase in ("dispatch", "combine") else phase)
        axis.set_xlabel("SMs moving rows")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s per direction (NVLink payload)")
    axes[0][0].legend(fontsize=8)
    figure.suptitle(run_line(record), fontsize=9)
    figure.tight_layout()
    return figure


def main(argv=None):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", default=os.path.join(root, "bench", "results"))
    parser.add_argument("--png-dir", help="where the charts go (default --results-dir)")
    parser.add_argument("--kinds", help=f"comma-separated benchmarks, or all (default {','.join(ROWS)})")
    parser.add_argument("--no-png", action="store_true", help="no charts (no matplotlib needed)")
    parser.add_argument("--no-table", action="store_true", help="no table on stdout")
    parser.add_argument("--readme", help="replace the text between the perf-table markers there")
    args = parser.parse_args(argv)
    kinds = None if args.kinds == "all" else set((args.kinds or ",".join(ROWS)).split(","))
    latest = latest_results(args.results_dir, kinds)
    if not latest:
        print(f"no mok-bench results in {args.results_dir}", file=sys.stderr)
        return 1
    png_paths = {}
    if not args.no_png:
        png_dir = args.png_dir or args.results_dir
        os.makedirs(png_dir, exist_ok=True)
        for kind, (_, record) in latest.items():
            png_paths[kind] = os.path.join(png_dir, f"{kind}.png")
            chart(kind, record, png_paths[kind])
    readme_dir = os.path.dirname(os.path.abspath(args.readme)) if args.readme else os.getcwd()
    text = report_text(latest, png_paths, readme_dir)
    if not args.no_table:
        print(text, end="")
    if args.readme and not replace_in_readme(args.readme, text):
        print(f"{args.readme}: no {BEGIN_MARKER} ... {END_MARKER} markers; left as it is",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
