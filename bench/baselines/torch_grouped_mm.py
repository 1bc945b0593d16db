"""torch baseline for the grouped expert GEMMs, measured in the same device run as mok's.

Reads mok's per-case figures (bench_gemm --out), times the torch equivalent of every case and the
dense bf16 GEMM rate (8192^3), and writes bench/results JSON in schema mok-bench/1.

  forward  torch._grouped_mm(x, W.transpose(-2, -1), offs=offs)   y = x W^T per expert
  dgrad    torch._grouped_mm(dy, W, offs=offs)                    dx = dy W per expert
  wgrad    torch._grouped_mm(dy.t(), x, offs=offs)                dW = dy^T x per expert
The SwiGLU-fused case is compared with the plain torch gate/up GEMM (torch has no fused one).
mok runs every case on each engine (cooperative, ping-pong); torch is timed once per case and
each engine's figure is set beside it.
Median of >= 20 CUDA-event-timed iterations after 300 ms of warm-up, on random data drawn as
bench_gemm draws its own (data.py: uniform, activations in [-1, 1), weights in [-0.05, 0.05)); mok's and
torch's figures are each the mean over passes (mok before and after torch, torch twice), since
the clocks drift under the power cap during a run.
"""
import argparse
import datetime
import json
import subprocess

import torch

from data import uniform  # bench/baselines/data.py: bench_gemm's distributions
from timing import median_ms  # bench/baselines/timing.py, beside this script

# Each case runs untimed this long first, as bench_gemm's cases do (--warmup-ms there).
WARMUP_MS = 300


def dense_tflops(iterations):
    size = 8192
    a = uniform(size, size)
    b = uniform(size, size)
    ms = median_ms(lambda: a @ b, iterations, warmup_ms=WARMUP_MS)
    return 2 * size**3 / ms / 1e9


def torch_case(case, iterations):
    experts, rows, n, k = case["num_experts"], case["rows_per_expert"], case["n"], case["k"]
    total = experts * rows
    offs = torch.arange(1, experts + 1, device="cuda", dtype=torch.int32) * rows
    phase = case["phase"]
    w = uniform(experts, n, k, half_width=0.05)
    if phase.startswith("gemm-dgrad"):
        dy = uniform(total, n)

        def fn():
            return torch._grouped_mm(dy, w, offs=offs)
    elif phase.startswith("gemm-wgrad"):
        del w
        dy = uniform(total, n)
        x = uniform(total, k)

        def fn():
            return torch._grouped_mm(dy.t(), x, offs=offs)
    else:
        x = uniform(total, k)

        def fn():
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    ms = median_ms(fn, iterations, warmup_ms=WARMUP_MS)
    torch.cuda.empty_cache()
    return ms


def commit():
    try:
        return subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def measure(args):
    """Times torch on every case of a mok pass, in --passes passes, and the dense rate."""
    mok_cases = json.load(open(args.mok[0]))
    timings = {"dense_gemm_tflops": dense_tflops(args.iterations), "cases": {}}
    # The clocks drift with the power cap over a run: torch is timed in several passes over all
    # cases (as mok is), and each side's figure is the mean of its passes' medians.
    for _ in range(args.passes):
        timed = set()
        for case in mok_cases:
            key = f"{case['preset']}/{case['phase']}"
            if key in timed:  # the same GEMM on another mok engine
                continue
            timed.add(key)
            try:
                timings["cases"].setdefault(key, []).append(torch_case(case, args.iterations))
            except Exception as error:  # report, never invent a figure
                print(f"torch baseline failed for {key}: {error}")
    json.dump(timings, open(args.torch, "w"), indent=2)


def combine(args):
    """mok passes + torch timings -> results JSON (schema mok-bench/1) and a table."""
    mok_passes = [json.load(open(path)) for path in args.mok]
    timings = json.load(open(args.torch))
    dense = timings["dense_gemm_tflops"]
    cases = []
    for case in mok_passes[0]:
        key = f"{case['preset']}/{case['phase']}"
        engine = case.get("engine", "cooperative")
        mok_runs = [c["mok_ms"] for p in mok_passes for c in p
                    if f"{c['preset']}/{c['phase']}" == key
                    and c.get("engine", "cooperative") == engine]
        mok_ms = sum(mok_runs) / len(mok_runs)
        torch_runs = timings["cases"].get(key, [])
        baseline_ms = sum(torch_runs) / len(torch_runs) if torch_runs else None
        flops = 2.0 * case["num_experts"] * case["rows_per_expert"] * case["n"] * case["k"]
        cases.append({
            "name": f"{key} [{engine}]",
            "preset": case["preset"],
            "engine": engine,
            "ep": 2,
            "tokens_per_rank": 8192,
            "precision": "bf16",
            "phase": case["phase"],
            "mok_ms": mok_ms,
            "mok_ms_passes": mok_runs,
            "baseline": "torch._grouped_mm" if torch_runs else None,
            "baseline_ms": baseline_ms,
            "baseline_ms_passes": torch_runs,
            "speedup": (baseline_ms / mok_ms) if baseline_ms else None,
            "useful_tflops": flops / mok_ms / 1e9,
            "baseline_tflops": (flops / baseline_ms / 1e9) if baseline_ms else None,
            "gbps": None,
            "dense_gemm_tflops": dense,
            "shape": {"experts": case["num_experts"], "rows_per_expert": case["rows_per_expert"],
                      "n": case["n"], "k": case["k"]},
        })
    result = {
        "schema": "mok-bench/1",
        "commit": args.commit or commit(),
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cases": cases,
    }
    json.dump(result, open(args.out, "w"), indent=2)
    print(f"dense bf16 8192^3: {dense:.0f} TFLOP/s")
    print(f"{'case':40s} {'mok ms':>8s} {'mok TF':>7s} {'torch ms':>9s} {'torch TF':>8s} {'speedup':>7s}")
    for c in cases:
        torch_tf = f"{c['baseline_tflops']:8.0f}" if c["baseline_tflops"] else "     n/a"
        torch_ms = f"{c['baseline_ms']:9.3f}" if c["baseline_ms"] else "      n/a"
        speedup = f"{c['speedup']:7.3f}" if c["speedup"] else "    n/a"
        print(f"{c['name']:54s} {c['mok_ms']:8.3f} {c['useful_tflops']:7.0f} {torch_ms} {torch_tf} {speedup}")
    # Side by side: ping-pong against cooperative, per case.
    by_key = {(c["preset"], c["phase"], c["engine"]): c for c in cases}
    print(f"{'case':40s} {'coop TF':>8s} {'pp TF':>7s} {'pp/coop':>8s} {'coop/torch':>10s} {'pp/torch':>9s}")

    def vs_torch(x):
        return f"{x['speedup']:.3f}" if x["speedup"] else "n/a"

    for (preset, phase, engine), c in by_key.items():
        if engine != "pingpong" or (preset, phase, "cooperative") not in by_key:
            continue
        coop = by_key[(preset, phase, "cooperative")]
        print(f"{preset + '/' + phase:40s} {coop['useful_tflops']:8.0f} {c['useful_tflops']:7.0f} "
              f"{coop['mok_ms'] / c['mok_ms']:8.3f} {vs_torch(coop):>10s} {vs_torch(c):>9s}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["measure", "combine"])
    parser.add_argument("--mok", required=True, action="append",
                        help="bench_gemm --out file; once per mok pass (combine uses their mean)")
    parser.add_argument("--torch", required=True, help="torch timings file (measure writes it)")
    parser.add_argument("--out", help="results JSON (combine)")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--passes", type=int, default=2, help="torch passes over all cases")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    measure(args) if args.mode == "measure" else combine(args)


if __name__ == "__main__":
    main()
