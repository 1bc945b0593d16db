"""The layer benchmark's results: bench_layer's figures beside the fastest torch-native variant of
the same run, as one JSON in schema mok-bench/2 (DESIGN.md §5).

  python3 layer_results.py --mok layer-mok.json --torch layer-torch-ep1.json \\
      --torch layer-torch-ep2.json --commit C --out layer.json
then `python3 bench/report.py` draws the chart and the README table from it.

Inputs: bench_layer's --out JSON (`date`, `cases`: each with name, preset, ep, tokens_per_rank,
hidden, intermediate, shared_intermediate, num_experts, top_k, mok_ms, buffer_bytes_per_rank, and
where bench_layer timed mok's backward too fwdbwd_ms, backward_ms and
backward_buffer_bytes_per_rank) and torch_native.py measure's JSONs (one per EP).

Per case and phase (fwd: mok_ms; fwdbwd: fwdbwd_ms; bwd: backward_ms, the backward's save mode
where bench_layer timed it; a phase only where mok has a figure for it) one entry: name, preset,
ep, tokens_per_rank, precision, phase, mok_ms, mok_context ("save" or "recompute", fwdbwd and bwd),
mok_recompute_ms (recompute mode's time beside save mode's), saved_context_bytes_per_token and
baseline_saved_bytes_per_token (what autograd keeps: mok's context, torch's saved tensors), baseline
(the fastest checked torch-native variant's name), baseline_ms, baseline_variants (every timed
variant's ms), speedup = baseline_ms / mok_ms, useful_tflops (mok's: 6·T·H·(k·I + I_s) per rank for
fwd, 3x for fwdbwd, 2x for bwd), baseline_tflops, fraction_of_dense (mok's useful TFLOP/s / the
dense bf16 GEMM rate of the same run), baseline_fraction_of_dense, peak_memory_gb {mok, baseline}
and memory_note, clock_mhz and power_w (medians sampled during the fastest variant's timed loop;
mok_clock_mhz / mok_power_w where bench_layer sampled its own), dense_gemm_tflops. The baseline's
figures for phases mok has none for yet go to `baseline_without_mok`, and every variant's check to
`baseline_checks`.
"""
import argparse
import datetime
import json
import os

PHASES = (("fwd", "mok_ms"), ("fwdbwd", "fwdbwd_ms"), ("bwd", "backward_ms"))
# The same phases in the backward's recompute mode, reported beside save mode's (mok_recompute_ms).
RECOMPUTE_KEYS = {"fwdbwd": "fwdbwd_recompute_ms", "bwd": "backward_recompute_ms"}
FLOP_FACTOR = {"fwd": 1, "fwdbwd": 3, "bwd": 2}
MEMORY_NOTE = ("mok: bench_layer's buffers per rank (buffer_bytes_per_rank{backward}) plus the bf16 "
               "weights of this rank's experts and the shared expert ({weights}); baseline: "
               "torch.cuda.max_memory_allocated over one call of the phase (weights, x, routing, "
               "activations{grads})")


def forward_flops(case):
    """Useful FLOPs of one rank's forward: 6·T·H·(k·I + I_s)."""
    return (6.0 * case["tokens_per_rank"] * case["hidden"]
            * (case["top_k"] * case["intermediate"] + case["shared_intermediate"]))


def weight_bytes(case):
    """bf16 bytes of one rank's weights: E_l·3·I·H routed, 3·H·I_s shared."""
    if case.get("weight_bytes_per_rank") is not None:
        return case["weight_bytes_per_rank"], "bench_layer's weight_bytes_per_rank"
    local = case["num_experts"] // case["ep"]
    elements = (local * 3 * case["intermediate"] * case["hidden"]
                + 3 * case["hidden"] * case["shared_intermediate"])
    return 2 * elements, "computed from the shape: (E_l·3·I·H + 3·H·I_s)·2 bytes"


def mok_memory(case, phase):
    """(GB, note) of mok's memory per rank in `phase`; GB None where bench_layer gave no figure."""
    weights, weights_note = weight_bytes(case)
    buffers = case.get("buffer_bytes_per_rank")
    backward_note = ""
    if phase != "fwd":
        backward = case.get("backward_buffer_bytes_per_rank")
        context = case.get("saved_context_bytes_per_rank", 0)
        backward_note = " + backward_buffer_bytes_per_rank + saved_context_bytes_per_rank"
        buffers = None if buffers is None or backward is None else buffers + backward + context
    note = MEMORY_NOTE.format(backward=backward_note, weights=weights_note,
                              grads="" if phase == "fwd" else ", weight gradients")
    if phase != "fwd":
        note += ("; mok's weight gradients count as far as its backward buffers hold them")
    return (None if buffers is None else round((buffers + weights) / 1e9, 3)), note


def load_torch(paths):
    """(cases by (name, ep), run info) from torch_native.py measure's JSONs."""
    cases, info = {}, {"dense": None, "device": None, "torch": None, "power_limit_w": None}
    for path in paths:
        if not os.path.exists(path):
            print(f"note: {path} missing (that baseline run failed); its cases have no baseline")
            continue
        with open(path) as file:
            data = json.load(file)
        for name, case in data["cases"].items():
            cases[(name, data["ep"])] = case
        if data.get("dense_gemm") and info["dense"] is None:
            info["dense"] = data["dense_gemm"]
        for key in ("device", "torch", "power_limit_w"):
            info[key] = info[key] or data.get(key)
    return cases, info


def baseline_figures(torch_case, phase):
    """(fastest variant, its entry, {variant: ms}) of one case and phase; (None, None, {})
    where no variant was timed."""
    variants = {name: round(entry[f"{phase}_ms"], 4)
                for name, entry in torch_case.get("variants", {}).items() if f"{phase}_ms" in entry}
    if not variants:
        return None, None, {}
    fastest = min(variants, key=variants.get)
    return fastest, torch_case["variants"][fastest], variants


def rounded(value, digits):
    return None if value is None else round(value, digits)


def entry_for(case, phase, mok_ms, torch_case, dense_tflops):
    """One mok-bench/2 case entry (see the module docstring)."""
    loop = "fwd" if phase == "fwd" else "fwdbwd"  # the timed loop bwd's figures come from
    fastest, variant, variants = baseline_figures(torch_case or {}, phase)
    baseline_ms = variants.get(fastest)
    flops = FLOP_FACTOR[phase] * forward_flops(case)
    useful = flops / (mok_ms * 1e-3) / 1e12 if mok_ms else None
    baseline_tflops = flops / (baseline_ms * 1e-3) / 1e12 if baseline_ms else None
    mok_gb, note = mok_memory(case, phase)
    return {
        "name": case["name"],
        "preset": case["preset"],
        "ep": case["ep"],
        "tokens_per_rank": case["tokens_per_rank"],
        "precision": "bf16",
        "phase": phase,
        "routing": case.get("routing"),
        "mok_variant": "unfused" if case.get("fused") is False else "fused",
        "mok_ms": rounded(mok_ms, 4),
        # the backward's context mode, and its recompute mode's time beside save mode's
        "mok_context": case.get("context", "recompute") if phase != "fwd" else None,
        "mok_recompute_ms": rounded(case.get(RECOMPUTE_KEYS.get(phase, "")), 4),
        "saved_context_bytes_per_token": (
            round(case["saved_context_bytes_per_rank"] / case["tokens_per_rank"])
            if phase != "fwd" and case.get("saved_context_bytes_per_rank") else None),
        "baseline_saved_bytes_per_token": (variant or {}).get("saved_bytes_per_token"),
        "baseline": fastest,
        "baseline_ms": baseline_ms,
        "baseline_variants": variants,
        "speedup": round(baseline_ms / mok_ms, 3) if baseline_ms and mok_ms else None,
        "useful_tflops": rounded(useful, 2),
        "baseline_tflops": rounded(baseline_tflops, 2),
        "tokens_per_s_per_gpu": round(case["tokens_per_rank"] / (mok_ms * 1e-3)) if mok_ms else None,
        "fraction_of_dense": round(useful / dense_tflops, 4) if useful and dense_tflops else None,
        "baseline_fraction_of_dense": (round(baseline_tflops / dense_tflops, 4)
                                       if baseline_tflops and dense_tflops else None),
        "peak_memory_gb": {"mok": mok_gb,
                           "baseline": (variant or {}).get("peak_memory_gb", {}).get(loop)},
        "memory_note": note,
        "clock_mhz": (variant or {}).get("clock_mhz", {}).get(loop),
        "power_w": (variant or {}).get("power_w", {}).get(loop),
        "mok_clock_mhz": case.get("clock_mhz"),
        "mok_power_w": case.get("power_w"),
        "gbps": None,
        "dense_gemm_tflops": dense_tflops,
    }


def combine(mok, torch_cases, info, commit):
    """The mok-bench/2 record of one device run."""
    dense = info["dense"] or {}
    dense_tflops = dense.get("tflops")
    entries, baseline_only, checks = [], [], {}
    for case in mok["cases"]:
        torch_case = torch_cases.get((case["name"], case["ep"]))
        if torch_case and "variants" in torch_case:
            checks[case["name"]] = {name: v["check"] for name, v in torch_case["variants"].items()}
        for phase, key in PHASES:
            mok_ms = case.get(key)
            if mok_ms is not None:
                entries.append(entry_for(case, phase, mok_ms, torch_case, dense_tflops))
            elif torch_case and baseline_figures(torch_case, phase)[0]:
                entry = entry_for(case, phase, None, torch_case, dense_tflops)
                baseline_only.append({key: entry[key] for key in (
                    "name", "preset", "ep", "tokens_per_rank", "precision", "phase", "baseline",
                    "baseline_ms", "baseline_variants", "baseline_tflops",
                    "baseline_fraction_of_dense", "clock_mhz", "power_w")}
                    | {"baseline_peak_memory_gb": entry["peak_memory_gb"]["baseline"]})
    return {
        "schema": "mok-bench/2",
        "benchmark": "layer",
        "commit": commit,
        "device": info["device"] or "unknown",
        "date": mok.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": info["torch"],
        "power_limit_w": info["power_limit_w"],
        "dense_gemm_tflops": dense_tflops,
        "dense_gemm": {key: dense.get(key) for key in ("ms", "clock_mhz", "power_w")} if dense else None,
        "baseline_note": ("baseline = the fastest of the torch-native variants "
                          "(bench/baselines/torch_native.py), each checked against an fp32 "
                          "reference and the first variant before it was timed"),
        "cases": entries,
        "baseline_without_mok": baseline_only,
        "baseline_checks": checks,
    }


def print_table(record):
    print(f"{'case':28s} {'phase':7s} {'mok ms':>9s} {'baseline ms':>12s} {'variant':16s} "
          f"{'speedup':>8s} {'of dense':>9s}")
    for entry in record["cases"]:
        baseline = f"{entry['baseline_ms']:12.3f}" if entry["baseline_ms"] else f"{'n/a':>12s}"
        speedup = f"{entry['speedup']:7.2f}x" if entry["speedup"] else f"{'n/a':>8s}"
        fraction = f"{entry['fraction_of_dense']:9.3f}" if entry["fraction_of_dense"] else f"{'n/a':>9s}"
        print(f"{entry['name']:28s} {entry['phase']:7s} {entry['mok_ms']:9.3f} {baseline} "
              f"{entry['baseline'] or '':16s} {speedup} {fraction}")
    for entry in record["baseline_without_mok"]:
        print(f"{entry['name']:28s} {entry['phase']:7s} {'(no mok)':>9s} {entry['baseline_ms']:12.3f} "
              f"{entry['baseline']:16s}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mok", required=True, help="bench_layer's --out JSON")
    parser.add_argument("--torch", action="append", default=[],
                        help="torch_native.py measure's --out JSON (once per EP)")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", required=True, help="the results JSON (mok-bench/2)")
    args = parser.parse_args()
    with open(args.mok) as file:
        mok = json.load(file)
    torch_cases, info = load_torch(args.torch)
    record = combine(mok, torch_cases, info, args.commit)
    with open(args.out, "w") as file:
        json.dump(record, file, indent=2)
    print_table(record)


if __name__ == "__main__":
    main()
