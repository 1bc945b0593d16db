"""The training step of Hugging Face transformers MoE models with experts_implementation="mok"
against transformers' own "grouped_mm", end to end (attention, routers, norms, embeddings and the
LM loss included): tokens/s, and the MoE experts' share of the step for both.

  python3 bench/baselines/transformers_train.py --out transformers-train.json      (a GPU)
  python3 bench/baselines/transformers_train.py --quick --device cpu --out /tmp/t.json  (smoke)

Models (random init, bf16, from a config with the real widths and few layers):
  qwen3-30b-a3b  Qwen3-30B-A3B's shape: H 2048, 128 experts of I 768, top-8, 32 query heads and 4
                 KV heads of 128, vocabulary 151936; --layers of them (default 8 of its 48).
  deepseek-v3    DeepSeek-V3's MoE layers: H 7168, 256 routed experts of I 2048, top-8 with
                 group-limited routing, one shared expert, MLA attention, vocabulary 129280; every
                 layer an MoE layer (first_k_dense_replace = 0), --layers of them (default 2: a
                 layer's expert weights and their gradients take 45 GB).
--quick uses tiny models of the same two families instead (a smoke test of the script).

The step: model.zero_grad(set_to_none=True), the forward with labels (the LM loss) and
loss.backward() into every parameter's .grad; the optimizer step is left out (elementwise, and
the same whichever experts run). --tokens per step (default 16384) as --tokens / --seq sequences
of --seq tokens. Each implementation is timed on the same model object (mok's one-time
permutation of gate_up_proj happens in its warm-up; switching back restores the HF layout) and
on the same batch: warm-up of 3 steps and then --warmup-ms, then the median of --steps steps, each
timed with CUDA events (host clock on --device cpu).

The experts' share: a third timing runs the same step with the experts replaced by a stand-in
that costs next to nothing (hidden_states times the summed router weights: the routers still
run and get gradients, and the attention costs the same whatever values it sees); the experts'
time of an implementation is its step time minus that one, and its share that time over its step
time. Before timing, the loss of one step with mok is checked against grouped_mm's (relative
difference below 1e-2).

Memory: each case must fit one GPU. On out-of-memory the case is retried with one layer fewer,
down to one, and the result says how many layers ran (`layers`, `layers_requested`); a case that
does not fit with one layer is reported under `errors`.

Output: one JSON of schema mok-bench/2 (bench/report.py reads it; benchmark
"transformers-train"), a case per model with phase "train-step" and baseline
"transformers-grouped_mm": mok_ms and baseline_ms (median step), speedup, tokens_per_s_per_gpu and
baseline_tokens_per_s_per_gpu, moe_ms / moe_share {mok, baseline} and rest_ms (the stand-in's
step), moe_useful_tflops {mok, baseline} (the routed experts' 18·T·H·k·I per MoE layer over their
time), peak_memory_gb {mok, baseline}, check, clock_mhz / power_w (sampled during each timed
loop), the commit, device and date of the run, and the run's dense bf16 GEMM rate. --append adds
the cases to the JSON already at --out (replacing those of the same name; errors and skipped
cases kept), so that models run one process each can share one file
(scripts/device/transformers.sh); the file's own commit, device and date are the last run's.
"""
import argparse
import datetime
import gc
import json
import os
import subprocess
import sys

import torch

from gpu_monitor import GpuMonitor  # bench/baselines/gpu_monitor.py
from timing import median_ms  # bench/baselines/timing.py

BASELINE = "grouped_mm"
STAND_IN = "bench-no-experts"
MODELS = {
    "qwen3-30b-a3b": dict(family="Qwen3MoeConfig", layers=8, config=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, max_position_embeddings=40960, rope_parameters={"rope_type": "default",
                                                                             "rope_theta": 1e6})),
    "deepseek-v3": dict(family="DeepseekV3Config", layers=2, config=dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=0,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=163840)),
}
QUICK_MODELS = {
    "qwen3-30b-a3b": dict(family="Qwen3MoeConfig", layers=2, config=dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
        max_position_embeddings=4096)),
    "deepseek-v3": dict(family="DeepseekV3Config", layers=2, config=dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4,
        topk_group=2, first_k_dense_replace=0, kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=4096)),
}
LOSS_CHECK = 1e-2


def no_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The stand-in experts: next to no work, gradients to the input and the router weights."""
    return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)


def git_commit():
    """MOK_COMMIT (the device check names the commit its binaries were built from), else git's."""
    if os.environ.get("MOK_COMMIT"):
        return os.environ["MOK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("MOK_COMMIT", "unknown")


class Run:
    def __init__(self, args):
        self.args = args
        self.device = torch.device(args.device)
        self.on_gpu = self.device.type == "cuda"
        self.monitor = GpuMonitor(self.device.index or 0) if self.on_gpu else None

    def time(self, fn):
        """(median ms, {clock_mhz, power_w} over the timed steps; None where none was sampled)."""
        ms = median_ms(fn, self.args.steps, warmup=3, warmup_ms=self.args.warmup_ms if self.on_gpu else 0,
                       monitor=self.monitor, device=self.device.type)
        sample = (self.monitor.window() if self.monitor else None) or {}
        return ms, {"clock_mhz": sample.get("clock_mhz"), "power_w": sample.get("power_w")}

    def synchronize(self):
        if self.on_gpu:
            torch.cuda.synchronize(self.device)

    def reset_peak(self):
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak_gb(self):
        return round(torch.cuda.max_memory_allocated(self.device) / 1e9, 2) if self.on_gpu else None

    def free(self):
        gc.collect()
        if self.on_gpu:
            torch.cuda.empty_cache()


def build_model(run, spec, layers):
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, spec["family"])(num_hidden_layers=layers, tie_word_embeddings=False,
                                                   **spec["config"])
    torch.manual_seed(0)
    with run.device:  # initialised where it runs
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation=BASELINE)
    return model.train()


def measure_case(run, name, spec, layers, progress=None):
    """One model's step with each implementation; progress["implementation"] names the one running
    (None while the model is built), for the caller's report of an out-of-memory error."""
    import mok
    import mok.integrations.transformers as mok_transformers

    args = run.args
    progress = {} if progress is None else progress
    progress["implementation"] = None
    model = build_model(run, spec, layers)
    config = model.config
    experts = [module for module in model.modules() if mok_transformers.is_experts_module(module)]
    hidden, top_k = config.hidden_size, config.num_experts_per_tok
    intermediate = experts[0].gate_up_proj.shape[1] // 2
    generator = torch.Generator().manual_seed(1)
    sequences = max(1, args.tokens // args.seq)
    ids = torch.randint(0, config.vocab_size, (sequences, args.seq), generator=generator).to(run.device)
    tokens = ids.numel()
    losses = {}

    def step(implementation):
        def run_step():
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses[implementation] = loss.detach()
        return run_step

    result = {"times": {}, "samples": {}, "peak": {}}
    for implementation in (BASELINE, mok_transformers.NAME, STAND_IN):
        progress["implementation"] = implementation
        model.set_experts_implementation(implementation)
        run.free()
        run.reset_peak()
        if implementation != STAND_IN and implementation not in losses:
            step(implementation)()  # the checked step (and mok's one-time permutation)
            run.synchronize()
        ms, sample = run.time(step(implementation))
        result["times"][implementation] = ms
        result["samples"][implementation] = sample
        result["peak"][implementation] = run.peak_gb()
        print(f"  {name} ({layers} layers, {tokens} tokens): {implementation:17s} {ms:9.2f} ms/step  "
              f"{tokens / ms * 1e3:12,.0f} tokens/s  peak {result['peak'][implementation]} GB  "
              f"{sample['clock_mhz']} MHz {sample['power_w']} W", flush=True)
        if implementation == mok_transformers.NAME and run.on_gpu:
            mok.functional.check_errors(device=run.device)
    model.set_experts_implementation(BASELINE)  # back to the HF layout before the model goes

    times = result["times"]
    mok_ms, baseline_ms, rest_ms = times[mok_transformers.NAME], times[BASELINE], times[STAND_IN]
    loss_mok, loss_baseline = float(losses[mok_transformers.NAME]), float(losses[BASELINE])
    loss_difference = abs(loss_mok - loss_baseline) / abs(loss_baseline)
    moe_layers = len(experts)
    moe_flops = 18.0 * tokens * hidden * top_k * intermediate * moe_layers  # routed experts, fwd + bwd

    def moe(ms):
        return max(ms - rest_ms, 0.0)

    def tflops(ms):
        return round(moe_flops / (moe(ms) * 1e-3) / 1e12, 3) if moe(ms) > 0 else None

    sample, baseline_sample = result["samples"][mok_transformers.NAME], result["samples"][BASELINE]
    return {
        "name": f"{name}-{layers}l" if not args.quick else f"{name}-quick",
        "preset": name,
        "model": type(model).__name__,
        "ep": 1,
        "layers": layers,
        "moe_layers": moe_layers,
        "tokens_per_rank": tokens,
        "sequences": sequences,
        "seq_len": args.seq,
        "hidden": hidden,
        "intermediate": intermediate,
        "num_experts": experts[0].gate_up_proj.shape[0],
        "top_k": top_k,
        "vocab_size": config.vocab_size,
        "precision": "bf16",
        "phase": "train-step",
        "mok_ms": round(mok_ms, 3),
        "baseline": f"transformers-{BASELINE}",
        "baseline_ms": round(baseline_ms, 3),
        "speedup": round(baseline_ms / mok_ms, 3),
        "tokens_per_s_per_gpu": round(tokens / (mok_ms * 1e-3)),
        "baseline_tokens_per_s_per_gpu": round(tokens / (baseline_ms * 1e-3)),
        "rest_ms": round(rest_ms, 3),
        "moe_ms": {"mok": round(moe(mok_ms), 3), "baseline": round(moe(baseline_ms), 3)},
        "moe_share": {"mok": round(moe(mok_ms) / mok_ms, 4), "baseline": round(moe(baseline_ms) / baseline_ms, 4)},
        "moe_useful_tflops": {"mok": tflops(mok_ms), "baseline": tflops(baseline_ms)},
        "useful_tflops": None,  # the whole step's FLOPs are not counted; see moe_useful_tflops
        "fraction_of_dense": None,
        "peak_memory_gb": {"mok": result["peak"][mok_transformers.NAME], "baseline": result["peak"][BASELINE],
                           "stand_in": result["peak"][STAND_IN]},
        "check": {"loss_mok": loss_mok, "loss_baseline": loss_baseline,
                  "relative_difference": loss_difference, "passed": loss_difference < LOSS_CHECK},
        "clock_mhz": baseline_sample["clock_mhz"],
        "power_w": baseline_sample["power_w"],
        "mok_clock_mhz": sample["clock_mhz"],
        "mok_power_w": sample["power_w"],
    }


def measure_with_fallback(run, name, spec, layers_requested):
    """The case with as many layers as fit, from layers_requested down to 1: (entry, errors, skipped).
    A model that does not fit this GPU with one layer, built or run by the baseline, is skipped
    (skipped: the reason), not an error; mok (or the stand-in) running out of memory where the
    baseline fitted is an error, and the case is still measured with fewer layers."""
    errors = []
    for layers in range(layers_requested, 0, -1):
        message = None
        progress = {}
        try:
            entry = measure_case(run, name, spec, layers, progress)
            entry["layers_requested"] = layers_requested
            return entry, errors, None
        except torch.cuda.OutOfMemoryError as error:
            where = progress.get("implementation") or "building the model"
            message = f"{name} with {layers} layers: out of GPU memory in {where} ({str(error).splitlines()[0]})"
        run.free()  # the exception and its frames are gone here, and with them the model
        baseline_fits = progress.get("implementation") not in (None, BASELINE)
        if baseline_fits:
            errors.append(message)
        if layers > 1:
            print(f"  {message}; retrying with one layer fewer", flush=True)
            continue
        if not baseline_fits:
            skipped = f"{name}: does not fit this GPU's memory with one layer ({message})"
            print(f"  skipped {skipped}", flush=True)
            return None, errors, skipped
        print(f"  {message}; giving up on this model", flush=True)
    return None, errors, None


def dense_gemm(run):
    """The dense bf16 GEMM rate (8192^3 torch.matmul) with the same warm-up."""
    size = 8192
    a = torch.rand(size, size, device=run.device, dtype=torch.bfloat16) * 2 - 1
    b = torch.rand(size, size, device=run.device, dtype=torch.bfloat16) * 2 - 1
    ms, sample = run.time(lambda: a @ b)
    return {"tflops": round(2 * size**3 / ms / 1e9, 1), "ms": ms, **sample}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)} (default: both)")
    parser.add_argument("--layers", type=int,
                        help="decoder layers of every model (default: qwen3-30b-a3b 8, deepseek-v3 2; --quick 2)")
    parser.add_argument("--tokens", type=int, help="tokens per step (default 16384; --quick 512)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (default 4096; --quick 128)")
    parser.add_argument("--steps", type=int, help="timed steps, the median is reported (default 10; --quick 2)")
    parser.add_argument("--warmup-ms", type=float, default=3000,
                        help="GPU warm-up per implementation after 3 steps, ms (default %(default)s)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke runs only)")
    parser.add_argument("--quick", action="store_true", help="tiny models of both families: a smoke test")
    parser.add_argument("--no-dense", action="store_true", help="skip the dense GEMM rate")
    parser.add_argument("--out", default="transformers-train.json", help="the JSON (default %(default)s)")
    parser.add_argument("--append", action="store_true",
                        help="add the cases to the JSON at --out (same names replaced) instead of overwriting it")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or (512 if args.quick else 16384)
    args.seq = min(args.seq or (128 if args.quick else 4096), args.tokens)
    args.steps = args.steps or (2 if args.quick else 10)
    names = [name for name in args.models.split(",") if name]
    unknown = [name for name in names if name not in MODELS]
    if unknown or not names:
        parser.error(f"--models: unknown {unknown or 'empty'}; choose from {', '.join(MODELS)}")
    args.models = names
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers: at least 1, got {args.layers}")
    if args.tokens < 1 or args.steps < 1:
        parser.error("--tokens and --steps: at least 1")
    return args


def appended(path, record):
    """record with the cases, errors and skipped cases of the mok-bench/2 JSON at path before it
    (a case of the same name as one of record's is replaced); record alone where there is none."""
    try:
        with open(path) as file:
            earlier = json.load(file)
    except FileNotFoundError:
        return record
    if earlier.get("schema") != record["schema"] or earlier.get("benchmark") != record["benchmark"]:
        raise SystemExit(f"--append: {path} is not a {record['benchmark']} {record['schema']} JSON")
    names = {case["name"] for case in record["cases"]}
    merged = dict(record)
    merged["cases"] = [case for case in earlier.get("cases", []) if case["name"] not in names] + record["cases"]
    merged["errors"] = earlier.get("errors", []) + record["errors"]
    merged["skipped"] = earlier.get("skipped", []) + record["skipped"]
    return merged


def main(argv=None):
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("transformers_train.py: torch sees no CUDA device; it times GPUs (--quick --device cpu smoke-tests it)",
              file=sys.stderr)
        return 2
    import transformers
    from transformers.integrations.moe import ExpertsInterface

    import mok.integrations.transformers  # noqa: F401  (registers "mok")

    ExpertsInterface.register(STAND_IN, no_experts_forward)
    run = Run(args)
    specs = QUICK_MODELS if args.quick else MODELS
    device_name = torch.cuda.get_device_name(run.device) if run.on_gpu else "cpu"
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, {device_name}: "
          f"{', '.join(args.models)}, {args.tokens} tokens a step, median of {args.steps} steps", flush=True)
    entries, errors, skipped = [], [], []
    for name in args.models:
        spec = specs[name]
        entry, case_errors, case_skipped = measure_with_fallback(run, name, spec, args.layers or spec["layers"])
        errors += case_errors
        skipped += [case_skipped] if case_skipped else []
        if entry is not None:
            entries.append(entry)
            share = entry["moe_share"]
            print(f"{entry['name']}: mok {entry['tokens_per_s_per_gpu']:,} tokens/s, grouped_mm "
                  f"{entry['baseline_tokens_per_s_per_gpu']:,} tokens/s ({entry['speedup']:.2f}x); experts' share "
                  f"of the step: mok {share['mok']:.0%}, grouped_mm {share['baseline']:.0%}; loss check "
                  f"{'passed' if entry['check']['passed'] else 'FAILED'}", flush=True)
    dense = dense_gemm(run) if run.on_gpu and not args.no_dense else None
    commit = git_commit()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    for entry in entries:  # each case says where it ran, also in a file that --append gathers
        entry.update(commit=commit, device=device_name, date=date)
    record = {
        "schema": "mok-bench/2",
        "benchmark": "transformers-train",
        "commit": commit,
        "device": device_name,
        "date": date,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "power_limit_w": run.monitor.power_limit_w if run.monitor else None,
        "dense_gemm_tflops": dense["tflops"] if dense else None,
        "dense_gemm": {key: dense.get(key) for key in ("ms", "clock_mhz", "power_w")} if dense else None,
        "quick": args.quick,
        "steps": args.steps,
        "warmup_ms": args.warmup_ms if run.on_gpu else 0,
        "baseline_note": (f"baseline = transformers' own experts_implementation={BASELINE!r} in the same model; "
                          "the step is forward + LM loss + backward, the optimizer step excluded; moe_ms = step "
                          f"minus the step with stand-in experts ({STAND_IN}, rest_ms)"),
        "cases": entries,
        "errors": errors,
        "skipped": skipped,
    }
    if args.append:
        record = appended(args.out, record)
    with open(args.out, "w") as file:
        json.dump(record, file, indent=2)
    print(f"wrote {args.out}")
    if run.monitor:
        run.monitor.close()
    failed = errors or any(not entry["check"]["passed"] for entry in entries) or not entries
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
