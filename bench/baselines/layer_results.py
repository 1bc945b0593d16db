"""The layer benchmark's results: bench_layer's figures beside the fastest torch-native variant of
the same run, as one JSON in schema mok-bench/2 (DESIGN.md §5).

  python3 layer_results.py --mok layer-mok.json --torch layer-torch-ep1.json \\
      --torch layer-torch-ep2.json --commit C --out layer.json
  python3 layer_results.py --mok layer-mok.json --torch layer-torch-ep1.json \\
      --mok-fp8 layer-mok-fp8.json --torch-fp8 layer-torch-fp8-ep1.json --commit C --out layer.json
then `python3 bench/report.py` draws the chart and the README table from it.

Inputs: bench_layer's --out JSON (`date`, `cases`: each with name, preset, ep, tokens_per_rank,
hidden, intermediate, shared_intermediate, num_experts, top_k, mok_ms, buffer_bytes_per_rank, and
where bench_layer timed mok's backward too fwdbwd_ms, backward_ms and
backward_buffer_bytes_per_rank) and torch_native.py measure's JSONs (one per EP).

Per case and phase (fwd: mok_ms; fwdbwd: fwdbwd_ms; bwd: backward_ms, the backward's save mode
where bench_layer timed it; a phase only where mok has a figure for it) one entry: name, preset,
ep, tokens_per_rank, precision, phase, mok_ms, mok_context ("save" or "recompute", fwdbwd and bwd),
mok_recompute_ms (recompute mode's time beside save mode's), mok_low_memory_ms, mok_low_memory_gb
and mok_low_memory_same_bits (the low-memory backward's time, memory as peak_memory_gb's mok, and
whether its outputs had save mode's bits, where bench_layer --chunked-backward ran it; else None),
saved_context_bytes_per_token and
baseline_saved_bytes_per_token (what autograd keeps: mok's context, torch's saved tensors), baseline
(the fastest checked torch-native variant's name), baseline_ms, baseline_variants (every timed
variant's ms), speedup = baseline_ms / mok_ms, useful_tflops (mok's: 6·T·H·(k·I + I_s) per rank for
fwd, 3x for fwdbwd, 2x for bwd), baseline_tflops, fraction_of_dense (mok's useful TFLOP/s / the
dense bf16 GEMM rate of the same run), baseline_fraction_of_dense, peak_memory_gb {mok, baseline}
and memory_note, clock_mhz and power_w (medians sampled during the fastest variant's timed loop;
mok_clock_mhz / mok_power_w: bench_layer's own, over the forward loop for fwd and the save mode
pairs for fwdbwd and bwd, None where it sampled none), dense_gemm_tflops. The baseline's
figures for phases mok has none for yet go to `baseline_without_mok`, and every variant's check to
`baseline_checks`.

FP8 (issue 24), with --mok-fp8 (bench_layer --precision fp8: the same case fields, mok_ms its
FP8 forward, bf16_forward_ms its bf16 forward in the same process, weight_quantize_ms; with
--backward 1 also fwdbwd_ms, its FP8 training step (the weights quantized to e4m3 in both layouts +
FP8 forward + FP8 backward: an optimizer step changes the weights every step),
fwdbwd_cached_weights_ms, the same step on weights quantized before (forward + backward: a
gradient-accumulation step after the first), backward_ms, its FP8 backward, all in save mode
(context "save"; fwdbwd_recompute_ms and backward_recompute_ms recompute mode's), and
bf16_fwdbwd_ms, bf16_backward_ms, its bf16 ones in save mode) and --torch-fp8 (torch_native.py
measure --precision fp8, forwards only): per case and phase (as above; fwdbwd and bwd where bench_layer
timed them) one more entry after the bf16 ones, precision "fp8", named as the case with "-fp8"
appended (unless its name says fp8 already) so that tables keyed by name keep both precisions
apart; the baseline is the fastest checked torch-native FP8 variant of that phase (activation
quantization inside its forward, weight quantization apart; today none for fwdbwd and bwd:
torch_native.py times FP8 forwards only, so their speedup is None), fraction_of_dense and
dense_gemm_tflops against the dense FP8 GEMM rate of the torch FP8 run, mok's memory in fwdbwd
and bwd with the bf16 weights and both e4m3 layouts, and besides: mok_bf16_ms (bf16_forward_ms,
bf16_fwdbwd_ms, bf16_backward_ms), vs_mok_bf16 = mok_bf16_ms / mok_ms (mok's FP8 layer's speedup
over its own bf16 one), mok_bf16_context ("save" for fwdbwd and bwd), mok_weight_quantize_ms
(inside fwdbwd's mok_ms, outside fwd's and bwd's), baseline_weight_quantize_ms, for fwdbwd
mok_cached_weights_ms (fwdbwd_cached_weights_ms) and vs_mok_bf16_cached_weights (mok_bf16_ms over
it), and the fastest
torch-native bf16 variant of the same case and phase (--torch; the case's name without "-fp8") as
baseline_bf16, baseline_bf16_ms and speedup_vs_baseline_bf16, since torch's FP8 layer is not
always faster than its bf16 one (bench/report.py shows the faster of the two). Without --mok-fp8
the record is the bf16 one alone, unchanged.
"""
import argparse
import datetime
import json
import os

PHASES = (("fwd", "mok_ms"), ("fwdbwd", "fwdbwd_ms"), ("bwd", "backward_ms"))
# The same phases in the backward's recompute mode, reported beside save mode's (mok_recompute_ms).
RECOMPUTE_KEYS = {"fwdbwd": "fwdbwd_recompute_ms", "bwd": "backward_recompute_ms"}
# And in the low-memory backward (bench_layer --chunked-backward: save mode, the routed experts in
# chunks), reported beside save mode's (mok_low_memory_ms).
LOW_MEMORY_KEYS = {"fwdbwd": "fwdbwd_chunked_ms", "bwd": "backward_chunked_ms"}
FLOP_FACTOR = {"fwd": 1, "fwdbwd": 3, "bwd": 2}
# An fp8 case's bf16 figure of each phase (mok's bf16 layer in the same process; save mode).
FP8_BF16_KEYS = {"fwd": "bf16_forward_ms", "fwdbwd": "bf16_fwdbwd_ms", "bwd": "bf16_backward_ms"}
# What a baseline_without_mok entry keeps of a case entry.
BASELINE_ONLY_KEYS = ("name", "preset", "ep", "tokens_per_rank", "precision", "phase", "baseline",
                      "baseline_ms", "baseline_variants", "baseline_tflops",
                      "baseline_fraction_of_dense", "clock_mhz", "power_w")
MEMORY_NOTE = ("mok: bench_layer's buffers per rank (buffer_bytes_per_rank{backward}) plus the {kind}"
               "weights of this rank's experts and the shared expert ({weights}); baseline: "
               "torch.cuda.max_memory_allocated over one call of the phase ({baseline_weights}, x, "
               "routing, activations{grads})")
# (mok's weights, the baseline's) as the memory note names them, per precision
MEMORY_NOTE_WEIGHTS = {"bf16": ("bf16 ", "weights"),
                       "fp8": ("", "bf16 weights and their e4m3 copy with scales")}


def forward_flops(case):
    """Useful FLOPs of one rank's forward: 6·T·H·(k·I + I_s)."""
    return (6.0 * case["tokens_per_rank"] * case["hidden"]
            * (case["top_k"] * case["intermediate"] + case["shared_intermediate"]))


def weight_bytes(case, precision="bf16", phase="fwd"):
    """(bytes, note) of one rank's weights: E_l·3·I·H routed, 3·H·I_s shared; bf16, or for fp8
    e4m3 (the forward's layout) in the forward and in the training step the bf16 weights it
    quantizes from beside their e4m3 copies in both layouts."""
    local = case["num_experts"] // case["ep"]
    elements = (local * 3 * case["intermediate"] * case["hidden"]
                + 3 * case["hidden"] * case["shared_intermediate"])
    if precision == "fp8" and phase == "fwd":
        # (bench_layer's weight_bytes_per_rank, where an fp8 case has it, is the bf16 weights')
        return elements, "computed from the shape: (E_l·3·I·H + 3·H·I_s)·1 byte of e4m3, scales left out"
    if case.get("weight_bytes_per_rank") is not None:
        bf16, bf16_note = case["weight_bytes_per_rank"], "bench_layer's weight_bytes_per_rank"
    else:
        bf16, bf16_note = 2 * elements, "computed from the shape: (E_l·3·I·H + 3·H·I_s)·2 bytes"
    if precision != "fp8":
        return bf16, bf16_note
    if case.get("fp8_weight_bytes_per_rank") is not None:
        fp8, fp8_note = (case["fp8_weight_bytes_per_rank"],
                         "bench_layer's fp8_weight_bytes_per_rank: both layouts with their scales")
    else:
        fp8, fp8_note = (2 * elements, "computed from the shape: both layouts, "
                         "2·(E_l·3·I·H + 3·H·I_s)·1 byte, scales left out")
    return bf16 + fp8, f"bf16: {bf16_note}; e4m3: {fp8_note}"


def mok_memory(case, phase, precision="bf16"):
    """(GB, note) of mok's memory per rank in `phase`; GB None where bench_layer gave no figure."""
    weights, weights_note = weight_bytes(case, precision, phase)
    buffers = case.get("buffer_bytes_per_rank")
    backward_note = ""
    if phase != "fwd":
        backward = case.get("backward_buffer_bytes_per_rank")
        context = case.get("saved_context_bytes_per_rank", 0)
        backward_note = " + backward_buffer_bytes_per_rank + saved_context_bytes_per_rank"
        buffers = None if buffers is None or backward is None else buffers + backward + context
    kind, baseline_weights = MEMORY_NOTE_WEIGHTS[precision]
    note = MEMORY_NOTE.format(backward=backward_note, kind=kind, weights=weights_note,
                              baseline_weights=baseline_weights,
                              grads="" if phase == "fwd" else ", weight gradients")
    if phase != "fwd":
        note += ("; mok's weight gradients count as far as its backward buffers hold them")
    return (None if buffers is None else round((buffers + weights) / 1e9, 3)), note


def low_memory_gb(case, phase, precision="bf16"):
    """mok_memory's GB with the low-memory backward's buffers in place of save mode's backward's;
    None for fwd and where bench_layer did not run it."""
    chunked = case.get("backward_chunked_buffer_bytes_per_rank")
    if phase == "fwd" or chunked is None:
        return None
    return mok_memory(dict(case, backward_buffer_bytes_per_rank=chunked), phase, precision)[0]


def load_torch(paths, precision="bf16"):
    """(cases by (name, ep), run info) from torch_native.py measure's JSONs of `precision`; the
    dense GEMM rate is the one of that precision (dense_gemm, or dense_gemm_fp8)."""
    cases, info = {}, {"dense": None, "device": None, "torch": None, "power_limit_w": None}
    for path in paths:
        if not os.path.exists(path):
            print(f"note: {path} missing (that baseline run failed); its cases have no baseline")
            continue
        with open(path) as file:
            data = json.load(file)
        found = data.get("precision", "bf16")
        if found != precision:
            raise SystemExit(f"{path}: precision '{found}', expected '{precision}' "
                             f"({'--torch-fp8' if found == 'fp8' else '--torch'} takes it)")
        for name, case in data["cases"].items():
            cases[(name, data["ep"])] = case
        dense = data.get("dense_gemm_fp8" if precision == "fp8" else "dense_gemm")
        if dense and info["dense"] is None:
            info["dense"] = dense
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


def mok_sampled(case, key, phase):
    """bench_layer's median clock or power over the timed loop behind `phase` (its `clock_mhz` and
    `power_w` per phase), None where it sampled none."""
    value = case.get(key)
    return value.get(phase) if isinstance(value, dict) else value


def entry_for(case, phase, mok_ms, torch_case, dense_tflops, precision="bf16"):
    """One mok-bench/2 case entry (see the module docstring)."""
    loop = "fwd" if phase == "fwd" else "fwdbwd"  # the timed loop bwd's figures come from
    fastest, variant, variants = baseline_figures(torch_case or {}, phase)
    baseline_ms = variants.get(fastest)
    flops = FLOP_FACTOR[phase] * forward_flops(case)
    useful = flops / (mok_ms * 1e-3) / 1e12 if mok_ms else None
    baseline_tflops = flops / (baseline_ms * 1e-3) / 1e12 if baseline_ms else None
    mok_gb, note = mok_memory(case, phase, precision)
    return {
        "name": case["name"],
        "preset": case["preset"],
        "ep": case["ep"],
        "tokens_per_rank": case["tokens_per_rank"],
        "precision": precision,
        "phase": phase,
        "routing": case.get("routing"),
        "mok_variant": "unfused" if case.get("fused") is False else "fused",
        "mok_ms": rounded(mok_ms, 4),
        # the backward's context mode, and its recompute mode's time beside save mode's
        "mok_context": case.get("context", "recompute") if phase != "fwd" else None,
        "mok_recompute_ms": rounded(case.get(RECOMPUTE_KEYS.get(phase, "")), 4),
        "mok_low_memory_ms": rounded(case.get(LOW_MEMORY_KEYS.get(phase, "")), 4),
        "mok_low_memory_gb": low_memory_gb(case, phase, precision),
        "mok_low_memory_same_bits": case.get("chunked_same_bits") if phase != "fwd" else None,
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
        "mok_clock_mhz": mok_sampled(case, "clock_mhz", phase),
        "mok_power_w": mok_sampled(case, "power_w", phase),
        "gbps": None,
        "dense_gemm_tflops": dense_tflops,
    }


def fp8_name(name):
    return name if "fp8" in name else f"{name}-fp8"


def fp8_entry(case, phase, mok_ms, torch_case, bf16_torch_case, dense_tflops):
    """One FP8 entry of `phase` (see the module docstring)."""
    entry = entry_for(case, phase, mok_ms, torch_case, dense_tflops, precision="fp8")
    bf16_ms = case.get(FP8_BF16_KEYS[phase])
    bf16_baseline, _, bf16_variants = baseline_figures(bf16_torch_case or {}, phase)
    bf16_baseline_ms = bf16_variants.get(bf16_baseline)
    entry.update({
        "name": fp8_name(case["name"]),
        "mok_bf16_ms": rounded(bf16_ms, 4),
        "vs_mok_bf16": round(bf16_ms / mok_ms, 3) if bf16_ms and mok_ms else None,
        "mok_weight_quantize_ms": rounded(case.get("weight_quantize_ms"), 4),
        "baseline_weight_quantize_ms": rounded((torch_case or {}).get("weight_quantize_ms"), 4),
        "baseline_bf16": bf16_baseline,
        "baseline_bf16_ms": bf16_baseline_ms,
        "speedup_vs_baseline_bf16": (round(bf16_baseline_ms / mok_ms, 3)
                                     if bf16_baseline_ms and mok_ms else None),
    })
    if phase != "fwd":  # mok's bf16 step beside the fp8 one (recompute mode) is save mode's
        entry["mok_bf16_context"] = "save"
    cached_ms = case.get("fwdbwd_cached_weights_ms") if phase == "fwdbwd" else None
    if cached_ms:
        entry["mok_cached_weights_ms"] = rounded(cached_ms, 4)
        entry["vs_mok_bf16_cached_weights"] = round(bf16_ms / cached_ms, 3) if bf16_ms else None
    return entry


def fp8_entries(mok_fp8, torch_cases, bf16_torch_cases, info):
    """(entries, baseline-only entries, checks) of the FP8 cases: per case its forward and, where
    bench_layer timed it, its training step and backward."""
    dense_tflops = (info["dense"] or {}).get("tflops")
    entries, baseline_only, checks = [], [], {}
    for case in mok_fp8["cases"]:
        torch_case = torch_cases.get((case["name"], case["ep"]))
        bf16_name = case["name"].removesuffix("-fp8")
        bf16_torch_case = bf16_torch_cases.get((bf16_name, case["ep"]))
        if torch_case and "variants" in torch_case:
            checks[fp8_name(case["name"])] = {name: v["check"]
                                              for name, v in torch_case["variants"].items()}
        for phase, key in PHASES:
            if case.get(key) is not None:
                entries.append(fp8_entry(case, phase, case[key], torch_case, bf16_torch_case,
                                         dense_tflops))
            elif torch_case and baseline_figures(torch_case, phase)[0]:
                entry = fp8_entry(case, phase, None, torch_case, bf16_torch_case, dense_tflops)
                baseline_only.append({key: entry[key] for key in BASELINE_ONLY_KEYS}
                                     | {"baseline_peak_memory_gb": entry["peak_memory_gb"]["baseline"]})
    return entries, baseline_only, checks


def combine(mok, torch_cases, info, commit, fp8=None):
    """The mok-bench/2 record of one device run; `fp8`, where given, is (bench_layer's FP8 JSON,
    its torch cases, their run info) and adds the FP8 entries."""
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
                baseline_only.append({key: entry[key] for key in BASELINE_ONLY_KEYS}
                                     | {"baseline_peak_memory_gb": entry["peak_memory_gb"]["baseline"]})
    extra = {}
    if fp8 is not None:
        mok_fp8, fp8_torch_cases, fp8_info = fp8
        more, more_baseline_only, more_checks = fp8_entries(mok_fp8, fp8_torch_cases, torch_cases,
                                                            fp8_info)
        entries += more
        baseline_only += more_baseline_only
        checks |= more_checks
        dense_fp8 = fp8_info["dense"] or {}
        extra = {
            "dense_gemm_fp8_tflops": dense_fp8.get("tflops"),
            "dense_gemm_fp8": ({key: dense_fp8.get(key) for key in ("ms", "clock_mhz", "power_w")}
                               if dense_fp8 else None),
            "fp8_baseline_note": ("fp8 entries: baseline = the fastest of the torch-native rowwise "
                                  "FP8 variants (torch._scaled_grouped_mm, one scale per row; the "
                                  "activations' quantization inside the timed forward, the weights' "
                                  "once before, as baseline_weight_quantize_ms), each checked "
                                  "against the fp32 reference at FP8 tolerance; fraction_of_dense "
                                  "against the dense FP8 GEMM rate (rowwise torch._scaled_mm "
                                  "8192^3) of that run"),
        }
        if any(entry["phase"] != "fwd" for entry in more):
            extra["fp8_baseline_note"] += ("; torch-native has no FP8 training step: the fp8 "
                                           "fwdbwd and bwd entries' baseline is None, their "
                                           "baseline_bf16 torch's bf16 layer")
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
        **extra,
    }


def print_table(record):
    print(f"{'case':28s} {'phase':7s} {'mok ms':>9s} {'baseline ms':>12s} {'variant':16s} "
          f"{'speedup':>8s} {'of dense':>9s}")
    for entry in record["cases"]:
        baseline = f"{entry['baseline_ms']:12.3f}" if entry["baseline_ms"] else f"{'n/a':>12s}"
        speedup = f"{entry['speedup']:7.2f}x" if entry["speedup"] else f"{'n/a':>8s}"
        fraction = f"{entry['fraction_of_dense']:9.3f}" if entry["fraction_of_dense"] else f"{'n/a':>9s}"
        versus_bf16 = (f"  mok bf16 {entry['mok_bf16_ms']:.3f} ms: {entry['vs_mok_bf16']:.2f}x"
                       if entry.get("vs_mok_bf16") else "")
        if entry.get("speedup_vs_baseline_bf16"):
            versus_bf16 += (f"  torch bf16 {entry['baseline_bf16_ms']:.3f} ms: "
                            f"{entry['speedup_vs_baseline_bf16']:.2f}x")
        print(f"{entry['name']:28s} {entry['phase']:7s} {entry['mok_ms']:9.3f} {baseline} "
              f"{entry['baseline'] or '':16s} {speedup} {fraction}{versus_bf16}")
    for entry in record["baseline_without_mok"]:
        print(f"{entry['name']:28s} {entry['phase']:7s} {'(no mok)':>9s} {entry['baseline_ms']:12.3f} "
              f"{entry['baseline']:16s}")


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mok", required=True, help="bench_layer's --out JSON")
    parser.add_argument("--torch", action="append", default=[],
                        help="torch_native.py measure's --out JSON (once per EP)")
    parser.add_argument("--mok-fp8", help="bench_layer --precision fp8's --out JSON (FP8 forward; "
                        "with --backward 1 the FP8 training step too)")
    parser.add_argument("--torch-fp8", action="append", default=[],
                        help="torch_native.py measure --precision fp8's --out JSON")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--out", required=True, help="the results JSON (mok-bench/2)")
    args = parser.parse_args()
    with open(args.mok) as file:
        mok = json.load(file)
    torch_cases, info = load_torch(args.torch)
    fp8 = None
    if args.mok_fp8 and not os.path.exists(args.mok_fp8):
        print(f"note: {args.mok_fp8} missing (bench_layer's FP8 run failed); no FP8 entries")
    elif args.mok_fp8:
        with open(args.mok_fp8) as file:
            fp8 = (json.load(file), *load_torch(args.torch_fp8, precision="fp8"))
    elif args.torch_fp8:
        raise SystemExit("--torch-fp8: needs --mok-fp8 (bench_layer's FP8 cases)")
    record = combine(mok, torch_cases, info, args.commit, fp8)
    with open(args.out, "w") as file:
        json.dump(record, file, indent=2)
    print_table(record)


if __name__ == "__main__":
    main()
