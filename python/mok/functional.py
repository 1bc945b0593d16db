"""The op-level API: config, workspace, schedule, forward, backward, recompute.

Shapes and dtypes (T tokens on this rank, H hidden, I expert intermediate, I_s shared
intermediate, E experts in all, E_l = E / R of them on this rank of R):
    x          (T, H)        bfloat16
    topk_idx   (T, k)        int32 or int64, global expert ids, distinct per row, -1 = unused slot
    topk_w     (T, k)        float32, any sign
    weights, either layout ([.., out, in], bfloat16):
      FusedExpertWeights (what mok computes on; no copy per call):
        w_gate_up (E_l, 2I, H): gate and up rows interleaved in blocks of 8 (rows 16b..16b+7 are
                  gate rows 8b..8b+7, rows 16b+8..16b+15 up rows 8b..8b+7; I % 8 == 0),
        w_down (E_l, H, I), w_shared_gate_up (2I_s, H) interleaved alike, w_shared_down (H, I_s)
      ExpertWeights (separate gate and up; fused into a new tensor on every call):
        w_gate, w_up (E_l, I, H), w_down (E_l, H, I), w_shared_* (I_s, H), (I_s, H), (H, I_s)
      Shared weights None: no shared expert. fuse_gate_up / split_gate_up convert.
    y, dx      (T, H)        bfloat16;  d_topk_w (T, k) float32;  weight gradients float32

What runs where:
    CPU tensors   forward and backward: mok's CPU backend (the reference, the GPU's rounding
                  points), one rank, in any MoKConfig.precision.
    CUDA tensors  forward: mok's GPU layer (LayerForward) on the current CUDA stream, no host
                  synchronisation, EP over the workspace's process group, bitwise EP-invariant.
                  backward: mok's GPU backward (LayerBackward) on the current stream, no host
                  synchronisation, EP over the same group. Both in every MoKConfig.precision.

Precision (MoKConfig.precision, from the workspace's config or forward's and backward's `config`):
    "bf16"   bf16 operands, fp32 accumulation.
    "fp8"    E4M3 GEMM operands, DeepSeek-V3 blocks (activations 1 x 128, weights 128 x 128);
             H, I and I_s multiples of 128. CPU and CUDA tensors, forward and backward (training).
             On CUDA its weights are quantized into a cache per workspace, which the forward and
             the backward both read, made anew whenever a call brings other weights or a weight
             changed in place (an optimizer step): a backward always differentiates the layer at
             the weights passed to it, in an autograd step the forward's. On CPU tensors its
             autograd context is the inputs alone (recompute mode, whatever `context` says).
    "mxfp8"  E4M3 with E8M0 scales per 1 x 32 (OCP MX); H, I and I_s multiples of 32. CPU and CUDA
             tensors, forward and backward, as fp8 (on CUDA a numerics mode on the bf16 GPU layer:
             each operand quantized to mxfp8 and dequantized into bf16; its weights round-tripped
             into a cache per workspace that follows the weights as fp8's does).
    The quantization points are listed in docs/quantize.md; inputs, outputs and gradients keep the
    dtypes above.

The autograd context, two modes with the same bits (forward's `context`):
    "save"       (default) the forward also keeps the routed and shared gate/up pre-activations
                 (bf16, 2I values per routed row: T * k * 2I * 2 bytes at EP = 1), and the
                 backward reads them instead of computing them again.
    "recompute"  only the inputs are kept; the backward dispatches x again and recomputes them
                 (less memory, one gate/up GEMM more: for activation checkpointing).
    In fp8 and mxfp8 on CUDA tensors the same (fp8: the sums of the FP8 gate/up GEMM rounded to
    bf16); the FP8 modes on CPU tensors keep the inputs alone in either mode (their backward
    recomputes).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Union

import torch

from . import _ops
from ._reference import fuse_gate_up, split_gate_up

PRECISIONS = ("bf16", "fp8", "mxfp8")
CONTEXTS = ("save", "recompute")

__all__ = [
    "ExpertWeights", "FusedExpertWeights", "MoKConfig", "LayerShape", "Workspace", "create_workspace",
    "get_workspace", "release_workspaces", "check_errors", "reset_after_error", "build_schedule", "forward",
    "backward", "Gradients", "ForwardContext", "recompute_forward_context", "fuse_gate_up", "split_gate_up",
]


class ExpertWeights(NamedTuple):
    """Separate gate and up weights. mok fuses them into a new tensor on every call: keep
    FusedExpertWeights (e.g. mok.nn.MoE's parameters) to avoid that copy."""

    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor
    w_shared_gate: Optional[torch.Tensor] = None
    w_shared_up: Optional[torch.Tensor] = None
    w_shared_down: Optional[torch.Tensor] = None

    def fused(self) -> "FusedExpertWeights":
        """The fused layout (new tensors; differentiable)."""
        shared = (self.w_shared_gate, self.w_shared_up, self.w_shared_down)
        if any(t is None for t in shared) and any(t is not None for t in shared):
            raise ValueError("w_shared_gate, w_shared_up, w_shared_down: give all three or none")
        has_shared = self.w_shared_gate is not None
        return FusedExpertWeights(
            fuse_gate_up(self.w_gate, self.w_up), self.w_down,
            fuse_gate_up(self.w_shared_gate, self.w_shared_up) if has_shared else None,
            self.w_shared_down)


class FusedExpertWeights(NamedTuple):
    """The layout mok computes on (module docstring): passed to the op as they are."""

    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    w_shared_gate_up: Optional[torch.Tensor] = None
    w_shared_down: Optional[torch.Tensor] = None

    def unfused(self) -> ExpertWeights:
        """Separate gate and up (new tensors)."""
        gate, up = split_gate_up(self.w_gate_up)
        shared = (*split_gate_up(self.w_shared_gate_up), self.w_shared_down) \
            if self.w_shared_gate_up is not None else (None, None, None)
        return ExpertWeights(gate, up, self.w_down, *shared)


AnyExpertWeights = Union[ExpertWeights, FusedExpertWeights]


def _fused(weights: AnyExpertWeights) -> FusedExpertWeights:
    if isinstance(weights, FusedExpertWeights):
        return weights
    if isinstance(weights, ExpertWeights):
        return weights.fused()
    raise TypeError("weights: expected mok.functional.FusedExpertWeights or ExpertWeights, "
                    f"got {type(weights).__name__}")


@dataclasses.dataclass(frozen=True)
class MoKConfig:
    """Scheduling knobs of the GPU layer. None picks the heuristic's value. Results are bitwise
    the same for every setting (the determinism contract); only speed changes.

    num_comm_sms: CTAs of the fused kernel that dispatch before they compute.
    minibatch_tokens: the fused kernel's minibatch, as tokens' worth of routed rows
        (minibatch_tokens * top_k rows of this rank's experts).
    ring_rows: rows of the ring that holds the rows this rank receives (and their hidden rows),
        at least 256. None sizes it for every row a call can route here (one round); fewer bound
        the memory, and any routing still runs, in further rounds through the ring (no token is
        dropped). The CPU backend has no ring and ignores it.
    precision: "bf16", "fp8" or "mxfp8" (the module docstring); all three on CPU and CUDA tensors,
        forward and backward.
    low_memory_backward: the bf16 GPU backward runs the routed experts in chunks of whole experts
        (1.5 max_tokens_per_rank rows each), so that its buffers hold one chunk's rows instead of
        every routed row's; the same bits, for more kernel launches (on one H100: a third less
        backward memory, 0.76 instead of 1.14 GB at qwen3-30b-a3b with 16384 tokens, for a
        backward 3-11 % slower). bf16 at EP 1 (no group) alone: with precision "fp8" or "mxfp8"
        it is a ValueError, as `mok run --low-memory-backward` refuses them; the CPU backend,
        which keeps no GPU buffers, ignores it."""

    num_comm_sms: Optional[int] = None
    minibatch_tokens: Optional[int] = None
    ring_rows: Optional[int] = None
    precision: str = "bf16"
    low_memory_backward: bool = False

    def __post_init__(self):
        for name in ("num_comm_sms", "minibatch_tokens", "ring_rows"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"MoKConfig.{name}: must be a positive int or None, got {value!r}")
        min_ring_rows = torch.ops.mok.min_ring_rows()  # two of the GPU layer's row blocks
        if self.ring_rows is not None and self.ring_rows < min_ring_rows:
            raise ValueError(f"MoKConfig.ring_rows: the ring needs at least {min_ring_rows} rows (two row "
                             f"blocks), got {self.ring_rows}")
        if not isinstance(self.low_memory_backward, bool):
            raise ValueError(f"MoKConfig.low_memory_backward: must be a bool, got {self.low_memory_backward!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"MoKConfig.precision: unknown precision {self.precision!r} (one of {PRECISIONS})")
        if self.low_memory_backward and self.precision != "bf16":
            raise ValueError(f"MoKConfig.low_memory_backward: the low-memory backward is bf16's; precision "
                             f"{self.precision!r} has none (its buffers are the FP8 backward's)")


@dataclasses.dataclass(frozen=True)
class LayerShape:
    hidden: int
    intermediate: int
    num_experts: int  # global
    top_k: int
    shared_intermediate: int = 0


@dataclasses.dataclass(eq=False)
class Workspace:
    """What one layer call needs besides its tensors, sized from shapes only: on CUDA, the GPU
    layer's buffers and NCCL window for `max_tokens_per_rank` tokens (the same on every rank) and
    the communicator over `group`; on CPU, the shapes alone. A call with more tokens raises
    ValueError: growing would need every rank to agree (a collective with a host sync), so size it
    for the largest batch. Calls that pass no workspace use, at EP = 1 on CUDA, an automatic
    one per (device, shape) that grows instead (synchronising the device once per growth)."""

    shape: LayerShape
    max_tokens_per_rank: int
    device: torch.device
    config: MoKConfig
    ep_size: int = 1
    ep_rank: int = 0
    group: object = None
    handle: int = 0  # the extension's workspace (0: none, CPU)

    def check(self, x: torch.Tensor, topk_idx: torch.Tensor, weights: AnyExpertWeights) -> None:
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
        first = weights[0]
        if first.shape[0] != local:
            raise ValueError(f"{weights._fields[0]}: {first.shape[0]} experts, this rank holds {local}")

    def close(self) -> None:
        """Frees the GPU workspace now (collective: every rank of the group at once). Otherwise it
        lives until the process ends."""
        if self.handle:
            torch.ops.mok.destroy_workspace(self.handle)
            _ops.WORKSPACE_GROUPS.pop(self.handle, None)
            _ops.WORKSPACE_SIZES.pop(self.handle, None)
            self.handle = 0
        for key in [key for key, value in _WORKSPACES.items() if value is self]:
            del _WORKSPACES[key]


_WORKSPACES: dict = {}


def _ep_placement(group) -> tuple[int, int]:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _cuda_device(device) -> torch.device:
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)


def _unique_id(group, ep_rank: int, device: torch.device) -> torch.Tensor:
    """Rank 0's ncclGetUniqueId bytes, broadcast over the group (a collective)."""
    import torch.distributed as dist

    payload = [bytes(torch.ops.mok.nccl_unique_id().tolist()) if ep_rank == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group, device=device)
    return torch.frombuffer(bytearray(payload[0]), dtype=torch.uint8)


def create_workspace(shape: LayerShape, max_tokens_per_rank: int, device, group=None,
                     config: Optional[MoKConfig] = None) -> Workspace:
    """A new workspace. `group`: the expert-parallel torch.distributed process group (None: this
    process alone); rank r of R holds experts r*E/R .. (r+1)*E/R - 1. On CUDA with R > 1 this is a
    collective (every rank calls it with the same shape and capacity): rank 0 makes an NCCL unique
    id, the group broadcasts it, and every rank makes its NCCL communicator and window from it."""
    device = torch.device(device)
    config = config or MoKConfig()
    if max_tokens_per_rank <= 0:
        raise ValueError(f"max_tokens_per_rank: must be positive, got {max_tokens_per_rank}")
    if shape.top_k > shape.num_experts:
        raise ValueError(f"top_k: k = {shape.top_k} exceeds the number of experts E = {shape.num_experts}")
    ep_size, ep_rank = _ep_placement(group)
    if shape.num_experts % ep_size:
        raise ValueError(f"group: E = {shape.num_experts} experts do not divide over {ep_size} ranks")
    if device.type == "cpu":
        if ep_size > 1:
            raise NotImplementedError("mok: expert parallelism over a process group runs on CUDA tensors; "
                                      "CPU tensors run the CPU backend as one rank")
        return Workspace(shape, max_tokens_per_rank, device, config)
    if device.type != "cuda":
        raise ValueError(f"device: mok runs on cpu or cuda, got {device}")
    if config.low_memory_backward and ep_size > 1:
        raise NotImplementedError("MoKConfig.low_memory_backward: the chunked backward runs at EP 1 "
                                  f"(no group) for now; this group has {ep_size} ranks")
    device = _cuda_device(device)
    unique_id = _unique_id(group, ep_rank, device) if ep_size > 1 else torch.empty(0, dtype=torch.uint8)
    handle = torch.ops.mok.create_workspace(
        unique_id, ep_rank, ep_size, device.index, shape.hidden, shape.intermediate,
        shape.shared_intermediate, shape.num_experts, shape.top_k, max_tokens_per_rank,
        config.num_comm_sms or 0, (config.minibatch_tokens or 0) * shape.top_k, config.ring_rows or 0,
        config.low_memory_backward)
    _ops.WORKSPACE_GROUPS[handle] = group if ep_size > 1 else None
    _ops.WORKSPACE_SIZES[handle] = (ep_size, max_tokens_per_rank)
    return Workspace(shape, max_tokens_per_rank, device, config, ep_size, ep_rank, group, handle)


def get_workspace(shape: LayerShape, max_tokens_per_rank: int, device, group=None,
                  config: Optional[MoKConfig] = None) -> Workspace:
    """The cached workspace for (group, device, shape, capacity, config), created on first use
    (collectively, see create_workspace)."""
    device = torch.device(device)
    if device.type == "cuda":
        device = _cuda_device(device)
    key = (id(group), str(device), shape, max_tokens_per_rank, config or MoKConfig())
    if key not in _WORKSPACES:
        _WORKSPACES[key] = create_workspace(shape, max_tokens_per_rank, device, group, config)
    return _WORKSPACES[key]


def release_workspaces() -> None:
    """Closes every cached workspace (collective), e.g. before destroying the process group."""
    for workspace in list(_WORKSPACES.values()):
        workspace.close()


def check_errors(workspace: Optional[Workspace] = None, device=None) -> None:
    """Synchronises the current CUDA stream and raises RuntimeError with the core's message
    (rank, phase, cause: "topk_idx: expert id 99 out of range ...") if a forward recorded a device
    fault. Without a workspace: this device's automatic workspaces. Forward itself never
    synchronises, so faults surface here (or in the next check)."""
    handle = workspace.handle if workspace is not None else 0
    index = workspace.device.index if workspace is not None else _cuda_device(device or "cuda").index
    torch.ops.mok.check(handle, index)


def reset_after_error(workspace: Optional[Workspace] = None, device=None) -> None:
    """Makes a workspace usable again after a device fault. For EP > 1 a collective: every rank,
    once every rank's stream is idle, then a barrier before the next forward."""
    handle = workspace.handle if workspace is not None else 0
    index = workspace.device.index if workspace is not None else _cuda_device(device or "cuda").index
    torch.ops.mok.reset_after_error(handle, index)


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


def _precision(workspace: Optional[Workspace], config: Optional[MoKConfig]) -> str:
    """The call's precision: the workspace's config, else `config`, else bf16."""
    if workspace is not None and config is not None and config != workspace.config:
        raise ValueError("config: differs from workspace.config (a call with a workspace computes with "
                         "the workspace's config; pass one of the two)")
    config = workspace.config if workspace is not None else config or MoKConfig()
    return config.precision


def forward(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor, weights: AnyExpertWeights,
            workspace: Optional[Workspace] = None, context: str = "save",
            config: Optional[MoKConfig] = None) -> torch.Tensor:
    """y = S(x) + sum_j topk_w[:, j] * F_{topk_idx[:, j]}(x), (T, H) bf16. Differentiable: autograd
    runs mok::backward (CPU: mok's CPU backend; CUDA: mok's GPU backward).

    CUDA tensors run mok's GPU layer on the current stream without host synchronisation. EP > 1
    needs `workspace` (get_workspace with the group); without one a CUDA call is EP = 1 on an
    automatic workspace. Device faults (an expert id out of range) surface at check_errors().
    context: what autograd keeps for the backward, "save" or "recompute" (module docstring); a
    call that autograd does not record keeps nothing; the FP8 modes on CPU tensors keep the inputs
    alone either way (recompute). config: the MoKConfig of a call without a workspace (its
    precision; a workspace brings its own). Every precision runs on CUDA tensors, forward and
    backward."""
    if context not in CONTEXTS:
        raise ValueError(f"context: one of {CONTEXTS}, got {context!r}")
    fused = _fused(weights)
    records = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, topk_w, *fused))
    precision = _precision(workspace, config)
    if workspace is not None:
        workspace.check(x, topk_idx, fused)
    handle = workspace.handle if workspace is not None else 0
    # Save mode keeps the gate/up pre-activations for the GPU backward in every precision and for
    # the CPU backend's in bf16; the CPU backend's FP8 modes have no such context (their backward
    # recomputes): forward, recorded, keeps the inputs.
    if context == "save" and records and (precision == "bf16" or x.is_cuda):
        return torch.ops.mok.forward_save(x, topk_idx, topk_w, *fused, handle, precision)[0]
    return torch.ops.mok.forward(x, topk_idx, topk_w, *fused, handle, precision)


@dataclasses.dataclass
class Gradients:
    dx: torch.Tensor        # (T, H) bf16
    d_topk_w: torch.Tensor  # (T, k) fp32
    weights: AnyExpertWeights  # fp32, the layout and shapes of the weights (shared None when none)


def backward(dy: torch.Tensor, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
             weights: AnyExpertWeights, main_grads: Optional[AnyExpertWeights] = None,
             workspace: Optional[Workspace] = None, config: Optional[MoKConfig] = None) -> Gradients:
    """Gradients of the layer for upstream gradient dy, all weight gradients in fp32 and in the
    layout of `weights`. With `main_grads` (fp32 buffers of that layout), each gradient is also
    added to its buffer in place. Recomputes the forward internally: nothing is saved between the
    calls. CUDA tensors: mok's GPU backward on the current stream (module docstring; the FP8 modes
    quantize `weights` into the workspace's weight cache unless they are those of its last call,
    unchanged).
    config: as forward's."""
    precision = _precision(workspace, config)
    fused = _fused(weights)
    if workspace is not None:
        workspace.check(x, topk_idx, fused)
    dx, d_topk_w, *grads = torch.ops.mok.backward(dy, x, topk_idx, topk_w, *fused,
                                                  workspace.handle if workspace is not None else 0,
                                                  False, None, None, precision)
    has_shared = fused.w_shared_gate_up is not None
    grads = FusedExpertWeights(*grads[:2], *(grads[2:] if has_shared else (None, None)))
    if isinstance(weights, ExpertWeights):
        grads = grads.unfused()
    if main_grads is not None:
        for name, grad in grads._asdict().items():
            buffer = getattr(main_grads, name, None)
            if grad is None:
                continue
            if buffer is None or buffer.shape != grad.shape or buffer.dtype != torch.float32:
                raise ValueError(f"main_grads.{name}: expected a float32 tensor of shape {tuple(grad.shape)}")
            buffer.add_(grad)
    return Gradients(dx, d_topk_w, grads)


@dataclasses.dataclass
class ForwardContext:
    """What mok.functional.backward needs from a forward call: the inputs alone (it recomputes the
    expert activations, as recompute mode does; autograd's save mode keeps the gate/up
    pre-activations itself, see forward's `context`)."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_w: torch.Tensor
    weights: AnyExpertWeights


def recompute_forward_context(x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                              weights: AnyExpertWeights) -> ForwardContext:
    """The context for backward after activation checkpointing dropped the forward's."""
    return ForwardContext(x, topk_idx, topk_w, weights)
