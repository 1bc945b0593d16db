"""The torch-native MoE layer, baseline of bench_layer: several variants a PyTorch user would write,
each checked, then timed forward and as a training step, in the same device run as mok.

  python3 torch_native.py measure --mok layer-mok.json --ep 1 --out layer-torch-ep1.json
  torchrun --nproc-per-node=2 torch_native.py measure --mok layer-mok.json --ep 2 \\
      --out layer-torch-ep2.json
  python3 torch_native.py measure --preset qwen3-30b-a3b --tokens 16384 --out torch.json
  python3 torch_native.py measure --hidden 2048 --intermediate 768 --experts 64 --top-k 6 \\
      --shared-intermediate 1024 --tokens 4096 --out torch.json
  python3 torch_native.py measure --device cpu --preset tiny --tokens 64 --iterations 2 \\
      --warmup-ms 0 --out smoke.json                      (CPU smoke: checks, host-clock times)
  python3 torch_native.py measure --mok layer-mok-fp8.json --precision fp8 \\
      --out layer-torch-fp8-ep1.json                      (the rowwise FP8 layer's forward, EP 1)
Then layer_results.py turns bench_layer's JSON and these into results (schema mok-bench/2).

Cases: with --mok, every case of bench_layer's JSON at this --ep that has a routing file (its
--routing-dir), so that both move the same rows; without, one case of the --preset's shape, each
of --hidden --intermediate --experts --top-k --shared-intermediate overriding it, on --tokens
tokens per rank with uniform routing drawn here (distinct experts, softmax weights).

The layer, per rank (E_l = E / ep local experts), as a PyTorch user writes it without a fused
kernel:
  shared expert     x @ [W_sg; W_su] -> silu(g) * u -> @ W_sd, kept in fp32
  dispatch          the (token, slot) pairs sorted by expert (stable argsort); at EP > 1 the row
                    counts to the host and all_to_all_single of the rows (autograd through a
                    custom Function) and of the expert ids, then a stable sort by local expert
  experts           torch._grouped_mm gate/up (one [E_l, 2I, H] weight), silu(g) * u in bf16,
                    torch._grouped_mm down
  combine           (variant) rows back to their tokens, y = shared + sum_j w[t, j] * row in
                    fp32, rounded to bf16 once
Variants (VARIANTS below):
  index_add         the combine by y.index_add_(0, token, w * row) (fp32), after the rows are
                    put back in received order by `out[perm] = ...`; this baseline's first form
  batched_view      torchtitan's combine: the rows gathered back into slot order with one index
                    (the inverse of the stable sort's permutation), viewed (T, k, H), times w in
                    fp32, .sum(1); no host sync at EP 1 (group offsets by searchsorted)
  batched_bmm       batched_view's gather, the weighted sum over k as one fp32 batched matmul,
                    (T, 1, k) @ (T, k, H), instead of a product then .sum(1)
  batched_view_kn   batched_view with the weights stored [E, in, out] (K x N, "kn"): the
                    grouped GEMMs read x @ W without a transposed view, and their weight
                    gradients come out in that layout
The weights of the other variants are stored [E, out, in] as mok's (K-contiguous) and read as
W.transpose(-2, -1). Which layout and combine is fastest is measured, not assumed: the results
carry every variant's time and the fastest is the baseline.

--precision fp8: the forward alone (no autograd) of the layer as a PyTorch user writes it in FP8
with torch's rowwise scaling (rowwise_fp8.py), EP 1 only:
  weights           every weight quantized to e4m3, one fp32 scale per output row (amax / 448),
                    ONCE before timing, as a per-optimizer-step cache: timed apart, as the
                    case's weight_quantize_ms, and not part of the forward
  forward (timed)   x quantized per token row (one scale over H) before dispatch, its e4m3 rows
                    and scales gathered by the same stable argsort; torch._scaled_grouped_mm
                    gate/up (bf16 out), silu(g) * u in bf16, h quantized per row,
                    torch._scaled_grouped_mm down (bf16 out); the shared expert likewise by
                    torch._scaled_mm; the combine in fp32 as above
Variants (FP8_VARIANTS): fp8_batched_view and fp8_batched_bmm, the bf16 variants' fastest combines
(the FP8 GEMMs take the weight only as [out, in]: no "kn" layout). Each is checked against the same
fp32 reference at FP8_TOLERANCE, the second against the first (the same e4m3 values) at bf16's;
then its forward is timed, its peak memory measured (the bf16 weights, the master copy the cache is
made from, stay resident). The JSON has the bf16 run's structure with "precision": "fp8" at the top
and in each case, and the dense FP8 GEMM rate (8192^3 rowwise torch._scaled_mm) as dense_gemm_fp8.

Checks, before any variant is timed: its forward against an fp32 reference of the layer computed
here on a sample of --check-tokens tokens (the same bf16 weights and x, products and sums in fp32),
and its output and its training step's gradients (x, router weights, two experts' weights, the
shared expert's) against the first variant's; errors as relative RMS (rms(a - b) / rms(b)) and
max |a - b| / max |b|, within bf16 tolerance (TOLERANCE). mok's own output is checked against the
same layer's CPU reference by its tests; this script cannot read mok's y (bench_layer draws the
weights in another process), so it checks the variants against the definition instead. A variant
that fails is reported and not timed; the exit status is then 1.

Timing (median of --iterations CUDA-event-timed calls after --warmup-ms of warm-up, as
bench_layer's; the maximum over ranks):
  fwd               the forward without autograd (torch.no_grad), as bench_layer's forward
  fwdbwd            one training step: grads set to None, the forward under autograd with
                    x, the router weights and every expert weight (routed and shared) requiring
                    grad, y.backward(dy)
  bwd               fwdbwd - the forward under autograd (timed too, as fwd_train), which is never
                    faster than without, so bwd is not overstated
Peak memory: torch.cuda.max_memory_allocated over one call of each phase, reset before (weights,
x, routing and, for fwdbwd, the weight gradients included). Clock and power: sampled during each
timed loop (gpu_monitor.py). The dense bf16 GEMM rate (8192^3 torch.matmul) after the cases, with
the same warm-up, in the EP 1 process. Data are drawn as bench_layer draws its own (data.py:
uniform values of the same standard deviations), since under the power cap the clock depends on
the bits multiplied; each expert's weights come from a generator seeded by its global id, so any
rank can draw any expert's weights for the reference.

On --device cpu (smoke runs and tests) the times are the host clock's, memory and clock are not
measured, and where the installed torch has no CPU torch._grouped_mm the experts run as a loop of
per-expert matmuls (grouped_mm, torch_native_layer.py); on a GPU torch._grouped_mm always runs. torch has no CPU
torch._scaled_grouped_mm: with --precision fp8 the CPU emulates both FP8 GEMMs in fp32 on the same
e4m3 values and scales (rowwise_fp8.py).
"""
import argparse
import datetime
import json
import sys

import torch
import torch.distributed as dist

from data import seeded_generator  # bench/baselines/data.py
from torch_native_case import (  # one case
    FP8_TOLERANCE,
    FP8_VARIANTS,
    TOLERANCE,
    VARIANTS,
    Run,
    dense_gemm,
    dense_gemm_fp8,
    measure_case,
    measure_case_fp8,
)
from torch_native_layer import cpu_has_grouped_mm  # the layer itself

# DESIGN.md §5 and src/reference/shape.cpp.
PRESETS = {
    "tiny": {"hidden": 256, "intermediate": 128, "shared_intermediate": 128, "num_experts": 16,
             "top_k": 4},
    "deepseek-v3": {"hidden": 7168, "intermediate": 2048, "shared_intermediate": 2048,
                    "num_experts": 256, "top_k": 8},
    "qwen3-30b-a3b": {"hidden": 2048, "intermediate": 768, "shared_intermediate": 0,
                      "num_experts": 128, "top_k": 8},
    "qwen3-235b-a22b": {"hidden": 4096, "intermediate": 1536, "shared_intermediate": 0,
                        "num_experts": 128, "top_k": 8},
    "mixtral-8x7b": {"hidden": 4096, "intermediate": 14336, "shared_intermediate": 0,
                     "num_experts": 8, "top_k": 2},
}
ROUTING_SEED = 1


# ---------------------------------------------------------------------------------------------
# Cases


def load_routing(path, num_tokens, top_k):
    """bench_layer's routing file: (T, k) int32 expert ids, then (T, k) fp32 weights."""
    count = num_tokens * top_k
    with open(path, "rb") as file:
        data = file.read()
    assert len(data) == 8 * count, f"{path}: {len(data)} bytes, expected {8 * count}"
    idx = torch.frombuffer(bytearray(data[: 4 * count]), dtype=torch.int32).view(num_tokens, top_k)
    w = torch.frombuffer(bytearray(data[4 * count :]), dtype=torch.float32).view(num_tokens, top_k)
    return idx, w


def draw_routing(num_tokens, num_experts, top_k, seed=ROUTING_SEED):
    """Uniform routing: k distinct experts per token, softmax weights (on the host)."""
    generator = seeded_generator(seed, "cpu")
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    idx = scores.topk(top_k, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), dim=1)
    return idx, w


def cases_to_measure(args):
    """[(case, routing (idx, w) over all ranks' tokens)] for this run."""
    if args.mok:
        chosen = args.cases.split(",") if args.cases else None
        cases = []
        with open(args.mok) as file:
            mok_cases = json.load(file)["cases"]
        for case in mok_cases:
            if case["ep"] != args.ep or not case.get("routing_file"):
                continue
            if chosen is not None and case["name"] not in chosen:
                continue
            routing = load_routing(case["routing_file"], case["tokens_per_rank"] * args.ep,
                                   case["top_k"])
            cases.append((case, routing))
        return cases
    shape = dict(PRESETS[args.preset])
    for key, value in (("hidden", args.hidden), ("intermediate", args.intermediate),
                       ("shared_intermediate", args.shared_intermediate),
                       ("num_experts", args.experts), ("top_k", args.top_k)):
        if value is not None:
            shape[key] = value
    check_shape(shape, args.ep, args.precision)
    custom = any(v is not None for v in (args.hidden, args.intermediate, args.shared_intermediate,
                                         args.experts, args.top_k))
    name = args.name or f"{args.preset if not custom else 'custom'}-ep{args.ep}"
    case = {"name": name, "preset": args.preset if not custom else "custom", "ep": args.ep,
            "tokens_per_rank": args.tokens, **shape}
    return [(case, draw_routing(args.tokens * args.ep, shape["num_experts"], shape["top_k"]))]


def check_shape(shape, ep, precision="bf16"):
    """A clear error naming the argument for a shape this baseline cannot run."""
    names = {"hidden": "--hidden", "intermediate": "--intermediate",
             "shared_intermediate": "--shared-intermediate", "num_experts": "--experts",
             "top_k": "--top-k"}
    for key in ("hidden", "intermediate", "num_experts", "top_k"):
        if shape[key] <= 0:
            raise SystemExit(f"{names[key]}: must be positive, got {shape[key]}")
    if shape["shared_intermediate"] < 0:
        raise SystemExit(f"--shared-intermediate: must be >= 0, got {shape['shared_intermediate']}")
    # torch._grouped_mm, the scaled GEMMs and the matmuls want rows of a multiple of 16 bytes
    multiple = 16 if precision == "fp8" else 8
    for key in ("hidden", "intermediate", "shared_intermediate"):
        if shape[key] % multiple:
            raise SystemExit(f"{names[key]}: must be a multiple of {multiple} (16-byte {precision} "
                             f"rows), got {shape[key]}")
    if shape["top_k"] > shape["num_experts"]:
        raise SystemExit(f"--top-k: k = {shape['top_k']} exceeds the {shape['num_experts']} experts")
    if shape["num_experts"] % ep:
        raise SystemExit(f"--ep: {shape['num_experts']} experts do not divide over {ep} ranks")


def measure(args):
    run = Run(args)
    fp8 = args.precision == "fp8"
    variants = FP8_VARIANTS if fp8 else VARIANTS
    results = {
        "kind": "torch-native-layer",
        "device": torch.cuda.get_device_name(run.device) if run.on_gpu else "cpu",
        "torch": torch.__version__,
        "ep": run.world,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "iterations": args.iterations,
        "warmup_ms": args.warmup_ms,
        "variants": {name: {"layout": variants[name][0], "combine": variants[name][1]}
                     for name in args.variants},
        "tolerance": FP8_TOLERANCE if fp8 else TOLERANCE,
        "monitor": run.monitor.source if run.monitor else None,
        "monitor_note": run.monitor.note if run.monitor else "cpu run: clock and power not sampled",
        "power_limit_w": run.monitor.power_limit_w if run.monitor else None,
        "cases": {},
    }
    if fp8:
        results["precision"] = "fp8"
        results["tolerance_between_variants"] = TOLERANCE
    if not run.on_gpu and fp8:
        results["grouped_mm"] = "emulated: fp32 products of the e4m3 values (no CPU torch._scaled_grouped_mm)"
    elif not run.on_gpu:
        results["grouped_mm"] = "torch._grouped_mm" if cpu_has_grouped_mm() and not args.grouped_mm_loop \
            else "per-expert loop (no CPU torch._grouped_mm)"
    failed = False
    for case, routing in cases_to_measure(args):
        try:
            result = (measure_case_fp8 if fp8 else measure_case)(run, case, routing)
        except torch.cuda.OutOfMemoryError as error:  # report it; the next case may fit
            run.log(f"{case['name']}: out of memory: {error}")
            results["cases"][case["name"]] = {"error": f"out of memory: {error}"}
            failed = True
            run.free()
            continue
        results["cases"][case["name"]] = result
        run.free()
        failed = failed or any(not v["check"]["passed"] for v in result["variants"].values())
    if fp8 and run.on_gpu and not args.no_dense:
        dense = dense_gemm_fp8(run)
        results["dense_gemm_fp8"] = dense
        run.log(f"dense FP8 GEMM 8192^3 (rowwise torch._scaled_mm): {dense['tflops']:.1f} TFLOP/s "
                f"({dense['clock_mhz']} MHz, {dense['power_w']} W)")
    elif run.world == 1 and run.on_gpu and not args.no_dense:
        dense = dense_gemm(run)
        results["dense_gemm_tflops"] = dense["tflops"]
        results["dense_gemm"] = dense
        run.log(f"dense bf16 GEMM 8192^3: {dense['tflops']:.1f} TFLOP/s "
                f"({dense['clock_mhz']} MHz, {dense['power_w']} W)")
    if run.rank == 0:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=2)
    if run.monitor:
        run.monitor.close()
    if run.world > 1:
        dist.destroy_process_group()
    return 1 if failed else 0


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="check and time the variants (see above)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--out", required=True, help="JSON of this run's figures")
    m.add_argument("--mok", help="bench_layer's --out JSON: its cases at --ep with a routing file")
    m.add_argument("--cases", help="with --mok: these case names only (comma-separated)")
    m.add_argument("--ep", type=int, default=1, help="ranks (torchrun's --nproc-per-node)")
    m.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS),
                   help="without --mok: the shape (default deepseek-v3)")
    m.add_argument("--hidden", type=int, help="H, overrides the preset's")
    m.add_argument("--intermediate", type=int, help="I, overrides the preset's")
    m.add_argument("--shared-intermediate", type=int, help="I_s (0: no shared expert)")
    m.add_argument("--experts", type=int, help="E, overrides the preset's")
    m.add_argument("--top-k", type=int, help="k, overrides the preset's")
    m.add_argument("--tokens", type=int, default=8192, help="without --mok: tokens per rank")
    m.add_argument("--name", help="without --mok: the case's name (default PRESET-epN)")
    m.add_argument("--precision", default="bf16", choices=["bf16", "fp8"],
                   help="bf16 (default): forward and training step; fp8: the forward of the rowwise "
                        "FP8 layer, EP 1 only")
    m.add_argument("--variants",
                   help=f"comma-separated, the first is the others' check (default bf16: "
                        f"{','.join(VARIANTS)}; fp8: {','.join(FP8_VARIANTS)})")
    m.add_argument("--iterations", type=int, default=20, help="timed calls per phase (default 20)")
    m.add_argument("--warmup-ms", type=float, default=500,
                   help="untimed calls for this long before each phase, as bench_layer (default 500)")
    m.add_argument("--check-tokens", type=int, default=32,
                   help="tokens of the fp32 reference check (default 32)")
    m.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    m.add_argument("--grouped-mm-loop", action="store_true",
                   help="on the CPU: per-expert matmuls even where torch._grouped_mm runs")
    m.add_argument("--no-dense", action="store_true", help="skip the dense GEMM rate")
    args = parser.parse_args(argv)
    known = FP8_VARIANTS if args.precision == "fp8" else VARIANTS
    args.variants = args.variants.split(",") if args.variants else list(known)
    for name in args.variants:
        if name not in known:
            parser.error(f"--variants: no {args.precision} variant '{name}' (known: {', '.join(known)})")
    if args.precision == "fp8" and args.ep != 1:
        parser.error(f"--precision fp8: EP 1 only (the FP8 layer has no all-to-all here), got --ep {args.ep}")
    if args.precision == "fp8" and args.grouped_mm_loop:
        parser.error("--grouped-mm-loop: bf16 only (the CPU FP8 GEMMs are always a per-expert loop)")
    for flag, value, least in (("--tokens", args.tokens, 1), ("--iterations", args.iterations, 1),
                               ("--ep", args.ep, 1), ("--check-tokens", args.check_tokens, 1)):
        if value < least:
            parser.error(f"{flag}: must be >= {least}, got {value}")
    return args


def main():
    sys.exit(measure(parse_args()))


if __name__ == "__main__":
    main()
