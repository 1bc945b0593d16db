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
import math
import os
import sys

import torch
import torch.distributed as dist

import rowwise_fp8  # bench/baselines/rowwise_fp8.py
from data import seeded_generator, uniform, uniform_std  # bench/baselines/data.py
from gpu_monitor import GpuMonitor  # bench/baselines/gpu_monitor.py
from timing import median_ms  # bench/baselines/timing.py
from torch_native_layer import TorchNativeLayer, cpu_has_grouped_mm  # the layer itself

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
SHAPE_KEYS = ("hidden", "intermediate", "shared_intermediate", "num_experts", "top_k")

# name -> (weight layout, combine); the first is the one the others are checked against.
VARIANTS = {
    "index_add": ("out_in", "index_add"),
    "batched_view": ("out_in", "batched_view"),
    "batched_bmm": ("out_in", "batched_bmm"),
    "batched_view_kn": ("in_out", "batched_view"),
}

# --precision fp8: name -> (weight layout, combine). torch's FP8 GEMMs want the weight as the
# column-major view of [out, in], so there is no "kn" variant.
FP8_VARIANTS = {
    "fp8_batched_view": ("out_in", "batched_view"),
    "fp8_batched_bmm": ("out_in", "batched_bmm"),
}

# bf16 tolerance: a bf16 pipeline rounds h, each expert row and y once each (relative 2^-9 at
# most, ~2^-10.6 RMS): a few times that, as FlashAttention's rule asks, not a loose bound.
TOLERANCE = {"rel_rms": 2.0 ** -6, "max_rel": 2.0 ** -5}
# FP8 tolerance (against the fp32 reference of the bf16 weights and x): rounding a row scaled to
# amax = 448 to e4m3 (3 mantissa bits) errs by ~2^-5.3 of its RMS (uniform values, as drawn here);
# the layer rounds x, W_gate/up, h and W_down so, and the gate/up errors pass through silu(g) * u,
# which makes ~2^-4 relative RMS for any rowwise FP8 layer. Twice that in RMS; in the largest
# error, which grows with the elements sampled, four times.
FP8_TOLERANCE = {"rel_rms": 2.0 ** -3, "max_rel": 2.0 ** -2}

# Seeds (the experts' weights: torch_native_layer.py).
INPUT_SEED = 10  # + rank
GRAD_SEED = 20  # + rank
ROUTING_SEED = 1



# ---------------------------------------------------------------------------------------------
# Checks


def errors(actual, expected):
    """{"rel_rms", "max_rel"} of `actual` against `expected` (both made fp32)."""
    actual, expected = actual.float(), expected.float()
    difference = actual - expected
    scale_rms = expected.pow(2).mean().sqrt().item()
    scale_max = expected.abs().max().item()
    return {"rel_rms": difference.pow(2).mean().sqrt().item() / scale_rms if scale_rms else 0.0,
            "max_rel": difference.abs().max().item() / scale_max if scale_max else 0.0}


def within_tolerance(error, tolerance=TOLERANCE):
    return all(error[key] <= limit for key, limit in tolerance.items())


def gradient_fingerprint(layer, x, topk_w):
    """fp32 copies of the gradients a check compares: x's, the router weights', the first and
    last local experts' and the shared expert's (every expert's would double the weights' memory
    on the largest presets)."""
    weights = layer.weights
    fingerprint = {"x": x.grad.float(), "topk_w": topk_w.grad.float()}
    for local in sorted({0, layer.local_experts - 1}):
        expert = layer.first_expert + local
        fingerprint[f"expert{expert}.gate_up"] = weights.canonical(weights.gate_up.grad[local]).float()
        fingerprint[f"expert{expert}.down"] = weights.canonical(weights.down.grad[local]).float()
    if weights.shared_gate_up is not None:
        fingerprint["shared.gate_up"] = weights.canonical(weights.shared_gate_up.grad).float()
        fingerprint["shared.down"] = weights.canonical(weights.shared_down.grad).float()
    return fingerprint


# ---------------------------------------------------------------------------------------------
# Measurement


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


class Run:
    """What the ranks share: the device, the world, the monitor, the collectives' helpers."""

    def __init__(self, args):
        self.args = args
        self.world = args.ep
        self.on_gpu = args.device != "cpu"
        self.rank = 0
        if self.on_gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        if self.world > 1:  # NCCL between GPUs; gloo between CPU processes (smoke runs)
            if self.on_gpu:
                dist.init_process_group("nccl", device_id=self.device)
            else:
                dist.init_process_group("gloo")
            self.rank = dist.get_rank()
            assert dist.get_world_size() == self.world, \
                f"--ep {self.world}: started with {dist.get_world_size()} ranks"
        self.monitor = GpuMonitor(self.device.index) if self.on_gpu else None

    def log(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def all_agree(self, flag):
        """True where every rank's `flag` is."""
        if self.world == 1:
            return flag
        value = torch.tensor([1 if flag else 0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
        return bool(value.item())

    def max_over_ranks(self, value):
        if self.world == 1 or value is None:
            return value
        tensor = torch.tensor([value], device=self.device, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def mean_over_ranks(self, value):
        """Mean over ranks; None where any rank has none."""
        if self.world == 1:
            return value
        tensor = torch.tensor([math.nan if value is None else value], device=self.device,
                              dtype=torch.float64)
        dist.all_reduce(tensor)
        mean = tensor.item() / self.world
        return None if math.isnan(mean) else round(mean, 1)

    def time(self, fn):
        """(median ms, {"clock_mhz", "power_w"}) of fn, as module docstring says."""
        decide = None
        if self.world > 1:
            def decide(more):  # the ranks' warm-up runs as many calls as rank 0's
                flag = torch.tensor([1 if more else 0], device=self.device)
                dist.broadcast(flag, 0)
                return bool(flag.item())
        ms = median_ms(fn, self.args.iterations, warmup_ms=self.args.warmup_ms,
                       barrier=dist.barrier if self.world > 1 else None, decide=decide,
                       monitor=self.monitor, device="cuda" if self.on_gpu else "cpu")
        sample = self.monitor.window() if self.monitor else None
        return self.max_over_ranks(ms), {
            "clock_mhz": self.mean_over_ranks(sample and sample["clock_mhz"]),
            "power_w": self.mean_over_ranks(sample and sample["power_w"]),
        }

    def peak_memory_gb(self, fn):
        """Peak bytes allocated over one call of fn (resident tensors included), in GB; None on
        the CPU."""
        if not self.on_gpu:
            fn()
            return None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return round(self.max_over_ranks(torch.cuda.max_memory_allocated()) / 1e9, 3)

    def free(self):
        if self.on_gpu:
            torch.cuda.empty_cache()


def saved_tensor_bytes(fn, exclude):
    """Bytes of the tensors autograd saves for the backward while fn runs (each storage once),
    those of `exclude` (the inputs and weights, which the caller holds anyway) left out."""
    held = {t.untyped_storage().data_ptr() for t in exclude if t is not None}
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = fn()
    del output  # (and with it the graph)
    return sum(saved.values())


def measure_case(run, case, routing):
    """Every variant of one case: checks, then fwd, fwd_train and fwdbwd; see the docstring."""
    args, rank, world, device = run.args, run.rank, run.world, run.device
    shape = {key: case[key] for key in SHAPE_KEYS}
    tokens = case["tokens_per_rank"]
    idx_all, w_all = routing
    topk_idx = idx_all[rank * tokens : (rank + 1) * tokens].to(device)
    topk_w = w_all[rank * tokens : (rank + 1) * tokens].to(device)
    full_topk = bool((idx_all >= 0).all())  # a property of the router, known before any step
    layer = TorchNativeLayer(shape, rank, world, device, full_topk, args.grouped_mm_loop)
    x = uniform_std(tokens, shape["hidden"], std=1.0, device=device,
                    generator=seeded_generator(INPUT_SEED + rank, device))
    dy = uniform_std(tokens, shape["hidden"], std=1.0, device=device,
                     generator=seeded_generator(GRAD_SEED + rank, device))
    x_train = x.detach().clone().requires_grad_(True)
    topk_w_train = topk_w.detach().clone().requires_grad_(True)
    sample = torch.linspace(0, tokens - 1, min(args.check_tokens, tokens), device=device).long()
    reference = layer.reference(x[sample], topk_idx[sample], topk_w[sample])
    run.log(f"{case['name']}: {tokens} tokens/rank, EP {world}, weights "
            f"{layer.weights.nbytes() / 1e9:.2f} GB/rank (the training step adds as much for "
            f"their gradients)")

    def zero_grad():
        x_train.grad = topk_w_train.grad = None
        for tensor in layer.weights.tensors():
            tensor.grad = None

    result = {"shape": shape, "ep": world, "tokens_per_rank": tokens,
              "weight_bytes_per_rank": layer.weights.nbytes(), "variants": {}}
    first_y = first_grads = None
    for name in args.variants:
        layout, combine = VARIANTS[name]
        zero_grad()
        layer.weights.set_requires_grad(False)
        layer.weights.to_layout(layout)
        run.free()

        def forward():
            with torch.no_grad():
                return layer.forward(x, topk_idx, topk_w, combine)

        def forward_train():
            return layer.forward(x_train, topk_idx, topk_w_train, combine)

        def training_step():
            zero_grad()
            layer.forward(x_train, topk_idx, topk_w_train, combine).backward(dy)

        # Checks: the forward against the reference and the first variant, then the gradients.
        y = forward()
        check = {"fwd_vs_reference": errors(y[sample], reference)}
        if first_y is None:
            first_y = y
        else:
            check["fwd_vs_first"] = errors(y, first_y)
        del y
        layer.weights.set_requires_grad(True)
        training_step()
        grads = gradient_fingerprint(layer, x_train, topk_w_train)
        zero_grad()
        if first_grads is None:
            first_grads = grads
        else:
            check["grads_vs_first"] = {key: errors(grads[key], first_grads[key]) for key in grads}
        del grads
        passed = within_tolerance(check["fwd_vs_reference"])
        passed = passed and within_tolerance(check.get("fwd_vs_first", {"rel_rms": 0, "max_rel": 0}))
        passed = passed and all(within_tolerance(e) for e in check.get("grads_vs_first", {}).values())
        check["passed"] = run.all_agree(passed)
        entry = {"layout": layout, "combine": combine, "check": check}
        result["variants"][name] = entry
        worst_grad = max((e["rel_rms"] for e in check.get("grads_vs_first", {}).values()), default=0.0)
        run.log(f"  {name:16s} check {'passed' if check['passed'] else 'FAILED'}: fwd vs fp32 "
                f"reference rel RMS {check['fwd_vs_reference']['rel_rms']:.2e}, max "
                f"{check['fwd_vs_reference']['max_rel']:.2e}; grads vs {args.variants[0]} worst "
                f"rel RMS {worst_grad:.2e}")
        if not check["passed"]:
            continue

        run.free()
        # What autograd keeps between forward and backward, besides inputs and weights.
        saved = saved_tensor_bytes(forward_train,
                                   [x_train, topk_idx, topk_w_train, *layer.weights.tensors()])
        entry["saved_bytes_per_token"] = round(saved / tokens)
        entry["peak_memory_gb"] = {"fwd": run.peak_memory_gb(forward)}
        entry["peak_memory_gb"]["fwdbwd"] = run.peak_memory_gb(training_step)
        zero_grad()
        entry["fwd_ms"], fwd_sample = run.time(forward)
        entry["fwd_train_ms"], _ = run.time(forward_train)
        entry["fwdbwd_ms"], fwdbwd_sample = run.time(training_step)
        zero_grad()
        entry["bwd_ms"] = entry["fwdbwd_ms"] - entry["fwd_train_ms"]
        entry["clock_mhz"] = {"fwd": fwd_sample["clock_mhz"], "fwdbwd": fwdbwd_sample["clock_mhz"]}
        entry["power_w"] = {"fwd": fwd_sample["power_w"], "fwdbwd": fwdbwd_sample["power_w"]}
        memory = entry["peak_memory_gb"]
        run.log(f"  {name:16s} fwd {entry['fwd_ms']:8.3f} ms  fwd (autograd) "
                f"{entry['fwd_train_ms']:8.3f}  fwd+bwd {entry['fwdbwd_ms']:8.3f}  bwd "
                f"{entry['bwd_ms']:8.3f} ms/rank  peak {memory['fwd']} / {memory['fwdbwd']} GB  "
                f"saved {entry['saved_bytes_per_token']} B/token  "
                f"{fwdbwd_sample['clock_mhz']} MHz {fwdbwd_sample['power_w']} W")
    layer.weights.set_requires_grad(False)
    timed = {name: v for name, v in result["variants"].items() if "fwd_ms" in v}
    result["fastest"] = {phase: min(timed, key=lambda n: timed[n][f"{phase}_ms"]) if timed else None
                         for phase in ("fwd", "fwdbwd", "bwd")}
    return result  # the caller frees this case's tensors (gone with this frame)


def measure_case_fp8(run, case, routing):
    """Every FP8 variant of one case at EP 1: the weights quantized once (timed apart), then each
    variant checked and its forward timed; see the docstring."""
    args, device = run.args, run.device
    shape = {key: case[key] for key in SHAPE_KEYS}
    tokens = case["tokens_per_rank"]
    idx_all, w_all = routing
    topk_idx = idx_all[:tokens].to(device)
    topk_w = w_all[:tokens].to(device)
    full_topk = bool((idx_all >= 0).all())
    layer = TorchNativeLayer(shape, 0, 1, device, full_topk)
    x = uniform_std(tokens, shape["hidden"], std=1.0, device=device,
                    generator=seeded_generator(INPUT_SEED, device))
    sample = torch.linspace(0, tokens - 1, min(args.check_tokens, tokens), device=device).long()
    reference = layer.reference(x[sample], topk_idx[sample], topk_w[sample])
    fp8_experts = rowwise_fp8.RowwiseFp8Experts(layer.weights)
    weight_quantize_ms, _ = run.time(lambda: rowwise_fp8.RowwiseFp8Experts(layer.weights))
    run.free()
    run.log(f"{case['name']}: {tokens} tokens, EP 1, FP8: weights {layer.weights.nbytes() / 1e9:.2f} "
            f"GB bf16, {fp8_experts.nbytes() / 1e9:.2f} GB e4m3 and scales, quantized in "
            f"{weight_quantize_ms:.3f} ms (once per optimizer step, not in the forward)")
    result = {"shape": shape, "ep": 1, "tokens_per_rank": tokens, "precision": "fp8",
              "weight_bytes_per_rank": layer.weights.nbytes(),
              "fp8_weight_bytes_per_rank": fp8_experts.nbytes(),
              "weight_quantize_ms": weight_quantize_ms, "variants": {}}
    first_y = None
    for name in args.variants:
        layout, combine = FP8_VARIANTS[name]

        def forward():
            with torch.no_grad():
                return layer.forward_fp8(x, topk_idx, topk_w, combine, fp8_experts)

        # Checks: against the fp32 reference at FP8's tolerance; against the first variant (the
        # same e4m3 values, another combine) at bf16's.
        y = forward()
        check = {"fwd_vs_reference": errors(y[sample], reference)}
        passed = within_tolerance(check["fwd_vs_reference"], FP8_TOLERANCE)
        if first_y is None:
            first_y = y
        else:
            check["fwd_vs_first"] = errors(y, first_y)
            passed = passed and within_tolerance(check["fwd_vs_first"])
        del y
        check["passed"] = passed
        entry = {"layout": layout, "combine": combine, "check": check}
        result["variants"][name] = entry
        run.log(f"  {name:16s} check {'passed' if passed else 'FAILED'}: fwd vs fp32 reference rel "
                f"RMS {check['fwd_vs_reference']['rel_rms']:.2e}, max "
                f"{check['fwd_vs_reference']['max_rel']:.2e}"
                + (f"; vs {args.variants[0]} rel RMS {check['fwd_vs_first']['rel_rms']:.2e}"
                   if "fwd_vs_first" in check else ""))
        if not passed:
            continue
        run.free()
        entry["peak_memory_gb"] = {"fwd": run.peak_memory_gb(forward)}
        entry["fwd_ms"], sample_fwd = run.time(forward)
        entry["clock_mhz"] = {"fwd": sample_fwd["clock_mhz"]}
        entry["power_w"] = {"fwd": sample_fwd["power_w"]}
        run.log(f"  {name:16s} fwd {entry['fwd_ms']:8.3f} ms  peak {entry['peak_memory_gb']['fwd']} GB  "
                f"{sample_fwd['clock_mhz']} MHz {sample_fwd['power_w']} W")
    timed = {name: v for name, v in result["variants"].items() if "fwd_ms" in v}
    result["fastest"] = {"fwd": min(timed, key=lambda n: timed[n]["fwd_ms"]) if timed else None,
                         "fwdbwd": None, "bwd": None}
    return result


def dense_gemm(run):
    """The dense bf16 GEMM rate (8192^3 torch.matmul) after the same warm-up as the cases."""
    size = 8192
    a = uniform(size, size, device=run.device)  # [-1, 1), as bench_gemm's activations
    b = uniform(size, size, device=run.device)
    ms, sample = run.time(lambda: a @ b)
    return {"tflops": round(2 * size**3 / ms / 1e9, 1), "ms": ms, **sample}


def dense_gemm_fp8(run):
    """The dense FP8 GEMM rate (8192^3 torch._scaled_mm, rowwise scales, bf16 out), operands
    quantized before timing."""
    size = 8192
    a, a_scale = rowwise_fp8.quantize(uniform(size, size, device=run.device))
    b, b_scale = rowwise_fp8.quantize(uniform(size, size, device=run.device))  # (N, K)
    ms, sample = run.time(lambda: rowwise_fp8.scaled_mm(a, b, a_scale, b_scale))
    return {"tflops": round(2 * size**3 / ms / 1e9, 1), "ms": ms, "precision": "fp8", **sample}


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
