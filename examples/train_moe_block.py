"""Trains a small transformer block whose feed-forward is mok.nn.MoE, next to the same block with
a plain-PyTorch MoE, on synthetic data (a fixed random teacher), and prints loss and tokens/s.

    python examples/train_moe_block.py [--steps 200] [--device cpu] [--batch 8] [--seq 64]

Forward and backward of the MoE run on mok (CPU tensors: mok's CPU backend; the GPU layer is not
in this build yet). The torch-native module is the comparison.
"""

import argparse
import copy
import time

import torch
import torch.nn.functional as F
from torch import nn

import mok


class TorchMoE(nn.Module):
    """The same layer in plain PyTorch (a loop over experts), sharing mok.nn.MoE's parameters' layout."""

    def __init__(self, reference: mok.nn.MoE):
        super().__init__()
        self.inner = copy.deepcopy(reference)

    def forward(self, x):
        m = self.inner
        tokens = x.reshape(-1, m.shape.hidden)
        topk_idx, topk_w = m.route(tokens)
        xb = tokens.to(torch.bfloat16).float()
        y = torch.zeros_like(xb)
        if m.w_shared_gate is not None:
            y = y + (F.silu(xb @ m.w_shared_gate.float().t()) * (xb @ m.w_shared_up.float().t())) @ m.w_shared_down.float().t()
        for j in range(m.shape.top_k):
            for expert in range(m.shape.num_experts):
                rows = (topk_idx[:, j] == expert).nonzero().flatten()
                if rows.numel():
                    h = F.silu(xb[rows] @ m.w_gate[expert].float().t()) * (xb[rows] @ m.w_up[expert].float().t())
                    y = y.index_add(0, rows, topk_w[rows, j, None] * (h @ m.w_down[expert].float().t()))
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


def train(model, data, target, steps, label):
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    tokens = data.shape[0] * data.shape[1]
    start, first_loss = time.perf_counter(), None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(data), target)
        loss.backward()
        optimizer.step()
        first_loss = loss.item() if first_loss is None else first_loss
        if step % max(1, steps // 5) == 0 or step == steps - 1:
            print(f"  [{label}] step {step:4d}  loss {loss.item():.5f}", flush=True)
    seconds = time.perf_counter() - start
    print(f"  [{label}] {steps} steps in {seconds:.2f} s: {steps * tokens / seconds:,.0f} tokens/s "
          f"(forward + backward + optimizer); loss {first_loss:.4f} -> {loss.item():.4f}")
    return loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args()

    torch.manual_seed(0)
    hidden = args.hidden
    moe = mok.nn.MoE(hidden, 2 * hidden, num_experts=8, top_k=2, shared_intermediate=hidden,
                     dtype=torch.float32, device=args.device)
    mok_block = Block(hidden, 4, moe).to(args.device)
    torch_block = copy.deepcopy(mok_block)
    torch_block.moe = TorchMoE(moe)

    teacher = Block(hidden, 4, mok.nn.MoE(hidden, 2 * hidden, 8, 2, dtype=torch.float32)).to(args.device)
    data = torch.randn(args.batch, args.seq, hidden, device=args.device)
    with torch.no_grad():
        target = teacher(data)

    print(f"training a transformer block (H {hidden}, 8 experts, top-2, shared expert) for {args.steps} steps, "
          f"{args.batch}x{args.seq} tokens per step on {args.device}")
    mok_loss = train(mok_block, data, target, args.steps, "mok.nn.MoE (mok backend: forward and backward)")
    torch_loss = train(torch_block, data, target, args.steps, "torch-native MoE")
    print(f"final loss: mok {mok_loss:.5f}, torch-native {torch_loss:.5f}")


if __name__ == "__main__":
    main()
