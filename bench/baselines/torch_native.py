"""The torch-native MoE layer forward, baseline of bench_layer, measured in the same device run.

  python3 torch_native.py measure --mok layer-mok.json --ep 1 --out torch-ep1.json
  torchrun --nproc-per-node=2 torch_native.py measure --mok layer-mok.json --ep 2 --out torch-ep2.json
  python3 torch_native.py combine --mok layer-mok.json --torch torch-ep1.json --torch torch-ep2.json \
      --commit C --out layer-fwd.json --png layer-fwd.png

The layer, per rank, as a PyTorch user writes it without a fused kernel:
  shared expert     x @ [W_sg; W_su]^T -> silu(g) * u -> @ W_sd^T   (fp32 result kept)
  dispatch          sort the (token, slot) pairs by expert, all_to_all_single of the row counts
                    (a host read of the splits), all_to_all_single of the rows and expert ids
  experts           sort the received rows by local expert, torch._grouped_mm gate/up (one fused
                    [E_l, 2I, H] weight), silu(g) * u in bf16, torch._grouped_mm down
  combine           all_to_all_single back, y = shared + index_add of w * row in fp32, -> bf16
The routing is the one bench_layer used (its --routing-dir files), so both move the same rows.
Weights and x are random, drawn as bench_layer draws its own (data.py: uniform, with the same
standard deviations), since under the power cap the clock depends on the bits multiplied. Median of the timed iterations (CUDA
events) after --warmup-ms of warm-up (as bench_layer's), the maximum over ranks; the dense bf16
GEMM rate (8192^3) is measured in the EP=1 process.
"""
import argparse
import datetime
import json
import math
import os

from data import uniform, uniform_std  # bench/baselines/data.py: bench_layer's distributions
from timing import median_ms  # bench/baselines/timing.py, beside this script


def load_routing(path, num_tokens, top_k):
    import torch

    count = num_tokens * top_k
    data = open(path, "rb").read()
    assert len(data) == 8 * count, f"{path}: {len(data)} bytes, expected {8 * count}"
    idx = torch.frombuffer(bytearray(data[: 4 * count]), dtype=torch.int32).view(num_tokens, top_k)
    w = torch.frombuffer(bytearray(data[4 * count :]), dtype=torch.float32).view(num_tokens, top_k)
    return idx, w


class NativeLayer:
    def __init__(self, case, rank, world):
        import torch

        self.rank, self.world = rank, world
        self.hidden, self.inter = case["hidden"], case["intermediate"]
        self.shared_inter, self.top_k = case["shared_intermediate"], case["top_k"]
        self.num_experts = case["num_experts"]
        self.local_experts = self.num_experts // world
        hidden, inter, shared = self.hidden, self.inter, self.shared_inter
        torch.manual_seed(1000 + rank)
        bf16 = torch.bfloat16

        def weight(*shape, fan_in):
            return uniform_std(*shape, std=1.0 / math.sqrt(fan_in))

        self.w_gate_up = weight(self.local_experts, 2 * inter, hidden, fan_in=hidden)
        self.w_down = weight(self.local_experts, hidden, inter, fan_in=inter)
        if shared > 0:
            self.w_shared_gate_up = weight(2 * shared, hidden, fan_in=hidden)
            self.w_shared_down = weight(hidden, shared, fan_in=shared)

    def forward(self, x, idx, w):
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        hidden, inter, top_k = self.hidden, self.inter, self.top_k
        local_experts, world = self.local_experts, self.world
        if self.shared_inter > 0:
            gate_up = x @ self.w_shared_gate_up.t()
            gate, up = gate_up.split(self.shared_inter, dim=1)
            y = ((F.silu(gate) * up) @ self.w_shared_down.t()).float()
        else:
            y = torch.zeros(x.shape[0], hidden, device=x.device, dtype=torch.float32)

        # Dispatch: (token, slot) pairs sorted by expert; unused (-1) slots sort last, unsent.
        flat = idx.reshape(-1)
        key = torch.where(flat >= 0, flat, self.num_experts)
        order = torch.argsort(key, stable=True)
        sorted_key = key[order]
        send_counts = torch.bincount(sorted_key // local_experts, minlength=world + 1)[:world]
        if world > 1:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts)
            send_list, recv_list = send_counts.tolist(), recv_counts.tolist()
        else:
            send_list = recv_list = send_counts.tolist()
        num_sent = sum(send_list)
        pairs = order[:num_sent]
        x_send = x[pairs // top_k]
        expert_send = sorted_key[:num_sent] % local_experts  # int64
        if world > 1:
            x_recv = x.new_empty(sum(recv_list), hidden)
            dist.all_to_all_single(x_recv, x_send, recv_list, send_list)
            expert_recv = expert_send.new_empty(sum(recv_list))
            dist.all_to_all_single(expert_recv, expert_send, recv_list, send_list)
        else:
            x_recv, expert_recv = x_send, expert_send

        # Experts: received rows grouped by local expert.
        perm = torch.argsort(expert_recv, stable=True)
        offs = torch.cumsum(torch.bincount(expert_recv, minlength=local_experts), 0).to(torch.int32)
        rows = x_recv[perm]
        gate_up = torch._grouped_mm(rows, self.w_gate_up.transpose(-2, -1), offs=offs)
        gate, up = gate_up.split(inter, dim=1)
        h = F.silu(gate) * up
        out_sorted = torch._grouped_mm(h, self.w_down.transpose(-2, -1), offs=offs)
        out = torch.empty_like(out_sorted)
        out[perm] = out_sorted

        # Combine: rows back to their tokens' owners, weighted sum in fp32.
        if world > 1:
            back = out.new_empty(num_sent, hidden)
            dist.all_to_all_single(back, out, send_list, recv_list)
        else:
            back = out
        weights = w.reshape(-1)[pairs]
        y.index_add_(0, pairs // top_k, back.float() * weights[:, None])
        return y.to(torch.bfloat16)


def measure(args):
    import torch
    import torch.distributed as dist

    world = args.ep
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1:
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        rank = dist.get_rank()
        assert dist.get_world_size() == world, f"expects {world} ranks, got {dist.get_world_size()}"
    else:
        rank = 0
    mok = json.load(open(args.mok))

    def rank0_decides(more):  # the ranks' warm-up runs as many forwards as rank 0's
        flag = torch.tensor([1 if more else 0], device="cuda")
        dist.broadcast(flag, 0)
        return bool(flag.item())

    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cases": {}}
    for case in mok["cases"]:
        if case["ep"] != world or not case.get("routing_file"):
            continue
        tokens = case["tokens_per_rank"]
        idx, w = load_routing(case["routing_file"], tokens * world, case["top_k"])
        idx = idx[rank * tokens : (rank + 1) * tokens].cuda()
        w = w[rank * tokens : (rank + 1) * tokens].cuda()
        layer = NativeLayer(case, rank, world)
        x = uniform_std(tokens, case["hidden"], std=1.0)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ms = median_ms(lambda: layer.forward(x, idx, w), args.iterations,
                       barrier=dist.barrier if world > 1 else None,
                       warmup_ms=args.warmup_ms, decide=rank0_decides if world > 1 else None)
        peak_extra = torch.cuda.max_memory_allocated() - before
        if world > 1:
            figures = torch.tensor([ms, float(peak_extra)], device="cuda", dtype=torch.float64)
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
            ms, peak_extra = figures[0].item(), figures[1].item()
        results["cases"][case["name"]] = {"baseline_ms": ms, "peak_extra_bytes": int(peak_extra)}
        if rank == 0:
            print(f"torch-native {case['name']:26s} {ms:8.3f} ms/rank  peak extra {peak_extra / 1e9:.2f} GB",
                  flush=True)
        del layer, x
        torch.cuda.empty_cache()
    if world == 1:
        size = 8192
        a = uniform(size, size)
        b = uniform(size, size)
        dense_ms = median_ms(lambda: a @ b, max(args.iterations, 20), warmup_ms=args.warmup_ms)
        results["dense_gemm_tflops"] = 2 * size**3 / dense_ms / 1e9
        print(f"dense bf16 GEMM 8192^3: {results['dense_gemm_tflops']:.1f} TFLOP/s", flush=True)
    if rank == 0:
        json.dump(results, open(args.out, "w"), indent=2)
    if world > 1:
        dist.destroy_process_group()


def combine(args):
    mok = json.load(open(args.mok))
    torch_cases, dense, device = {}, None, "unknown"
    for path in args.torch:
        if not os.path.exists(path):
            print(f"note: {path} missing (that baseline run failed); its cases have no baseline")
            continue
        data = json.load(open(path))
        torch_cases.update(data["cases"])
        dense = data.get("dense_gemm_tflops", dense)
        device = data.get("device", device)
    cases = []
    for case in mok["cases"]:
        baseline = torch_cases.get(case["name"], {})
        baseline_ms = baseline.get("baseline_ms")
        cases.append({
            "name": f"{case['name']}-fwd",
            "preset": case["preset"],
            "ep": case["ep"],
            "tokens_per_rank": case["tokens_per_rank"],
            "precision": "bf16",
            "phase": "fwd",
            "routing": case["routing"],
            "mok_ms": round(case["mok_ms"], 4),
            "baseline": "torch-native",
            "baseline_ms": round(baseline_ms, 4) if baseline_ms else None,
            "speedup": round(baseline_ms / case["mok_ms"], 3) if baseline_ms else None,
            "useful_tflops": case["useful_tflops"],
            "baseline_tflops": round(case["flops_per_rank"] / (baseline_ms * 1e-3) * 1e-12, 2) if baseline_ms else None,
            "gbps": None,
            "dense_gemm_tflops": round(dense, 1) if dense else None,
            "mok_variant": "unfused" if case.get("fused") is False else "fused",
            "mok_buffer_bytes_per_rank": case["buffer_bytes_per_rank"],
            "baseline_peak_extra_bytes": baseline.get("peak_extra_bytes"),
        })
    record = {
        "schema": "mok-bench/1",
        "commit": args.commit,
        "device": device,
        "date": mok.get("date") or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cases": cases,
    }
    json.dump(record, open(args.out, "w"), indent=2)
    for case in cases:
        print(f"{case['name']:30s} mok {case['mok_ms']:8.3f} ms ({case['useful_tflops']:6.1f} TFLOP/s)  "
              f"torch-native {case['baseline_ms']} ms  speedup {case['speedup']}")
    if args.png:
        plot(record, args.png)


def plot(record, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = record["cases"]
    names = [c["name"].replace("-fwd", "") for c in cases]
    positions = range(len(cases))
    figure, axis = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 5))
    mok = [c["useful_tflops"] for c in cases]
    base = [c["baseline_tflops"] or 0.0 for c in cases]
    variants = {c.get("mok_variant", "unfused") for c in cases}
    label = "mok (fused kernel)" if variants == {"fused"} else "mok (unfused GPU layer)"
    axis.bar([p - 0.2 for p in positions], mok, width=0.4, label=label)
    axis.bar([p + 0.2 for p in positions], base, width=0.4, label="torch-native")
    for p, c in zip(positions, cases):
        if c["speedup"]:
            axis.text(p - 0.2, c["useful_tflops"], f"{c['mok_ms']:.1f} ms\n{c['speedup']:.2f}x",
                      ha="center", va="bottom", fontsize=8)
    dense = cases[0]["dense_gemm_tflops"] if cases else None
    if dense:
        axis.axhline(dense, color="gray", linestyle="--", label=f"dense bf16 GEMM ({dense:.0f})")
    axis.set_xticks(list(positions))
    axis.set_xticklabels(names, rotation=20, ha="right", fontsize=9)
    axis.set_ylabel("useful TFLOP/s per GPU (forward)")
    axis.set_title(f"MoE layer forward, {record['device']}, {record['commit']}, {record['date'][:10]}")
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--mok", required=True)
    m.add_argument("--ep", type=int, required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--iterations", type=int, default=20)
    m.add_argument("--warmup-ms", type=float, default=500,
                   help="untimed forwards for this long first, as bench_layer (default 500)")
    c = sub.add_parser("combine")
    c.add_argument("--mok", required=True)
    c.add_argument("--torch", action="append", default=[])
    c.add_argument("--commit", default="unknown")
    c.add_argument("--out", required=True)
    c.add_argument("--png")
    args = parser.parse_args()
    measure(args) if args.command == "measure" else combine(args)


if __name__ == "__main__":
    main()
