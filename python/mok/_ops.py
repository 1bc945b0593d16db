"""Loads the compiled torch ops (mok::forward, mok::forward_save, mok::backward and the workspace
ops) and registers what is written in Python: the fake (meta) implementations, for torch.compile,
and the autograd formulas of mok::forward (recompute mode: the backward computes the gate/up
activations again) and mok::forward_save (save mode: the forward keeps them). The ops run mok's
own kernels: the CPU backend on CPU tensors, the GPU layer forward and backward on CUDA tensors
(`mok._reference` is kept as a test oracle only)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def _load_library() -> Path:
    here = Path(__file__).resolve().parent
    candidates = []
    if os.environ.get("MOK_TORCH_LIBRARY"):
        candidates.append(Path(os.environ["MOK_TORCH_LIBRARY"]))
    candidates += sorted(here.glob("_mok_torch*.so"))
    for path in candidates:
        if path.is_file():
            torch.ops.load_library(str(path))
            return path
    raise ImportError(
        "mok: the compiled extension _mok_torch.so is neither next to the package "
        f"({here}) nor named by MOK_TORCH_LIBRARY; install with `pip install --no-build-isolation .`"
    )


LIBRARY_PATH = _load_library()
HAVE_GPU_LAYER: bool = bool(torch.ops.mok.have_gpu_layer())

# The process group of each workspace handle (handle 0, the automatic EP = 1 workspace: none), for
# the tests' reference backward (mok._reference). Written by mok.functional.create_workspace.
WORKSPACE_GROUPS: dict = {}
# (ep_size, max_tokens_per_rank) of each workspace handle, for the fake of mok::forward_save.
# Written by mok.functional.create_workspace.
WORKSPACE_SIZES: dict = {}


def saved_context_rows(handle: int, num_tokens, top_k: int):
    """Rows of forward_save's gate/up context: T * k at EP = 1, R * T_max * k at EP > 1 (the rows
    are indexed by their source rank, token and slot)."""
    ep_size, tokens_max = WORKSPACE_SIZES.get(handle, (1, None))
    return num_tokens * top_k if ep_size == 1 else ep_size * tokens_max * top_k


def _f32_like(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if tensor is None:
        return torch.empty((0,), dtype=torch.float32, device=device)
    return torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)


@torch.library.register_fake("mok::forward")
def _forward_fake(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down, workspace=0,
                  precision="bf16"):
    torch._check(x.dim() == 2, lambda: f"x: expected (T, H), got {x.dim()} dimensions")
    torch._check(topk_idx.shape == topk_w.shape, lambda: "topk_idx and topk_w: shapes differ")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("mok::forward_save")
def _forward_save_fake(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down,
                       workspace=0, precision="bf16"):
    y = _forward_fake(x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down, workspace,
                      precision)
    if x.device.type != "cuda":  # no context: the CPU backend (the GPU keeps one in every precision)
        return y, x.new_empty((0,)), x.new_empty((0,))
    rows = saved_context_rows(workspace, x.shape[0], topk_idx.shape[1])
    gate_up = x.new_empty((rows, w_gate_up.shape[1]))
    shared = (x.new_empty((x.shape[0], w_shared_gate_up.shape[0])) if w_shared_gate_up is not None
              else x.new_empty((0,)))
    return y, gate_up, shared


@torch.library.register_fake("mok::backward")
def _backward_fake(dy, x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down,
                   workspace=0, bf16_grads=False, saved_gate_up=None, saved_shared_gate_up=None,
                   precision="bf16"):
    def grad(weight):
        fp32 = _f32_like(weight, x.device)
        return fp32.to(torch.bfloat16) if bf16_grads else fp32

    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        _f32_like(topk_w, x.device),
        grad(w_gate_up),
        grad(w_down),
        grad(w_shared_gate_up),
        grad(w_shared_down),
    )


def _setup_context(ctx, inputs, output):
    # save mode (forward_save): output = (y, saved gate/up, saved shared gate/up), kept beside the
    # inputs; recompute mode (forward): the inputs alone.
    saved = tuple(output[1:]) if isinstance(output, (tuple, list)) else ()
    ctx.save_for_backward(*inputs[:7], *saved)
    ctx.workspace = inputs[7] if len(inputs) > 7 else 0
    ctx.precision = inputs[8] if len(inputs) > 8 else "bf16"
    ctx.num_inputs = len(inputs)
    ctx.has_shared = inputs[5] is not None


def _backward(ctx, grad_y, *grad_saved):
    x, topk_idx, topk_w, w_gate_up, w_down, w_shared_gate_up, w_shared_down, *saved = ctx.saved_tensors
    # bf16 parameters get bf16 gradients straight from the weight-gradient GEMMs' epilogues (the
    # fp32 sums rounded once), as autograd expects; mok.functional.backward keeps fp32.
    bf16_grads = w_gate_up.dtype == torch.bfloat16
    saved_gate_up, saved_shared_gate_up = saved if saved else (None, None)
    dx, d_topk_w, grad_gate_up, grad_down, grad_sgu, grad_sd = torch.ops.mok.backward(
        grad_y.contiguous(), x, topk_idx, topk_w, w_gate_up, w_down,
        w_shared_gate_up, w_shared_down, ctx.workspace, bf16_grads, saved_gate_up, saved_shared_gate_up,
        ctx.precision,
    )
    shared = ((grad_sgu.to(w_shared_gate_up.dtype), grad_sd.to(w_shared_down.dtype))
              if ctx.has_shared else (None, None))
    grads = (dx, None, d_topk_w.to(topk_w.dtype), grad_gate_up.to(w_gate_up.dtype),
             grad_down.to(w_down.dtype), *shared, None, None)
    return grads[:ctx.num_inputs]


torch.library.register_autograd("mok::forward", _backward, setup_context=_setup_context)
torch.library.register_autograd("mok::forward_save", _backward, setup_context=_setup_context)
