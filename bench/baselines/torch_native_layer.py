"""The torch-native MoE layer that torch_native.py checks and times (its docstring describes the
layer, the variants and the weight layouts): the experts' weights drawn as bench_layer draws its
own, the all-to-all under autograd, torch._grouped_mm (or a loop of matmuls on a CPU without it),
the layer and its combines.
"""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import rowwise_fp8  # bench/baselines/rowwise_fp8.py
from data import seeded_generator, uniform_std  # bench/baselines/data.py

# Seeds: expert e's weights from WEIGHT_SEED + 2e (gate/up) and + 2e + 1 (down).
WEIGHT_SEED = 1_000_000
SHARED_SEED = 999_000


def draw_expert(shape, expert, device):
    """Expert `expert`'s bf16 weights in [out, in] layout: gate/up (2I, H) and down (H, I), the
    same on every rank (drawn from generators seeded by the expert's global id)."""
    hidden, inter = shape["hidden"], shape["intermediate"]
    gate_up = uniform_std(2 * inter, hidden, std=1.0 / math.sqrt(hidden), device=device,
                          generator=seeded_generator(WEIGHT_SEED + 2 * expert, device))
    down = uniform_std(hidden, inter, std=1.0 / math.sqrt(inter), device=device,
                       generator=seeded_generator(WEIGHT_SEED + 2 * expert + 1, device))
    return gate_up, down


class ExpertWeights:
    """One rank's bf16 weights: its E_l routed experts and the shared expert, in one layout.

    Layout "out_in": gate_up (E_l, 2I, H), down (E_l, H, I), shared (2I_s, H) and (H, I_s), as
    mok's; "in_out" ("kn"): each transposed and contiguous. The *_operand methods give the
    (.., K, N) operand of x @ W in either layout."""

    NAMES = ("gate_up", "down", "shared_gate_up", "shared_down")

    def __init__(self, shape, first_expert, num_local, device):
        hidden, inter, shared = shape["hidden"], shape["intermediate"], shape["shared_intermediate"]
        self.layout = "out_in"
        self.gate_up = torch.empty(num_local, 2 * inter, hidden, dtype=torch.bfloat16, device=device)
        self.down = torch.empty(num_local, hidden, inter, dtype=torch.bfloat16, device=device)
        for local in range(num_local):
            self.gate_up[local], self.down[local] = draw_expert(shape, first_expert + local, device)
        self.shared_gate_up = self.shared_down = None
        if shared > 0:
            self.shared_gate_up = uniform_std(2 * shared, hidden, std=1.0 / math.sqrt(hidden),
                                              device=device,
                                              generator=seeded_generator(SHARED_SEED, device))
            self.shared_down = uniform_std(hidden, shared, std=1.0 / math.sqrt(shared),
                                           device=device,
                                           generator=seeded_generator(SHARED_SEED + 1, device))

    def tensors(self):
        return [t for t in (getattr(self, name) for name in self.NAMES) if t is not None]

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def set_requires_grad(self, flag):
        for tensor in self.tensors():
            tensor.grad = None
            tensor.requires_grad_(flag)

    def to_layout(self, layout):
        """Stores every weight in `layout` ("out_in" or "in_out"), freeing the old copy."""
        assert layout in ("out_in", "in_out"), f"layout: unknown '{layout}'"
        if layout == self.layout:
            return
        for name in self.NAMES:
            tensor = getattr(self, name)
            if tensor is not None:
                setattr(self, name, None)  # the old copy goes as the new one comes
                setattr(self, name, tensor.detach().transpose(-2, -1).contiguous())
                del tensor
        self.layout = layout

    def operand(self, tensor):
        """(.., K, N) view of a weight for x @ W."""
        return tensor.transpose(-2, -1) if self.layout == "out_in" else tensor

    def canonical(self, tensor):
        """A weight-shaped tensor (a weight or its gradient) in [out, in] layout."""
        return tensor if self.layout == "out_in" else tensor.transpose(-2, -1)


class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with autograd: the gradient goes back by the reverse exchange."""

    @staticmethod
    def forward(ctx, rows, receive_counts, send_counts):
        ctx.counts = (receive_counts, send_counts)
        received = rows.new_empty(sum(receive_counts), rows.shape[1])
        dist.all_to_all_single(received, rows.contiguous(), receive_counts, send_counts)
        return received

    @staticmethod
    def backward(ctx, grad_received):
        receive_counts, send_counts = ctx.counts
        grad_rows = grad_received.new_empty(sum(send_counts), grad_received.shape[1])
        dist.all_to_all_single(grad_rows, grad_received.contiguous(), send_counts, receive_counts)
        return grad_rows, None, None


_CPU_GROUPED_MM = None  # whether this torch has a CPU torch._grouped_mm (probed once)


def cpu_has_grouped_mm():
    global _CPU_GROUPED_MM
    if _CPU_GROUPED_MM is None:
        try:
            rows = torch.ones(4, 8, dtype=torch.bfloat16, requires_grad=True)
            weight = torch.ones(2, 8, 8, dtype=torch.bfloat16, requires_grad=True)
            offs = torch.tensor([1, 4], dtype=torch.int32)
            product = torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offs)
            product.backward(torch.ones_like(product))
            _CPU_GROUPED_MM = bool(torch.equal(weight.grad[0, 0], torch.full((8,), 1.0,
                                                                            dtype=torch.bfloat16)))
        except (AttributeError, RuntimeError, NotImplementedError):
            _CPU_GROUPED_MM = False
    return _CPU_GROUPED_MM


def grouped_mm(rows, weight, offs, loop=False):
    """rows (M, K), grouped by `offs` (int32 cumulative row ends, one per expert), times weight
    (E, K, N): torch._grouped_mm; on the CPU, where it is missing or `loop` is asked for, a loop
    of per-expert matmuls (same products, fp32 accumulation, bf16 result)."""
    if rows.is_cuda or (not loop and cpu_has_grouped_mm()):
        return torch._grouped_mm(rows, weight, offs=offs)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    pieces = [rows[start:end] @ weight[expert] for expert, (start, end) in enumerate(zip(starts, ends))]
    return torch.cat(pieces) if pieces else rows.new_empty(0, weight.shape[-1])


class TorchNativeLayer:
    """The layer at one rank of `world`; see the module docstring."""

    def __init__(self, shape, rank, world, device, full_topk, grouped_mm_loop=False):
        self.shape, self.rank, self.world, self.device = shape, rank, world, device
        self.local_experts = shape["num_experts"] // world
        self.first_expert = rank * self.local_experts
        self.full_topk = full_topk  # no unused (-1) slot: the EP 1 path needs no host sync
        self.grouped_mm_loop = grouped_mm_loop
        self.weights = ExpertWeights(shape, self.first_expert, self.local_experts, device)
        self.expert_ends = torch.arange(1, self.local_experts + 1, device=device)
        self.rank_ends = torch.arange(1, world + 1, device=device) * self.local_experts

    def forward(self, x, topk_idx, topk_w, combine):
        """y (T, H) bf16 of x (T, H) bf16, topk_idx (T, k) int32, topk_w (T, k) fp32."""
        shared = self.shared_expert(x)
        flat = topk_idx.reshape(-1).long()
        key = torch.where(flat >= 0, flat, self.shape["num_experts"])  # unused slots sort last
        order = torch.argsort(key, stable=True)
        sorted_key = key[order]
        if combine == "index_add":
            return self.forward_index_add(x, topk_w, shared, order, sorted_key)
        assert combine in ("batched_view", "batched_bmm"), f"combine: unknown '{combine}'"
        return self.forward_batched_view(x, topk_idx, topk_w, shared, order, sorted_key,
                                         bmm=combine == "batched_bmm")

    def shared_expert(self, x):
        inter = self.shape["shared_intermediate"]
        if inter == 0:
            return None
        weights = self.weights
        gate, up = (x @ weights.operand(weights.shared_gate_up)).split(inter, dim=-1)
        return ((F.silu(gate) * up) @ weights.operand(weights.shared_down)).float()

    def experts(self, rows, offs):
        weights = self.weights
        gate_up = grouped_mm(rows, weights.operand(weights.gate_up), offs, self.grouped_mm_loop)
        gate, up = gate_up.split(self.shape["intermediate"], dim=-1)
        return grouped_mm(F.silu(gate) * up, weights.operand(weights.down), offs,
                          self.grouped_mm_loop)

    def exchange_counts(self, send_counts):
        """Host lists (send, receive) of rows per rank from this rank's device counts."""
        if self.world == 1:
            send_list = send_counts.tolist()
            return send_list, send_list
        receive_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(receive_counts, send_counts)
        return send_counts.tolist(), receive_counts.tolist()

    def exchange_ids(self, ids, send_list, receive_list):
        if self.world == 1:
            return ids
        received = ids.new_empty(sum(receive_list))
        dist.all_to_all_single(received, ids, receive_list, send_list)
        return received

    def forward_index_add(self, x, topk_w, shared, order, sorted_key):
        top_k, local_experts = topk_w.shape[1], self.local_experts
        send_counts = torch.bincount(sorted_key // local_experts, minlength=self.world + 1)[: self.world]
        send_list, receive_list = self.exchange_counts(send_counts)
        num_sent = sum(send_list)
        pairs = order[:num_sent]
        rows = x[pairs // top_k]
        expert_ids = self.exchange_ids(sorted_key[:num_sent] % local_experts, send_list, receive_list)
        if self.world > 1:
            rows = AllToAll.apply(rows, receive_list, send_list)
        perm = torch.argsort(expert_ids, stable=True)
        offs = torch.cumsum(torch.bincount(expert_ids, minlength=local_experts), 0).to(torch.int32)
        out_sorted = self.experts(rows[perm], offs)
        out = torch.empty_like(out_sorted)
        out[perm] = out_sorted
        if self.world > 1:
            out = AllToAll.apply(out, send_list, receive_list)
        if shared is None:
            shared = torch.zeros(x.shape[0], x.shape[1], device=x.device, dtype=torch.float32)
        weights = topk_w.reshape(-1)[pairs]
        return shared.index_add_(0, pairs // top_k, out.float() * weights[:, None]).to(torch.bfloat16)

    def forward_batched_view(self, x, topk_idx, topk_w, shared, order, sorted_key, bmm):
        num_tokens, top_k = topk_idx.shape
        if self.world == 1:
            pairs, offs = self.local_groups(order, sorted_key, num_tokens * top_k)
            out = self.experts(x[pairs // top_k], offs)
        else:
            ends = torch.searchsorted(sorted_key, self.rank_ends)
            send_counts = torch.diff(ends, prepend=ends.new_zeros(1))
            send_list, receive_list = self.exchange_counts(send_counts)
            num_sent = sum(send_list)
            pairs = order[:num_sent]
            rows = AllToAll.apply(x[pairs // top_k], receive_list, send_list)
            expert_ids = self.exchange_ids(sorted_key[:num_sent] % self.local_experts, send_list,
                                           receive_list)
            perm = torch.argsort(expert_ids, stable=True)
            offs = torch.searchsorted(expert_ids[perm], self.expert_ends).to(torch.int32)
            out_sorted = self.experts(rows[perm], offs)
            out = AllToAll.apply(out_sorted[inverse_permutation(perm)], send_list, receive_list)
        return combine_slots(out, order, topk_idx, topk_w, shared, bmm)

    def local_groups(self, order, sorted_key, num_slots):
        """At EP 1: (pairs, offs) of the sorted (token, slot) pairs that have an expert, and the
        int32 cumulative row ends per expert; no host sync where every slot has one."""
        if self.full_topk:
            num_sent = num_slots
        else:  # unused slots sorted last: count the used ones (a host sync)
            num_sent = int(torch.searchsorted(sorted_key, self.rank_ends)[0])
        offs = torch.searchsorted(sorted_key[:num_sent], self.expert_ends).to(torch.int32)
        return order[:num_sent], offs

    def forward_fp8(self, x, topk_idx, topk_w, combine, fp8_experts):
        """y (T, H) bf16 as forward's, every GEMM in FP8 (rowwise_fp8.RowwiseFp8Experts); x is
        quantized per token row once, before dispatch, and its rows and scales gathered. EP 1."""
        assert self.world == 1, f"forward_fp8: EP 1 only, got EP {self.world}"
        assert combine in ("batched_view", "batched_bmm"), f"combine: unknown '{combine}'"
        x_data, x_scale = rowwise_fp8.quantize(x)  # (T, H) e4m3, (T,) fp32
        shared = fp8_experts.shared(x_data, x_scale)
        flat = topk_idx.reshape(-1).long()
        key = torch.where(flat >= 0, flat, self.shape["num_experts"])  # unused slots sort last
        order = torch.argsort(key, stable=True)
        num_tokens, top_k = topk_idx.shape
        pairs, offs = self.local_groups(order, key[order], num_tokens * top_k)
        tokens = pairs // top_k
        out = fp8_experts.routed(rowwise_fp8.gather_rows(x_data, tokens), x_scale[tokens], offs)
        return combine_slots(out, order, topk_idx, topk_w, shared, bmm=combine == "batched_bmm")

    # -- the fp32 reference, for the checks

    def expert_weights_fp32(self, expert):
        """Expert `expert`'s ([2I, H], [H, I]) weights in fp32: this rank's, or drawn again."""
        local = expert - self.first_expert
        if 0 <= local < self.local_experts:
            weights = self.weights
            return (weights.canonical(weights.gate_up[local]).float(),
                    weights.canonical(weights.down[local]).float())
        gate_up, down = draw_expert(self.shape, expert, self.device)
        return gate_up.float(), down.float()

    @torch.no_grad()
    def reference(self, x, topk_idx, topk_w):
        """fp32 y (T, H) of the layer's definition (DESIGN.md §1) for a few tokens."""
        inter, shared_inter = self.shape["intermediate"], self.shape["shared_intermediate"]
        x = x.float()
        y = torch.zeros_like(x)
        weights = self.weights
        if shared_inter > 0:
            gate, up = (x @ weights.canonical(weights.shared_gate_up).float().t()).split(shared_inter, -1)
            y += (F.silu(gate) * up) @ weights.canonical(weights.shared_down).float().t()
        for expert in torch.unique(topk_idx[topk_idx >= 0]).tolist():
            tokens, slots = (topk_idx == expert).nonzero(as_tuple=True)
            gate_up, down = self.expert_weights_fp32(expert)
            gate, up = (x[tokens] @ gate_up.t()).split(inter, -1)
            out = (F.silu(gate) * up) @ down.t()
            y.index_add_(0, tokens, out * topk_w[tokens, slots].float()[:, None])
        return y


def combine_slots(out, order, topk_idx, topk_w, shared, bmm):
    """The batched combine: y (T, H) bf16 from the expert rows `out` in sorted order (those of
    the slots with an expert: order's first out.shape[0]), each token's k rows gathered into slot
    order, weighted and summed in fp32, plus the shared expert's fp32 output, rounded once."""
    num_tokens, top_k = topk_idx.shape
    num_slots, num_sent = num_tokens * top_k, out.shape[0]
    if num_sent < num_slots:
        out = torch.cat([out, out.new_zeros(num_slots - num_sent, out.shape[1])])
        topk_w = torch.where(topk_idx >= 0, topk_w, torch.zeros_like(topk_w))
    slots = out[inverse_permutation(order)].view(num_tokens, top_k, -1)
    if bmm:  # fp32 (torch's default matmul precision: no TF32)
        y = torch.bmm(topk_w.unsqueeze(1), slots.float()).squeeze(1)
    else:
        y = (slots.float() * topk_w.unsqueeze(-1)).sum(dim=1)
    if shared is not None:
        y = y + shared
    return y.to(torch.bfloat16)


def inverse_permutation(perm):
    """inverse[perm[i]] = i, by one scatter."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
