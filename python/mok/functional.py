"""The op-level API: config, workspace, schedule, forward, backward, recompute.

Shapes and dtypes (T tokens on this rank, H hidden, I expert intermediate, I_s shared
intermediate, E experts, k top-k):
    x          (T, H)        bfloat16
    topk_idx   (T, k)        int32 or int64, global expert ids, distinct per row, -1 = unused slot
    topk_w     (T, k)        float32, any sign
    w_gate     (E, I, H)     bfloat16   w_up the same, w_down (E, H, I)   ([.., out, in] layout)
    w_shared_* (I_s, H), (I_s, H), (H, I_s) bfloat16, or None for no shared expert
    y, dx      (T, H)        bfloat16;  d_topk_w (T, k) float32;  weight gradients float32
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

import torch

from . import _ops  # noqa: F401

PRECISIONS = ("bf16", "fp8", "mxfp8")
SUPPORTED_PRECISIONS = ("bf16",)


class ExpertWeights(NamedTuple):
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    w_shared_gate: Optional[torch.Tensor] = None
    w_shared_up: Optional[torch.Tensor] = None
    w_shared_down: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """Scheduling knobs of the GPU layer. None picks the heuristic's value. Results are bitwise
    the same for every setting (the determinism contract); only speed changes."""

    num_comm_sms: Optional[int] = None
    minibatch_tokens: Optional[int] = None
    ring_rows: Optional[int] = None
    precision: str = "bf16"

    def __post_init__(self):
        for name in ("num_comm_sms", "minibatch_tokens", "ring_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"MoKConfig.{name}: must be a positive int or None, got {value!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"MoKConfig.precision: unknown precision {self.precision!r} (one of {PRECISIONS})")
        if self.precision not in SUPPORTED_PRECISIONS:
            raise ValueError(f"MoKConfig.precision: {self.precision} is not implemented in this version; use bf16")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    hidden: int
    intermediate: int
    num_experts: int  # global
    top_k: int
    shared_intermediate: int = 0


@dataclasses.dataclass
class Workspace:
    """What one layer call needs besides its tensors, sized from shapes only. On the CPU backend
    that is the shapes and the expert-parallel placement; the GPU layer adds its symmetric
    memory window here."""

    shape: LayerShape
    max_tokens_per_rank: int
    device: torch.device
    config: MoKConfig
    ep_size: int = 1
    ep_rank: int = 0

    def check(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: ExpertWeights) -> None:
        shape = self.shape
        if x.device != self.device:
            raise ValueError(f"x: on {x.device}, the workspace is for {self.device}")
        if x.dim() != 2 or x.shape[1] != shape.hidden:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected (T, {shape.hidden})")
        if x.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"x: {x.shape[0]} tokens, the workspace holds at most {self.max_tokens_per_rank}")
        if topk_idx.shape != (x.shape[0], shape.top_k):
            raise ValueError(f"topk_idx: shape {tuple(topk_idx.shape)}, expected ({x.shape[0]}, {shape.top_k})")
        local = shape.num_experts // self.ep_size
        if weights.w_gate.shape[0] != local:
            raise ValueError(f"w_gate: {weights.w_gate.shape[0]} experts, this rank holds {local}")


_WORKSPACES: dict = {}


def _ep_placement(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def create_workspace(shape: LayerShape, max_tokens_per_rank: int, device, group=None,
                     config: Optional[MoKConfig] = None) -> Workspace:
    """A new workspace. `group` is the expert-parallel process group (None: this process alone)."""
    device = torch.device(device)
    config = config or MoKConfig()
    if max_tokens_per_rank <= 0:
        raise ValueError(f"max_tokens_per_rank: must be positive, got {max_tokens_per_rank}")
    if shape.top_k > shape.num_experts:
        raise ValueError(f"top_k: k = {shape.top_k} exceeds the number of experts E = {shape.num_experts}")
    ep_size, ep_rank = _ep_placement(group)
    if shape.num_experts % ep_size:
        raise ValueError(f"group: E = {shape.num_experts} experts do not divide over {ep_size} ranks")
    if device.type != "cpu":
        raise NotImplementedError(f"mok: the GPU layer is not in this build yet ({device}); use CPU tensors")
    if ep_size > 1:
        raise NotImplementedError("mok: expert parallelism across processes needs the GPU layer, "
                                  "which is not in this build yet")
    return Workspace(shape, max_tokens_per_rank, device, config, ep_size, ep_rank)


def get_workspace(shape: LayerShape, max_tokens_per_rank: int, device, group=None,
                  config: Optional[MoKConfig] = None) -> Workspace:
    """The cached workspace for (group, device, shape, capacity, config), created on first use."""
    key = (id(group), str(torch.device(device)), shape, max_tokens_per_rank, config or MoKConfig())
    if key not in _WORKSPACES:
        _WORKSPACES[key] = create_workspace(shape, max_tokens_per_rank, device, group, config)
    return _WORKSPACES[key]


@dataclasses.dataclass
class Schedule:
    counts: torch.Tensor   # (E,) rows per expert
    offsets: torch.Tensor  # (E + 1,) row ranges
    tokens: torch.Tensor   # (rows,) token of each row, per expert in token order
    slots: torch.Tensor    # (rows,) j of each row


def build_schedule(topk_idx: torch.Tensor, num_experts: int) -> Schedule:
    """Rows of each expert in token order: the order in which mok sums over an expert's rows."""
    tokens, k = topk_idx.shape
    flat = topk_idx.reshape(-1).to(torch.int64)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
        raise ValueError(f"topk_idx: expert ids must be in [-1, {num_experts})")
    used = flat >= 0
    positions = torch.arange(flat.numel(), device=flat.device)[used]
    order = torch.sort(flat[used] * flat.numel() + positions, stable=True).indices
    rows = positions[order]
    counts = torch.bincount(flat[used], minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, 0)
    return Schedule(counts, offsets, rows // k, rows % k)


def _weights_args(weights: ExpertWeights):
    return (weights.w_gate, weights.w_up, weights.w_down,
            weights.w_shared_gate, weights.w_shared_up, weights.w_shared_down)


def forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, weights: ExpertWeights,
            workspace: Optional[Workspace] = None) -> torch.Tensor:
    """y = S(x) + sum_j topk_w[:, j] * F_{topk_idx[:, j]}(x). Differentiable (autograd runs
    mok's backward)."""
    if workspace is not None:
        workspace.check(x, topk_idx, weights)
    return torch.ops.mok.forward(x, topk_idx, topk_w, *_weights_args(weights))


@dataclasses.dataclass
class Gradients:
    dx: torch.Tensor        # (T, H) bf16
    d_topk_w: torch.Tensor  # (T, k) fp32
    weights: ExpertWeights  # fp32, the shapes of the weights (shared None when there is none)


def backward(dy: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
             weights: ExpertWeights, main_grads: Optional[ExpertWeights] = None,
             workspace: Optional[Workspace] = None) -> Gradients:
    """Gradients of the layer for upstream gradient dy, all weight gradients in fp32. With
    `main_grads` (fp32 buffers shaped like the weights), each gradient is also added to its buffer
    in place. Recomputes the forward internally: nothing is saved between the calls."""
    if workspace is not None:
        workspace.check(x, topk_idx, weights)
    dx, d_topk_w, *grads = torch.ops.mok.backward(dy, x, topk_idx, topk_w, *_weights_args(weights))
    has_shared = weights.w_shared_gate is not None
    grads = ExpertWeights(*grads[:3], *(grads[3:] if has_shared else (None, None, None)))
    if main_grads is not None:
        for name, grad in grads._asdict().items():
            buffer = getattr(main_grads, name)
            if grad is None:
                continue
            if buffer is None or buffer.shape != grad.shape or buffer.dtype != torch.float32:
                raise ValueError(f"main_grads.{name}: expected a float32 tensor of shape {tuple(grad.shape)}")
            buffer.add_(grad)
    return Gradients(dx, d_topk_w, grads)


@dataclasses.dataclass
class ForwardContext:
    """What backward needs from a forward call. mok recomputes the expert activations inside
    backward, so the context is the inputs alone: nothing else is kept per token."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    weights: ExpertWeights


def recompute_forward_context(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                              weights: ExpertWeights) -> ForwardContext:
    """The context for backward after activation checkpointing dropped the forward's."""
    return ForwardContext(x, topk_idx, topk_w, weights)
