"""mok.nn.MoE: router + shared expert + routed SwiGLU experts, computed by mok."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import functional
from ._reference import GATE_UP_BLOCK


class MoE(nn.Module):
    """A Mixture-of-Experts feed-forward layer.

    Router: logits = x · routerᵀ in fp32, scores by softmax (Mixtral, Qwen3) or sigmoid
    (DeepSeek-V3), the top-k scores become the router weights (renormalised to sum 1 when
    `normalize_topk`). Experts: SwiGLU, F(x) = W_down (silu(W_gate x) * W_up x); the optional
    shared expert sees every token. Parameters are kept in the layout mok computes on, so a call
    passes them as they are (no copy when they are bf16):
    w_gate_up (E_local, 2I, H) with gate and up rows interleaved in blocks of 8 (`gate` and `up`
    give them apart; `mok.functional.split_gate_up`), w_down (E_local, H, I),
    w_shared_gate_up (2I_s, H) interleaved alike, w_shared_down (H, I_s). I and I_s are multiples
    of 8. Other dtypes are kept as given and cast to bf16 on every call.

    Input (..., H) of any float dtype (computed in bf16); output (..., H) bf16. CPU tensors run
    mok's CPU backend, forward and backward, in `config.precision` (bf16, fp8 or mxfp8). CUDA
    tensors run mok's GPU layer forward and backward in the same precisions (fp8 and mxfp8: its
    weights quantized once per change of them, e.g. per optimizer step, into a cache that forward
    and backward share).

    Expert parallelism: with `process_group` of R ranks, rank r holds experts r*E/R .. and the
    first CUDA call makes the workspace collectively (every rank calls the module). Its capacity is
    `max_tokens_per_rank`, or, when None, the largest token count of that first call over the
    ranks, rounded up to a multiple of 256; a later call with more tokens on a rank raises
    ValueError. Making the workspace talks to the group, so it stays outside torch.compile: call
    the module once eagerly before compiling with fullgraph=True. The router and the shared expert
    are replicated: average their gradients over the group like data-parallel weights
    (examples/train_moe_block.py shows it).

    context: what autograd keeps for the backward, "save" (the gate/up pre-activations, the
    faster backward) or "recompute" (the inputs only; see mok.functional.forward). The FP8 modes
    keep the inputs only, whichever.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 shared_intermediate: int = 0, score_func: str = "softmax",
                 normalize_topk: bool = True, process_group=None,
                 config: Optional[functional.MoKConfig] = None,
                 max_tokens_per_rank: Optional[int] = None,
                 dtype: torch.dtype = torch.bfloat16, device=None, context: str = "save"):
        super().__init__()
        if context not in functional.CONTEXTS:
            raise ValueError(f"context: one of {functional.CONTEXTS}, got {context!r}")
        self.context = context
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func: 'softmax' or 'sigmoid', got {score_func!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k: must be in [1, {num_experts}], got {top_k}")
        for name, value in (("intermediate", intermediate), ("shared_intermediate", shared_intermediate)):
            if value % GATE_UP_BLOCK:
                raise ValueError(f"{name}: must be a multiple of {GATE_UP_BLOCK} (gate and up are stored "
                                 f"interleaved in blocks of {GATE_UP_BLOCK} rows), got {value}")
        self.shape = functional.LayerShape(hidden, intermediate, num_experts, top_k, shared_intermediate)
        self.score_func = score_func
        self.normalize_topk = normalize_topk
        self.process_group = process_group
        self.config = config or functional.MoKConfig()
        self.max_tokens_per_rank = max_tokens_per_rank
        self.ep_size, self.ep_rank = functional._ep_placement(process_group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts: {num_experts} experts do not divide over {self.ep_size} ranks")
        self._workspace: Optional[functional.Workspace] = None
        local = num_experts // self.ep_size
        factory = dict(dtype=dtype, device=device)
        self.router = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32, device=device))
        self.w_gate_up = nn.Parameter(torch.empty(local, 2 * intermediate, hidden, **factory))
        self.w_down = nn.Parameter(torch.empty(local, hidden, intermediate, **factory))
        if shared_intermediate:
            self.w_shared_gate_up = nn.Parameter(torch.empty(2 * shared_intermediate, hidden, **factory))
            self.w_shared_down = nn.Parameter(torch.empty(hidden, shared_intermediate, **factory))
        else:
            self.register_parameter("w_shared_gate_up", None)
            self.register_parameter("w_shared_down", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        hidden, inter = self.shape.hidden, self.shape.intermediate
        nn.init.normal_(self.router, std=1 / math.sqrt(hidden))
        for weight, fan_in in ((self.w_gate_up, hidden), (self.w_down, inter),
                               (self.w_shared_gate_up, hidden),
                               (self.w_shared_down, self.shape.shared_intermediate)):
            if weight is not None:
                nn.init.normal_(weight, std=1 / math.sqrt(fan_in))

    @property
    def gate(self) -> torch.Tensor:
        """The routed gate weights (E_local, I, H), a new tensor."""
        return functional.split_gate_up(self.w_gate_up)[0]

    @property
    def up(self) -> torch.Tensor:
        """The routed up weights (E_local, I, H), a new tensor."""
        return functional.split_gate_up(self.w_gate_up)[1]

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) tokens -> topk_idx (T, k) int32, topk_w (T, k) fp32."""
        logits = tokens.float() @ self.router.t()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        topk_w, topk_idx = scores.topk(self.shape.top_k, dim=-1)
        if self.normalize_topk and self.shape.top_k > 1:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        return topk_idx.to(torch.int32), topk_w

    def expert_weights(self) -> functional.FusedExpertWeights:
        def bf16(weight):
            return None if weight is None else weight.to(torch.bfloat16)
        return functional.FusedExpertWeights(bf16(self.w_gate_up), bf16(self.w_down),
                                             bf16(self.w_shared_gate_up), bf16(self.w_shared_down))

    @torch.compiler.disable
    def _make_workspace(self, num_tokens: int, device: torch.device) -> None:
        """The EP workspace, made collectively on the first call (eager: it talks to the group)."""
        capacity = self.max_tokens_per_rank
        if capacity is None:
            largest = torch.tensor([num_tokens], dtype=torch.int64, device=device)
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX, group=self.process_group)
            capacity = max(256, -(-int(largest.item()) // 256) * 256)
        self._workspace = functional.get_workspace(self.shape, capacity, device, self.process_group, self.config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        tokens = x.reshape(-1, self.shape.hidden)
        topk_idx, topk_w = self.route(tokens)
        handle = 0  # EP = 1: no workspace (CPU) or the device's automatic one (CUDA)
        if self.ep_size > 1:
            if self._workspace is None:
                self._make_workspace(tokens.shape[0], tokens.device)
            handle = self._workspace.handle
        weights = self.expert_weights()
        y = functional.forward(tokens.to(torch.bfloat16).contiguous(), topk_idx, topk_w.contiguous(),
                               weights, self._workspace if handle else None, self.context,
                               None if handle else self.config)
        return y.reshape(*leading, self.shape.hidden)

    def extra_repr(self) -> str:
        s = self.shape
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, num_experts={s.num_experts}, "
                f"top_k={s.top_k}, shared_intermediate={s.shared_intermediate}, score_func={self.score_func}, "
                f"ep={self.ep_size}, context={self.context}")
