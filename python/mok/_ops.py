"""Loads the compiled torch ops (mok::forward, mok::backward) and registers their fake (meta)
implementations, for torch.compile, and their autograd formula."""

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


def _f32_like(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if tensor is None:
        return torch.empty((0,), dtype=torch.float32, device=device)
    return torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device)


@torch.library.register_fake("mok::forward")
def _forward_fake(x, topk_idx, topk_w, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down):
    torch._check(x.dim() == 2, lambda: f"x: expected (T, H), got {x.dim()} dimensions")
    torch._check(topk_idx.shape == topk_w.shape, lambda: "topk_idx and topk_w: shapes differ")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("mok::backward")
def _backward_fake(dy, x, topk_idx, topk_w, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down):
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        _f32_like(topk_w, x.device),
        _f32_like(w_gate, x.device),
        _f32_like(w_up, x.device),
        _f32_like(w_down, x.device),
        _f32_like(w_shared_gate, x.device),
        _f32_like(w_shared_up, x.device),
        _f32_like(w_shared_down, x.device),
    )


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.has_shared = inputs[6] is not None


def _backward(ctx, grad_y):
    x, topk_idx, topk_w, w_gate, w_up, w_down, w_shared_gate, w_shared_up, w_shared_down = ctx.saved_tensors
    dx, d_topk_w, grad_gate, grad_up, grad_down, grad_sg, grad_su, grad_sd = torch.ops.mok.backward(
        grad_y.contiguous(), x, topk_idx, topk_w, w_gate, w_up, w_down,
        w_shared_gate, w_shared_up, w_shared_down,
    )
    # Autograd wants each gradient in its input's dtype; mok.functional.backward keeps fp32.
    shared = (
        (grad_sg.to(w_shared_gate.dtype), grad_su.to(w_shared_up.dtype), grad_sd.to(w_shared_down.dtype))
        if ctx.has_shared
        else (None, None, None)
    )
    return (dx, None, d_topk_w.to(topk_w.dtype), grad_gate.to(w_gate.dtype),
            grad_up.to(w_up.dtype), grad_down.to(w_down.dtype), *shared)


torch.library.register_autograd("mok::forward", _backward, setup_context=_setup_context)
