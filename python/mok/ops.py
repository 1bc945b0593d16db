"""FP8 quantizers for mok's two FP8 precision modes, on CPU and CUDA tensors, with the same bytes
on both (docs/quantize.md has the full rules).

fp8 (the DeepSeek-V3 recipe): E4M3 data, one float32 scale per block, ``scale = amax / 448`` with
``amax`` floored at 2**-116; blocks of 1 x 128 along the last dimension (activations), 128 x 128
(weights), or 128 x 1 down the rows, returned as the transposed copy (the weight-gradient operand,
contiguous along the tokens).

mxfp8 (OCP MX): E4M3 data, one E8M0 scale (a power of two, rounded up from ``amax / 448`` so that
nothing saturates) per 1 x 32 block, on the tensor as given or on its transposed copy.

In both, a block's amax skips NaN and +-Inf, which quantize to E4M3 NaN with their sign (torch's
own ``.to(torch.float8_e4m3fn)`` turns +-Inf into +-448 instead); zeros keep their sign. Data come
back as ``torch.float8_e4m3fn``, fp8 scales as float32, mxfp8 scales as ``torch.float8_e8m0fnu``
(uint8 where torch lacks it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _ops  # noqa: F401  (loads the compiled ops)

__all__ = ["Quantized", "fp8_quantize", "mxfp8_quantize", "fp8_dequantize", "mxfp8_dequantize"]

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP8_MIN_AMAX = 2.0**-116


class Quantized(NamedTuple):
    data: torch.Tensor  # float8_e4m3fn
    scale: torch.Tensor  # float32 (fp8) or float8_e8m0fnu / uint8 (mxfp8)


def _blocks(block) -> tuple[int, int]:
    if isinstance(block, int):
        return 1, block
    rows, cols = block
    return int(rows), int(cols)


def fp8_quantize(x: torch.Tensor, block=(1, 128), transposed: bool = False) -> Quantized:
    """Quantizes ``x`` (bfloat16 or float32, CPU or CUDA) to E4M3 with float32 block scales.

    block: ``(1, 128)`` (or ``128``): one scale per 128 consecutive elements of the last dimension;
    data shaped like ``x``, scale ``x.shape[:-1] + (K // 128,)``. ``(128, 128)``: one scale per
    128 x 128 block of the last two dimensions (a partial last row block is allowed); scale
    ``(..., ceil(N / 128), K // 128)``.

    transposed (with ``(1, 128)``): quantizes ``x.mT``: for ``x`` of shape ``(..., M, N)`` the data
    is ``(..., N, M)`` with blocks of 128 consecutive rows of ``x`` (M a multiple of 128), scale
    ``(..., N, M // 128)``; bytewise the same as ``fp8_quantize(x.mT.contiguous())``.

    Every element: ``q = e4m3(x * (448 / a))``, ``scale = a / 448``, ``a = max(amax, 2**-116)``,
    each a correctly rounded float32 operation, E4M3 rounding to nearest even. Dequantize:
    ``q * scale``.
    """
    block_rows, block_cols = _blocks(block)
    data, scale = torch.ops.mok.fp8_quantize(x, block_rows, block_cols, transposed)
    return Quantized(data.view(torch.float8_e4m3fn), scale)


def mxfp8_quantize(x: torch.Tensor, transposed: bool = False) -> Quantized:
    """Quantizes ``x`` (bfloat16 or float32, CPU or CUDA) to MXFP8: E4M3 data with one E8M0 scale
    per 32 consecutive elements of the last dimension (of ``x.mT`` when ``transposed``: data
    ``(..., N, M)``, M a multiple of 32, the same bytes as ``mxfp8_quantize(x.mT.contiguous())``).

    The scale is ``2**s`` for the smallest integer s with ``amax <= 448 * 2**s`` (at least
    2**-127, the code of a zero block), so no element saturates; elements are ``e4m3(x * 2**-s)``.
    Scale shape ``x.shape[:-1] + (K // 32,)`` (transposed: ``(..., N, M // 32)``).
    """
    data, scale = torch.ops.mok.mxfp8_quantize(x, transposed)
    return Quantized(data.view(torch.float8_e4m3fn), scale.view(_E8M0) if _E8M0 else scale)


def _expand(scale: torch.Tensor, shape: torch.Size, block_rows: int, block_cols: int) -> torch.Tensor:
    expanded = scale.repeat_interleave(block_cols, dim=-1)
    if block_rows > 1:
        expanded = expanded.repeat_interleave(block_rows, dim=-2)[..., : shape[-2], :]
    return expanded


def _e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    code = scale.view(torch.uint8).to(torch.int32)
    value = (code << 23).view(torch.float32)
    value = torch.where(code == 0, torch.tensor(2.0**-127, device=code.device), value)
    return torch.where(code == 255, torch.tensor(float("nan"), device=code.device), value)


def fp8_dequantize(data: torch.Tensor, scale: torch.Tensor, block=(1, 128),
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * scale`` per block in float32 (one rounding), then ``dtype``: the inverse of
    :func:`fp8_quantize` in the data's own layout (a transposed copy dequantizes to ``x.mT``).
    ``block`` as given to :func:`fp8_quantize` (``(1, 128)`` also for a transposed copy)."""
    block_rows, block_cols = _blocks(block)
    decoded = data.view(torch.float8_e4m3fn).to(torch.float32)
    return (decoded * _expand(scale.to(torch.float32), data.shape, block_rows, block_cols)).to(dtype)


def mxfp8_dequantize(data: torch.Tensor, scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * 2**(code - 127)`` per 1 x 32 block (exact in float32 but where the product leaves
    its range), then ``dtype``: the inverse of :func:`mxfp8_quantize` in the data's own layout."""
    decoded = data.view(torch.float8_e4m3fn).to(torch.float32)
    return (decoded * _expand(_e8m0_to_float(scale), data.shape, 1, 32)).to(dtype)


def _quantized_shapes(x, block_rows, block_cols, transposed):
    data = list(x.shape)
    if transposed:
        data[-1], data[-2] = data[-2], data[-1]
    scale = list(data)
    scale[-1] = data[-1] // block_cols
    if block_rows > 1:
        scale[-2] = -(-data[-2] // block_rows)
    return data, scale


@torch.library.register_fake("mok::fp8_quantize")
def _fp8_quantize_fake(x, block_rows=1, block_cols=128, transposed=False):
    data, scale = _quantized_shapes(x, block_rows, block_cols, transposed)
    return (x.new_empty(data, dtype=torch.uint8), x.new_empty(scale, dtype=torch.float32))


@torch.library.register_fake("mok::mxfp8_quantize")
def _mxfp8_quantize_fake(x, transposed=False):
    data, scale = _quantized_shapes(x, 1, 32, transposed)
    return (x.new_empty(data, dtype=torch.uint8), x.new_empty(scale, dtype=torch.uint8))
