"""mok: a deterministic Mixture-of-Experts layer (shared + routed SwiGLU experts, top-k combine).

`mok.functional` is the op-level API, `mok.nn.MoE` a module that drops into a model.
CPU tensors run mok's CPU backend (the reference, with the GPU design's rounding points), forward
and backward. CUDA tensors (Hopper) run mok's GPU layer forward and backward, expert-parallel over
a torch.distributed group.
"""

from . import (
    _ops,  # noqa: F401  (loads the ops before anything uses them)
    functional,
    nn,
    ops,  # noqa: F401  (mok.ops: the FP8 quantizers)
)
from .functional import ExpertWeights, FusedExpertWeights, MoKConfig

__all__ = ["functional", "nn", "ExpertWeights", "FusedExpertWeights", "MoKConfig"]
__version__ = "0.1.0"
