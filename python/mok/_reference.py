"""REFERENCE backward for CUDA tensors, in plain PyTorch: what mok::backward runs on the GPU until
mok's own GPU backward exists (a later issue). It is NOT mok's kernel and not part of the
determinism contract: fp32 PyTorch matmuls, one Python loop over the local experts, host syncs for
the row counts, and, at EP > 1, torch.distributed.all_to_all_single over the layer's process group
to move token rows to their experts' ranks and the results back. Its purpose is to let models
train on GPU with mok's forward; its accuracy is that of an fp32 recompute.

Math (DESIGN.md §1, the CPU reference's formulas): for a row of token t in slot j with expert e and
router weight w, g = W_gate x, u = W_up x, h = silu(g)·u; gvec = W_downᵀ dy (unscaled dy);
d_w = <gvec, h>; d_h = w·gvec; d_g = d_h·u·silu'(g); d_u = d_h·silu(g);
dx += W_gateᵀ d_g + W_upᵀ d_u; dW_gate += d_g xᵀ, dW_up += d_u xᵀ, dW_down += w·dy hᵀ.
The shared expert is the same with w = 1 over every token. Each rank's weight gradients cover its
own experts over every rank's tokens; the shared expert's, this rank's tokens only (all-reduce
them like any data-parallel weight).
"""

from __future__ import annotations

import torch

GATE_UP_BLOCK = 8  # rows per gate (or up) block of the interleaved gate/up layout


def split_gate_up(fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., 2I, H) interleaved in blocks of 8 rows -> gate, up (..., I, H) (new tensors)."""
    *lead, rows, hidden = fused.shape
    blocks = fused.reshape(*lead, rows // (2 * GATE_UP_BLOCK), 2, GATE_UP_BLOCK, hidden)
    return (blocks.select(-3, 0).reshape(*lead, rows // 2, hidden),
            blocks.select(-3, 1).reshape(*lead, rows // 2, hidden))


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up (..., I, H) -> (..., 2I, H): rows 16b..16b+7 are gate rows 8b..8b+7, rows
    16b+8..16b+15 up rows 8b..8b+7 (the layout of gemm::interleave_gate_up). I % 8 == 0."""
    *lead, rows, hidden = gate.shape
    if rows % GATE_UP_BLOCK:
        raise ValueError(f"gate/up: the fused layout needs I to be a multiple of {GATE_UP_BLOCK}, got I = {rows}")
    blocks = (*lead, rows // GATE_UP_BLOCK, GATE_UP_BLOCK, hidden)
    return torch.stack((gate.reshape(blocks), up.reshape(blocks)), dim=-3).reshape(*lead, 2 * rows, hidden)


def _expert_backward(x, dy, weight, gate, up, down):
    """One expert over its rows, fp32: x, dy (n, H); weight (n,); gate, up (I, H); down (H, I).
    Returns dx (n, H), d_weight (n,), grad_gate, grad_up (I, H), grad_down (H, I)."""
    xf, dyf = x.float(), dy.float()
    gate, up, down = gate.float(), up.float(), down.float()
    g, u = xf @ gate.t(), xf @ up.t()
    sigmoid = torch.sigmoid(g)
    silu = g * sigmoid
    h = silu * u
    gvec = dyf @ down
    d_weight = (gvec * h).sum(-1)
    d_h = weight[:, None] * gvec
    d_g = d_h * u * (sigmoid * (1 + g * (1 - sigmoid)))
    d_u = d_h * silu
    dx = d_g @ gate + d_u @ up
    return dx, d_weight, d_g.t() @ xf, d_u.t() @ xf, (weight[:, None] * dyf).t() @ h


def _local_experts_backward(x, dy, weight, local_expert, w_gate_up, w_down):
    """Rows already on the rank of their expert, in global-token order. Returns per row dx (n, H)
    fp32 and d_weight (n,), and the local experts' fp32 gradients (fused gate/up layout)."""
    num_local, _, hidden = w_gate_up.shape
    gate, up = split_gate_up(w_gate_up)
    order = torch.argsort(local_expert, stable=True)  # expert-major, token order kept
    counts = torch.bincount(local_expert, minlength=num_local).tolist()  # host sync: reference
    rows = x.shape[0]
    dx = torch.zeros(rows, hidden, dtype=torch.float32, device=x.device)
    d_weight = torch.zeros(rows, dtype=torch.float32, device=x.device)
    grad_gate = torch.zeros(gate.shape, dtype=torch.float32, device=x.device)
    grad_up = torch.zeros_like(grad_gate)
    grad_down = torch.zeros(w_down.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picked = order[start:start + count]
        start += count
        dx[picked], d_weight[picked], grad_gate[expert], grad_up[expert], grad_down[expert] = _expert_backward(
            x[picked], dy[picked], weight[picked], gate[expert], up[expert], w_down[expert])
    return dx, d_weight, fuse_gate_up(grad_gate, grad_up), grad_down


def _exchange(tensor, receive_counts, send_counts, group):
    """all_to_all_single of rows: send_counts[r] rows to rank r, receive_counts[r] from it."""
    import torch.distributed as dist

    out = tensor.new_empty((sum(receive_counts), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=receive_counts,
                           input_split_sizes=send_counts, group=group)
    return out


def backward(dy, x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up=None,
             w_shared_down=None, group=None):
    """mok::backward's outputs for this rank: dx (T, H) bf16, d_topk_w (T, k) fp32, and fp32
    gradients of w_gate_up, w_down, w_shared_gate_up, w_shared_down (empty (0,) without a shared
    expert). `group`: the expert-parallel process group (None: EP = 1). Collective when the group
    has more than one rank."""
    num_tokens, hidden = x.shape
    top_k = topk_idx.shape[1]
    num_local = w_gate_up.shape[0]
    num_ranks, rank = 1, 0
    if group is not None:
        import torch.distributed as dist

        num_ranks, rank = dist.get_world_size(group), dist.get_rank(group)

    flat_idx = topk_idx.reshape(-1).long()
    used = (flat_idx >= 0).nonzero().squeeze(1)  # slot positions t*k + j, in token order
    expert = flat_idx[used]
    tokens = used // top_k
    rows_x, rows_dy = x[tokens], dy[tokens]
    rows_w = topk_w.reshape(-1)[used].float()
    if num_ranks == 1:
        dx_rows, d_w, grad_gate_up, grad_down = _local_experts_backward(
            rows_x, rows_dy, rows_w, expert, w_gate_up, w_down)
    else:
        destination = expert // num_local
        order = torch.argsort(destination, stable=True)  # by destination rank, token order kept
        used, expert, rows_x, rows_dy, rows_w = (t[order] for t in (used, expert, rows_x, rows_dy, rows_w))
        send = torch.bincount(destination[order], minlength=num_ranks)
        receive = torch.empty_like(send)
        import torch.distributed as dist

        dist.all_to_all_single(receive, send, group=group)
        send, receive = send.tolist(), receive.tolist()  # host sync: reference
        # Received rows come source rank by source rank, each in token order: global-token order.
        got_x = _exchange(rows_x, receive, send, group)
        got_dy = _exchange(rows_dy, receive, send, group)
        got_w = _exchange(rows_w, receive, send, group)
        got_expert = _exchange(expert, receive, send, group) - rank * num_local
        got_dx, got_d_w, grad_gate_up, grad_down = _local_experts_backward(
            got_x, got_dy, got_w, got_expert, w_gate_up, w_down)
        back = _exchange(torch.cat((got_dx, got_d_w[:, None]), dim=1), send, receive, group)
        dx_rows, d_w = back[:, :hidden], back[:, hidden]

    # One slot per (t, j): no two rows write the same place, and dx sums the slots in j order.
    slot_dx = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    slot_dx[used] = dx_rows
    d_topk_w = torch.zeros(num_tokens * top_k, dtype=torch.float32, device=x.device)
    d_topk_w[used] = d_w
    dx = slot_dx.view(num_tokens, top_k, hidden).sum(1)
    empty = torch.empty((0,), dtype=torch.float32, device=x.device)
    grad_shared_gate_up, grad_shared_down = empty, empty
    if w_shared_gate_up is not None:
        shared_gate, shared_up = split_gate_up(w_shared_gate_up)
        ones = torch.ones(num_tokens, dtype=torch.float32, device=x.device)
        shared_dx, _, grad_shared_gate, grad_shared_up, grad_shared_down = _expert_backward(
            x, dy, ones, shared_gate, shared_up, w_shared_down)
        dx = dx + shared_dx
        grad_shared_gate_up = fuse_gate_up(grad_shared_gate, grad_shared_up)
    return (dx.to(torch.bfloat16), d_topk_w.view(num_tokens, top_k), grad_gate_up, grad_down,
            grad_shared_gate_up, grad_shared_down)
