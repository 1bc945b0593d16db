"""mok.nn.MoE: router + shared expert + routed SwiGLU experts, computed by mok."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from . import functional


class MoE(nn.Module):
    """A Mixture-of-Experts feed-forward layer.

    Router: logits = x · routerᵀ in fp32, scores by softmax (Mixtral, Qwen3) or sigmoid
    (DeepSeek-V3), the top-k scores become the router weights (renormalised to sum 1 when
    `normalize_topk`). Experts: SwiGLU, F(x) = W_down (silu(W_gate x) * W_up x); the optional
    shared expert sees every token. Parameters are laid out as mok wants them:
    w_gate, w_up (E_local, I, H), w_down (E_local, H, I), [.., out, in].

    Input (..., H) of any float dtype (computed in bf16); output (..., H) bf16.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 shared_intermediate: int = 0, score_func: str = "softmax",
                 normalize_topk: bool = True, process_group=None,
                 config: Optional[functional.MoKConfig] = None,
                 dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func: 'softmax' or 'sigmoid', got {score_func!r}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k: must be in [1, {num_experts}], got {top_k}")
        self.shape = functional.LayerShape(hidden, intermediate, num_experts, top_k, shared_intermediate)
        self.score_func = score_func
        self.normalize_topk = normalize_topk
        self.process_group = process_group
        self.config = config or functional.MoKConfig()
        ep_size, _ = functional._ep_placement(process_group)
        if num_experts % ep_size:
            raise ValueError(f"num_experts: {num_experts} experts do not divide over {ep_size} ranks")
        local = num_experts // ep_size
        factory = dict(dtype=dtype, device=device)
        self.router = nn.Parameter(torch.empty(num_experts, hidden, dtype=torch.float32, device=device))
        self.w_gate = nn.Parameter(torch.empty(local, intermediate, hidden, **factory))
        self.w_up = nn.Parameter(torch.empty(local, intermediate, hidden, **factory))
        self.w_down = nn.Parameter(torch.empty(local, hidden, intermediate, **factory))
        if shared_intermediate:
            self.w_shared_gate = nn.Parameter(torch.empty(shared_intermediate, hidden, **factory))
            self.w_shared_up = nn.Parameter(torch.empty(shared_intermediate, hidden, **factory))
            self.w_shared_down = nn.Parameter(torch.empty(hidden, shared_intermediate, **factory))
        else:
            self.register_parameter("w_shared_gate", None)
            self.register_parameter("w_shared_up", None)
            self.register_parameter("w_shared_down", None)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        hidden, inter = self.shape.hidden, self.shape.intermediate
        nn.init.normal_(self.router, std=1 / math.sqrt(hidden))
        for weight, fan_in in ((self.w_gate, hidden), (self.w_up, hidden), (self.w_down, inter),
                               (self.w_shared_gate, hidden), (self.w_shared_up, hidden),
                               (self.w_shared_down, self.shape.shared_intermediate)):
            if weight is not None:
                nn.init.normal_(weight, std=1 / math.sqrt(fan_in))

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) tokens -> topk_idx (T, k) int32, topk_w (T, k) fp32."""
        logits = tokens.float() @ self.router.t()
        scores = logits.softmax(dim=-1) if self.score_func == "softmax" else logits.sigmoid()
        topk_w, topk_idx = scores.topk(self.shape.top_k, dim=-1)
        if self.normalize_topk and self.shape.top_k > 1:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        return topk_idx.to(torch.int32), topk_w

    def expert_weights(self) -> functional.ExpertWeights:
        def bf16(weight):
            return None if weight is None else weight.to(torch.bfloat16)
        return functional.ExpertWeights(bf16(self.w_gate), bf16(self.w_up), bf16(self.w_down),
                                        bf16(self.w_shared_gate), bf16(self.w_shared_up),
                                        bf16(self.w_shared_down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        tokens = x.reshape(-1, self.shape.hidden)
        topk_idx, topk_w = self.route(tokens)
        y = functional.forward(tokens.to(torch.bfloat16).contiguous(), topk_idx, topk_w.contiguous(),
                               self.expert_weights())
        return y.reshape(*leading, self.shape.hidden)

    def extra_repr(self) -> str:
        s = self.shape
        return (f"hidden={s.hidden}, intermediate={s.intermediate}, num_experts={s.num_experts}, "
                f"top_k={s.top_k}, shared_intermediate={s.shared_intermediate}, score_func={self.score_func}")
