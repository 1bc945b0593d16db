"""One case of the torch-native baseline (torch_native.py, whose docstring says what is measured
and how): every variant of the layer checked against the fp32 reference and the first variant,
then timed forward and as a training step (bf16), or its forward (rowwise FP8), on the ranks a Run
holds; and the dense GEMM rates beside them."""
import math
import os

import torch
import torch.distributed as dist

import rowwise_fp8  # bench/baselines/rowwise_fp8.py
from data import seeded_generator, uniform, uniform_std  # bench/baselines/data.py
from gpu_monitor import GpuMonitor  # bench/baselines/gpu_monitor.py
from timing import median_ms  # bench/baselines/timing.py
from torch_native_layer import TorchNativeLayer  # the layer itself

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
