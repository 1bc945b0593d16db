"""torch baseline for the FP8 grouped GEMMs: torch._scaled_grouped_mm with rowwise scales.

Times torch's FP8 grouped GEMM at the shapes of bench_gemm_fp8 (deepseek-v3 at one rank of EP2:
128 experts x 512 rows; gate/up 7168 -> 4096, down 2048 -> 7168, and their dgrad and wgrad) on
operands drawn as
bench_gemm_fp8 draws its own (uniform bf16, activations in [-1, 1), weights in [-0.05, 0.05)),
quantized the way torch's rowwise recipe wants them: one fp32 scale per activation row (over all
of K) and one per weight row (output feature), amax / 448. That is a coarser recipe than mok's
(1 x 128 and 128 x 128 blocks) and needs no promotion inside the GEMM; it is the FP8 grouped GEMM
a PyTorch user has.

    torch._scaled_grouped_mm(x_fp8, w_fp8.transpose(-2, -1), scale_x, scale_w, offs=offs,
                             out_dtype=torch.bfloat16)

The dgrad is the same call with the weight's other dimension as K (dx = dy · W_e: rowwise scales
per dy row and per row of W_eᵀ). The wgrad is the 2d x 2d form, groups along K (the tokens):
dW_e = dyᵀ_e · x_e with one scale per (expert, feature) over the expert's rows,

    torch._scaled_grouped_mm(dy_t_fp8, x_t_fp8.t(), scale_dy (E * m), scale_x (E * n),
                             offs=offs, out_dtype=torch.bfloat16)  # (E, m, n)

bf16 output only (torch's grouped FP8 GEMM has no fp32 output or accumulation into main_grad).

Also measures its accuracy on one expert against an fp64 product of the same E4M3 values and
scales: max |y - fp64| / S with S = sum_k |sa a sb b|, the figure tests/gpu/test_gemm_fp8.cu
prints for mok. With --mok FILE (bench_gemm_fp8 --out) the speedup of mok's fp8 cases is printed
and written beside torch's times (--out).
"""
import argparse
import datetime
import json

import torch

from data import uniform  # bench/baselines/data.py
from timing import median_ms  # bench/baselines/timing.py

E4M3_MAX = 448.0
WARMUP_MS = 300
CASES = {  # phase -> (GEMM N, GEMM K) of y = x · wᵀ
    "gemm-gateup": (4096, 7168),
    "gemm-down": (7168, 2048),
    "gemm-gateup-dgrad": (7168, 4096),
    "gemm-down-dgrad": (2048, 7168),
}
WGRAD_CASES = {  # phase -> (m, n) of dW_e (m, n) = dy_e (rows, m)ᵀ · x_e (rows, n)
    "gemm-gateup-wgrad": (4096, 7168),
    "gemm-down-wgrad": (7168, 2048),
}
EXPERTS, ROWS = 128, 512


def rowwise_fp8(values):
    """values (..., K) bf16 -> E4M3 data and one fp32 scale per row (amax / 448)."""
    amax = values.float().abs().amax(dim=-1).clamp(min=2.0**-116)
    scale = amax / E4M3_MAX
    data = (values.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return data, scale


def errors_against_fp64(y, a, b):
    """y (bf16 output as fp64) against a @ bᵀ in fp64 on the same dequantized operands: the
    largest error relative to Σ|a·b|, and the same beyond the output's one bf16 rounding (at most
    2^-8 relative, subtracted as the C++ test does)."""
    oracle = a @ b.T
    magnitude = (a.abs() @ b.abs().T).clamp(min=1e-300)
    error = (y - oracle).abs()
    rounding = 2.0**-8 * torch.maximum(oracle.abs(), y.abs())
    return ((error / magnitude).max().item(),
            ((error - rounding).clamp(min=0) / magnitude).max().item())


def case(n, k, iterations):
    total = EXPERTS * ROWS
    offs = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * ROWS
    x_data, x_scale = rowwise_fp8(uniform(total, k))
    w_data, w_scale = rowwise_fp8(uniform(EXPERTS, n, k, half_width=0.05))
    w_t = w_data.transpose(-2, -1)  # (E, K, N), column-major as torch wants it

    def fn():
        return torch._scaled_grouped_mm(x_data, w_t, x_scale, w_scale, offs=offs,
                                        out_dtype=torch.bfloat16)

    ms = median_ms(fn, iterations, warmup_ms=WARMUP_MS)
    # Accuracy on expert 0 against fp64 on the same E4M3 values and scales.
    y = fn()[:ROWS].double()
    a = x_data[:ROWS].double() * x_scale[:ROWS, None].double()
    b = w_data[0].double() * w_scale[0, :, None].double()
    return (ms, 2.0 * total * n * k / ms / 1e9) + errors_against_fp64(y, a, b)


def per_expert_fp8(values_t):
    """values_t (features, E * ROWS) bf16 -> E4M3 data and one fp32 scale per (expert, feature)
    over the expert's rows, ordered expert-major ((E * features,), as the 2d x 2d form wants)."""
    features = values_t.shape[0]
    grouped = values_t.float().view(features, EXPERTS, ROWS)
    amax = grouped.abs().amax(dim=-1).clamp(min=2.0**-116)  # (features, E)
    scale = amax / E4M3_MAX
    data = (grouped / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(features, EXPERTS * ROWS)
    return data, scale.t().contiguous().view(-1)


def wgrad_case(m, n, iterations):
    total = EXPERTS * ROWS
    offs = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * ROWS
    dy_data, dy_scale = per_expert_fp8(uniform(total, m).t().contiguous())  # (m, total)
    x_data, x_scale = per_expert_fp8(uniform(total, n).t().contiguous())  # (n, total)

    def fn():
        return torch._scaled_grouped_mm(dy_data, x_data.t(), dy_scale, x_scale, offs=offs,
                                        out_dtype=torch.bfloat16)

    ms = median_ms(fn, iterations, warmup_ms=WARMUP_MS)
    # Accuracy on expert 0 against fp64 on the same E4M3 values and scales.
    y = fn()[0].double()
    a = dy_data[:, :ROWS].double() * dy_scale[:m, None].double()
    b = x_data[:, :ROWS].double() * x_scale[:n, None].double()
    return (ms, 2.0 * total * m * n / ms / 1e9) + errors_against_fp64(y, a, b)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--mok", help="bench_gemm_fp8's JSON, to print the speedups")
    parser.add_argument("--out", default="gemm-fp8-torch.json")
    args = parser.parse_args()
    mok = json.load(open(args.mok)) if args.mok else []
    results = []
    all_cases = [(phase, n, k, case) for phase, (n, k) in CASES.items()]
    all_cases += [(phase, m, n, wgrad_case) for phase, (m, n) in WGRAD_CASES.items()]
    for phase, n, k, run_case in all_cases:
        try:
            ms, tflops, error, beyond = run_case(n, k, args.iterations)
        except Exception as failure:  # report, never invent a figure
            print(f"torch._scaled_grouped_mm failed for {phase}: {failure}")
            continue
        entry = {"preset": "deepseek-v3", "phase": phase, "n": n, "k": k,
                 "baseline": "torch._scaled_grouped_mm rowwise", "baseline_ms": ms,
                 "baseline_tflops": tflops, "max_error_over_s": error,
                 "max_error_beyond_bf16_rounding_over_s": beyond}
        line = (f"deepseek-v3 {phase:18s} torch rowwise fp8 {ms:8.3f} ms {tflops:7.1f} TFLOP/s"
                f"  max|y-fp64|/S {error:.3g} (beyond bf16 rounding {beyond:.3g})")
        for c in mok:
            if c["phase"] == phase and c.get("precision") == "fp8":
                entry["mok_ms"] = c["mok_ms"]
                entry["speedup"] = ms / c["mok_ms"]
                line += f"  mok fp8 {c['mok_ms']:.3f} ms: {ms / c['mok_ms']:.3f}x"
        print(line, flush=True)
        results.append(entry)
    json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "cases": results}, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
