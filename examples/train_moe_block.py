"""Trains a small transformer block whose feed-forward is mok.nn.MoE, next to the same block with
a plain-PyTorch MoE, on synthetic data (a fixed random teacher), and prints loss and tokens/s.

    python examples/train_moe_block.py [--steps 200] [--device cpu|cuda] [--batch 8] [--seq 64]
    python examples/train_moe_block.py --precision fp8|mxfp8                  # CPU backend
    python examples/train_moe_block.py --device cuda --precision fp8          # GPU, fp8
    torchrun --nproc-per-node=2 examples/train_moe_block.py --device cuda     # EP = 2

What runs where:
  --device cpu   mok.nn.MoE forward and backward: mok's CPU backend.
  --device cuda  mok.nn.MoE forward and backward: mok's GPU layer (expert-parallel over the
                 torchrun group when there is one); the MoE forward alone is also timed.
Under torchrun the torch-native block is data-parallel with every expert on each rank (the same
global model); mok's block holds E/R experts per rank. Replicated weights average their gradients.

--precision fp8 or mxfp8 trains mok's block in that precision
and, from the same seed and starting weights, in bf16 beside it, and prints how far the FP8 loss
ends from the bf16 one.
"""

import argparse
import copy
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

import mok


class TorchMoE(nn.Module):
    """The same layer in plain PyTorch (bf16 matmuls per expert, fp32 combine), with native
    autograd, holding every expert. Starts from a mok.nn.MoE's parameters (fused gate/up layout)."""

    def __init__(self, reference: mok.nn.MoE):
        super().__init__()
        self.inner = copy.deepcopy(reference)

    def forward(self, x):
        m = self.inner
        tokens = x.reshape(-1, m.shape.hidden)
        topk_idx, topk_w = m.route(tokens)
        xb = tokens.to(m.w_gate_up.dtype)
        gate, up = mok.functional.split_gate_up(m.w_gate_up)
        y = torch.zeros(tokens.shape, dtype=torch.float32, device=x.device)
        if m.w_shared_gate_up is not None:
            shared_gate, shared_up = mok.functional.split_gate_up(m.w_shared_gate_up)
            y = y + ((F.silu(xb @ shared_gate.t()) * (xb @ shared_up.t())) @ m.w_shared_down.t()).float()
        flat = topk_idx.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat.clamp(min=0), minlength=m.shape.num_experts).tolist()
        start = int((flat < 0).sum())  # unused slots sort first
        for expert, count in enumerate(counts):
            picked = order[start:start + count]
            start += count
            if count:
                rows = picked // m.shape.top_k
                h = F.silu(xb[rows] @ gate[expert].t()) * (xb[rows] @ up[expert].t())
                out = (h @ m.w_down[expert].t()).float() * topk_w.reshape(-1)[picked, None]
                y = y.index_add(0, rows, out)
        return y.to(torch.bfloat16).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, hidden, heads, moe):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.moe = moe

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        return x + self.moe(self.norm2(x)).float()


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def average_gradients(model, group, ranks, expert_parallel):
    """Data parallelism over the group: average every replicated weight's gradient. mok's experts
    (expert_parallel) are not replicated; their gradients already sum every rank's tokens, so they
    take the same 1/R."""
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        if expert_parallel and (name.endswith("moe.w_gate_up") or name.endswith("moe.w_down")):
            parameter.grad /= ranks
        else:
            torch.distributed.all_reduce(parameter.grad, op=torch.distributed.ReduceOp.AVG, group=group)


def train(model, data, target, steps, label, group, ranks, expert_parallel, log):
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    tokens = data.shape[0] * data.shape[1]
    synchronize(data.device)
    start, first_loss = time.perf_counter(), None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(data), target)
        loss.backward()
        if ranks > 1:
            average_gradients(model, group, ranks, expert_parallel)
        optimizer.step()
        if step == 0 or step % max(1, steps // 5) == 0 or step == steps - 1:
            value = loss.item()
            first_loss = value if first_loss is None else first_loss
            log(f"  [{label}] step {step:4d}  loss {value:.5f}")
    synchronize(data.device)
    seconds = time.perf_counter() - start
    last = loss.item()
    log(f"  [{label}] {steps} steps in {seconds:.2f} s: {steps * tokens / seconds:,.0f} tokens/s per rank "
        f"(forward + backward + optimizer); loss {first_loss:.4f} -> {last:.4f}")
    return last, steps * tokens / seconds


@torch.no_grad()
def forward_ms(moe, x, iterations=20):
    """Median milliseconds of the MoE layer's forward alone (CUDA events, after warm-up)."""
    for _ in range(3):
        moe(x)
    times = []
    for _ in range(iterations):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        moe(x)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=None, help="default 64 (cpu), 512 (cuda)")
    parser.add_argument("--hidden", type=int, default=None,
                        help="default 64 (cpu; 128 with --precision fp8 or mxfp8, whose blocks are 128 wide), "
                             "1024 (cuda)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--precision", default="bf16", choices=mok.functional.PRECISIONS,
                        help="mok's precision mode (default bf16)")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    hidden = args.hidden or (1024 if on_gpu else 64 if args.precision == "bf16" else 128)
    seq = args.seq or (512 if on_gpu else 64)

    ranks, rank, group = 1, 0, None
    device = torch.device(args.device)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if not on_gpu:
            raise SystemExit("expert parallelism (torchrun) needs --device cuda")
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.distributed.init_process_group("nccl", device_id=device)
        group = torch.distributed.group.WORLD
        ranks, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    elif on_gpu:
        device = torch.device("cuda", torch.cuda.current_device())

    def log(text):
        if rank == 0:
            print(text, flush=True)

    # bf16 expert weights on the GPU: mok takes them as they are (no copy per call).
    dtype = torch.bfloat16 if on_gpu else torch.float32
    moe_args = dict(hidden=hidden, intermediate=2 * hidden, num_experts=args.experts, top_k=args.top_k,
                    shared_intermediate=hidden, dtype=dtype)
    torch.manual_seed(0)  # the same global model on every rank
    full = mok.nn.MoE(**moe_args).to(device)
    config = mok.functional.MoKConfig(precision=args.precision)
    moe = mok.nn.MoE(**moe_args, process_group=group, config=config).to(device)
    with torch.no_grad():  # this rank's share of the same experts
        local = slice(rank * args.experts // ranks, (rank + 1) * args.experts // ranks)
        for name, parameter in moe.named_parameters():
            source = getattr(full, name)
            parameter.copy_(source[local] if name in ("w_gate_up", "w_down") else source)
    heads = 8 if on_gpu else 4
    mok_block = Block(hidden, heads, moe).to(device)
    torch_block = Block(hidden, heads, TorchMoE(full)).to(device)
    for name in ("norm1", "norm2", "attention"):  # the same starting point
        getattr(torch_block, name).load_state_dict(getattr(mok_block, name).state_dict())
    bf16_block = None
    if args.precision != "bf16":  # the same block and starting point in mok's bf16 mode
        bf16_block = copy.deepcopy(mok_block)
        bf16_block.moe.config = mok.functional.MoKConfig()

    torch.manual_seed(1)
    teacher = Block(hidden, heads,
                    mok.nn.MoE(hidden, 2 * hidden, args.experts, args.top_k, dtype=dtype)).to(device)
    torch.manual_seed(2 + rank)  # each rank its own data
    data = torch.randn(args.batch, seq, hidden, device=device)
    with torch.no_grad():
        target = teacher(data)

    log(f"training a transformer block (H {hidden}, {args.experts} experts, top-{args.top_k}, shared expert) "
        f"for {args.steps} steps, {args.batch}x{seq} tokens per step and rank on {device.type}, EP {ranks}")
    backend = "CPU backend: forward and backward" if not on_gpu else \
        "GPU forward and backward"
    if args.precision != "bf16":
        backend += f", {args.precision}"
    mok_loss, mok_rate = train(mok_block, data, target, args.steps, f"mok.nn.MoE ({backend})", group, ranks,
                               True, log)
    if bf16_block is not None:
        with torch.no_grad():
            start_loss = F.mse_loss(bf16_block(data), target).item()
        bf16_loss, _ = train(bf16_block, data, target, args.steps,
                             f"mok.nn.MoE ({'GPU' if on_gpu else 'CPU backend'}, bf16)", group, ranks, True,
                             log)
        # NOTE: measured against the starting loss: bf16's own final loss can be near 0, where FP8
        # stops at its quantization's noise floor.
        log(f"final loss: mok {args.precision} {mok_loss:.5f}, mok bf16 {bf16_loss:.5f}; "
            f"{args.precision} - bf16 = {mok_loss - bf16_loss:+.5f}, "
            f"{abs(mok_loss - bf16_loss) / start_loss:.2%} of the starting loss {start_loss:.5f}")
    torch_loss, torch_rate = train(torch_block, data, target, args.steps, "torch-native MoE", group, ranks,
                                   False, log)
    log(f"final loss: mok {mok_loss:.5f}, torch-native {torch_loss:.5f}")
    log(f"training tokens/s per rank: mok {mok_rate:,.0f}, torch-native {torch_rate:,.0f} "
        f"({mok_rate / torch_rate:.2f}x)")
    if on_gpu:
        tokens = data.reshape(-1, hidden)
        mok_ms, torch_ms = forward_ms(moe, tokens), forward_ms(torch_block.moe, tokens)
        count = tokens.shape[0]
        log(f"MoE layer forward alone, {count} tokens per rank: mok {mok_ms:.3f} ms "
            f"({count / mok_ms * 1e3:,.0f} tokens/s), torch-native {torch_ms:.3f} ms "
            f"({count / torch_ms * 1e3:,.0f} tokens/s), {torch_ms / mok_ms:.2f}x")
        mok.functional.check_errors(moe._workspace, device=device)
    if ranks > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
