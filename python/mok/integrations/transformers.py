"""mok as a Hugging Face transformers "experts implementation" (transformers 5.x).

transformers 5 sends every MoE layer's expert computation through one dispatch point: an experts
module made by `@use_experts_implementation` (`Qwen3MoeExperts`, `MixtralExperts`,
`DeepseekV3Experts`, ...) calls the function that `config._experts_implementation` names in
`transformers.integrations.moe.ExpertsInterface`, with `hidden_states` (T, H), `top_k_index`
(T, k) and `top_k_weights` (T, k). Importing this module registers mok there as "mok":

    import mok.integrations.transformers
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16, experts_implementation="mok")
    # or on a model in hand, converting and checking every experts module at once:
    mok.integrations.transformers.attach(model)

Routing, shared experts, attention and everything else stay the model's own code; mok computes
the routed experts, forward and backward (CPU tensors: mok's CPU backend; CUDA: mok's GPU layer).

Supported experts modules: SwiGLU experts, `silu(gate) * up`, with the interface's default
layout and gating: `gate_up_proj` (E, 2I, H) with the gate rows then the up rows, `down_proj`
(E, H, I), no bias, not transposed, the interface's default `_apply_gate`, I and H multiples of 8
(`unsupported_reasons` lists what else it finds; a call on such a module raises
`UnsupportedExperts` naming it).

Weight layout. mok's GEMM reads gate and up interleaved in blocks of 8 rows (`mok.functional`).
Rather than re-laying the weights out on every call, the first call on an experts module (or
`attach`) permutes the rows of `gate_up_proj` once, in place, into mok's layout: the same
Parameter object, so optimizers and references keep pointing at it, and its `.grad` (also
permuted, if present) then lands in that layout too, as autograd expects of a parameter. The
module's state-dict hooks keep checkpoints in the Hugging Face layout: `state_dict()` (and so
`save_pretrained`) returns `gate_up_proj` in the HF layout (a new tensor), `load_state_dict`
takes the HF layout. A forward pre-hook puts the rows back when the model switches to another
experts implementation, so "eager" or "grouped_mm" never read mok's layout. Read the weight or
its gradient in the HF layout with `gate_up_proj_hf(module)`. bf16 weights are passed to mok as
they are; other dtypes are cast to bf16 on every call (mok computes in bf16), as autocast would.

Under transformers' own expert parallelism (`DistributedConfig(ep_size=...)`) each rank's module
holds its shard of the experts: mok converts each rank's own experts, and skips the routes that
transformers marks as another rank's (id E_local, weight 0), as transformers' experts do. Under
FSDP (or DeepSpeed ZeRO-3) the forward sees a gathered copy of the weights, where a conversion
would be lost: call `attach(model)` after sharding, which converts the stored shards; the first
call otherwise raises UnsupportedExperts saying so.

What autograd keeps (`set_context`, as `mok.functional.forward`'s `context`): "save" (the default)
keeps the routed gate/up pre-activations beside the inputs, 2I bf16 values a routed row (e.g. 0.4 GB
a layer at Qwen3-30B-A3B's shape and 16,384 tokens), so that the backward skips their recompute;
"recompute" keeps the inputs alone and the backward computes them again (about 1.1 ms more a layer
there on an H100). Both give the same bits.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

import torch
from torch import nn

from .. import _ops  # noqa: F401  (loads the ops)
from .. import functional as _functional
from .._reference import GATE_UP_BLOCK, fuse_gate_up, split_gate_up

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover - a torch built without distributed
    _DTensor = None
try:  # the sharding wrappers whose forward gathers a layer's weights (FSDP2, FSDP1)
    from torch.distributed.fsdp import FSDPModule as _FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as _FullyShardedDataParallel
    _SHARDING_WRAPPERS = (_FSDPModule, _FullyShardedDataParallel)
except ImportError:  # pragma: no cover - a torch built without distributed
    _SHARDING_WRAPPERS = ()

try:
    import transformers
    from transformers.activations import SiLUActivation
    from transformers.integrations import moe as _hf_moe
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("mok.integrations.transformers needs Hugging Face transformers 5.x "
                      "(pip install 'transformers>=5,<6')") from error

if not hasattr(_hf_moe, "ExpertsInterface") or int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"mok.integrations.transformers needs transformers 5.x (its experts interface); "
                      f"transformers {transformers.__version__} is installed")

NAME = "mok"
CONTEXTS = _functional.CONTEXTS  # ("save", "recompute")
_context = "save"

__all__ = ["NAME", "CONTEXTS", "UnsupportedExperts", "register", "experts_forward", "attach", "detach",
           "is_experts_module", "unsupported_reasons", "gate_up_proj_hf", "gate_up_to_mok", "gate_up_to_hf",
           "set_context", "get_context"]


class UnsupportedExperts(NotImplementedError):
    """An experts module (or a model) that mok cannot compute; the message names what."""


# ---- the gate/up layouts ------------------------------------------------------------------------

def gate_up_to_mok(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I, H) gate rows then up rows (Hugging Face) -> mok's interleaved layout (new tensor)."""
    gate, up = gate_up.chunk(2, dim=-2)
    return fuse_gate_up(gate, up)


def gate_up_to_hf(gate_up: torch.Tensor) -> torch.Tensor:
    """(..., 2I, H) in mok's interleaved layout -> gate rows then up rows (new tensor)."""
    return torch.cat(split_gate_up(gate_up), dim=-2)


@torch.no_grad()
def _permute_rows_(tensor: torch.Tensor, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Converts (E, 2I, H) in place, one expert at a time: the copy in flight is one expert's.
    Under transformers' expert parallelism the experts' forward sees its parameters' local shards
    as views made by an autograd function (DTensor.to_local); those are rewritten through `.data`,
    which leaves the view's autograd version alone (the shard's storage is what changes)."""
    if _is_dtensor(tensor):
        tensor = _local_experts(tensor)
    elif not tensor.is_leaf:
        tensor = tensor.data
    for expert in range(tensor.shape[0]):
        tensor[expert].copy_(convert(tensor[expert]))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return _DTensor is not None and isinstance(tensor, _DTensor)


def _local_experts(tensor: torch.Tensor) -> torch.Tensor:
    """A distributed (E, 2I, H) tensor's local shard, which holds whole experts when its
    placements split dim 0 alone (expert parallelism, FSDP): each rank converts its own."""
    split = [placement.dim for placement in tensor.placements if placement.is_shard()]
    if any(dim != 0 for dim in split):
        raise UnsupportedExperts(f"gate_up_proj is sharded along dims {split}; mok converts whole experts "
                                 "(a placement that splits dim 0 only)")
    return tensor.to_local().data


def _grad_of(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """A parameter's gradient; none for the local views expert parallelism hands the forward."""
    return tensor.grad if tensor.is_leaf else None


# ---- which experts modules mok computes ---------------------------------------------------------

def is_experts_module(module: nn.Module) -> bool:
    """Whether `module` dispatches through transformers' experts interface (made by
    `@use_experts_implementation`, which sets these attributes)."""
    return all(hasattr(module, name) for name in ("has_gate", "has_bias", "is_transposed", "is_concatenated"))


def _is_silu(act_fn) -> bool:
    return isinstance(act_fn, (SiLUActivation, nn.SiLU)) or act_fn is nn.functional.silu


def unsupported_reasons(module: nn.Module) -> list[str]:
    """What keeps mok from computing this experts module; empty when mok computes it exactly."""
    if not is_experts_module(module):
        return [f"{type(module).__name__} is not an experts module of transformers' experts interface "
                "(@use_experts_implementation)"]
    reasons = []
    if not module.has_gate:
        reasons.append("experts without a gate projection (has_gate=False: up_proj and an activation)")
    if module.has_bias:
        reasons.append("bias terms (has_bias=True: gate_up_proj_bias, down_proj_bias)")
    if module.is_transposed:
        reasons.append("transposed expert weights (is_transposed=True: gate_up_proj (E, H, 2I))")
    if not module.is_concatenated:
        reasons.append("gate and up interleaved row by row (is_concatenated=False)")
    if getattr(type(module), "_apply_gate", _hf_moe._default_apply_gate) is not _hf_moe._default_apply_gate:
        reasons.append(f"a gating function of its own ({type(module).__name__}._apply_gate, e.g. a clamped "
                       "SwiGLU); mok computes silu(gate) * up")
    elif module.has_gate and not _is_silu(getattr(module, "act_fn", None)):
        act_fn = getattr(module, "act_fn", None)
        hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
        reasons.append(f"the activation {getattr(act_fn, '__name__', type(act_fn).__name__)} "
                       f"(hidden_act={hidden_act!r}); mok computes SwiGLU experts, silu(gate) * up")
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
        reasons.append("no gate_up_proj and down_proj weight tensors")
    elif not reasons:
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2:
            reasons.append(f"weights of shapes gate_up_proj {tuple(gate_up.shape)}, down_proj {tuple(down.shape)}; "
                           "expected (E, 2I, H) and (E, H, I)")
        else:
            experts, rows, hidden = gate_up.shape
            intermediate = rows // 2
            if tuple(down.shape) != (experts, hidden, intermediate):
                reasons.append(f"down_proj of shape {tuple(down.shape)}, expected (E, H, I) = "
                               f"{(experts, hidden, intermediate)} from gate_up_proj {tuple(gate_up.shape)}")
            if intermediate % GATE_UP_BLOCK or hidden % GATE_UP_BLOCK:
                reasons.append(f"I = {intermediate}, H = {hidden}: mok needs multiples of {GATE_UP_BLOCK}")
            if not (gate_up.is_floating_point() and down.is_floating_point()):
                reasons.append(f"weights of dtype {gate_up.dtype} and {down.dtype} (quantized?); mok takes "
                               "floating-point weights and computes in bf16")
    return reasons


def _check_supported(module: nn.Module, name: Optional[str] = None) -> None:
    reasons = unsupported_reasons(module)
    if reasons:
        where = f"{name} ({type(module).__name__})" if name else type(module).__name__
        raise UnsupportedExperts(f"experts_implementation='mok' cannot run {where}: mok computes SwiGLU experts "
                                 f"without bias in the interface's default layout, and this module has "
                                 f"{'; '.join(reasons)}. Use another experts_implementation (e.g. 'grouped_mm') "
                                 "for this model.")


# ---- attaching: the one-time permutation and the hooks that keep the HF layout outside ------------

def _in_mok_layout(module: nn.Module) -> bool:
    return getattr(module, "_mok_layout", False)


def _state_dict_in_hf_layout(module, state_dict, prefix, local_metadata) -> None:
    key = prefix + "gate_up_proj"
    if _in_mok_layout(module) and key in state_dict:
        state_dict[key] = gate_up_to_hf(state_dict[key].detach())


def _load_state_dict_from_hf_layout(module, state_dict, prefix, local_metadata, strict, missing_keys,
                                    unexpected_keys, error_msgs) -> None:
    key = prefix + "gate_up_proj"
    value = state_dict.get(key)
    if _in_mok_layout(module) and isinstance(value, torch.Tensor) and value.shape == module.gate_up_proj.shape:
        state_dict[key] = gate_up_to_mok(value)  # torch copies the dict first: the caller's is untouched


def _hf_layout_for_other_implementations(module, args) -> None:
    if _in_mok_layout(module) and module.config._experts_implementation != NAME:
        _to_hf_layout(module)


def _gathered_copy(module: nn.Module) -> Optional[str]:
    """What holds `module`'s weights only as a gathered copy during this call, or None. A sharding
    wrapper (FSDP's fully_shard, DeepSpeed ZeRO-3) gathers the stored shards into the module for
    each forward and drops the copy after it, so a layout rewritten there would be lost, silently,
    by the next gather. Looked for once, when mok would rewrite the layout: DeepSpeed marks its
    parameters, FSDP runs the module inside a wrapper's forward (a caller's frame)."""
    if hasattr(module.gate_up_proj, "ds_id"):
        return "DeepSpeed ZeRO-3"
    if not _SHARDING_WRAPPERS or _is_dtensor(module.gate_up_proj):
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), _SHARDING_WRAPPERS):
            return f"FSDP ({type(frame.f_locals['self']).__name__})"
        frame = frame.f_back
    return None


def _check_stored_weights(module: nn.Module, name: Optional[str], change: str, remedy: str) -> None:
    holder = _gathered_copy(module)
    if holder is not None:
        where = f"{name} ({type(module).__name__})" if name else type(module).__name__
        if holder.startswith("DeepSpeed"):  # its partitions are not distributed tensors attach converts
            remedy = ("mok does not convert ZeRO-3's partitions: use ZeRO stage 1 or 2, FSDP with "
                      "attach(model), or another experts_implementation.")
        raise UnsupportedExperts(f"experts_implementation='mok': {where} holds a copy of its weights that "
                                 f"{holder} gathered for this forward, and {change} there would be lost "
                                 f"with the copy. {remedy}")


@torch.compiler.disable
def _to_mok_layout(module: nn.Module, name: Optional[str] = None) -> None:
    _check_supported(module, name)
    _check_stored_weights(module, name, "mok's one-time layout conversion",
                          "Call mok.integrations.transformers.attach(model) after the model is sharded and "
                          "before its first forward: it converts the stored shards.")
    if not getattr(module, "_mok_hooks", False):
        module.register_state_dict_post_hook(_state_dict_in_hf_layout)
        module.register_load_state_dict_pre_hook(_load_state_dict_from_hf_layout)
        module.register_forward_pre_hook(_hf_layout_for_other_implementations)
        module._mok_hooks = True
    _permute_rows_(module.gate_up_proj, gate_up_to_mok)
    if _grad_of(module.gate_up_proj) is not None:
        _permute_rows_(module.gate_up_proj.grad, gate_up_to_mok)
    module._mok_layout = True


@torch.compiler.disable
def _to_hf_layout(module: nn.Module) -> None:
    _check_stored_weights(module, None, "putting back the Hugging Face layout",
                          "Call mok.integrations.transformers.detach(model) outside the forward before "
                          "switching experts implementations.")
    _permute_rows_(module.gate_up_proj, gate_up_to_hf)
    if _grad_of(module.gate_up_proj) is not None:
        _permute_rows_(module.gate_up_proj.grad, gate_up_to_hf)
    module._mok_layout = False


def gate_up_proj_hf(module: nn.Module, grad: bool = False) -> Optional[torch.Tensor]:
    """The experts module's `gate_up_proj` (or, with grad=True, its `.grad`, None when there is none)
    in the Hugging Face layout, gate rows then up rows, whichever layout it is in now."""
    tensor = module.gate_up_proj.grad if grad else module.gate_up_proj.detach()
    if tensor is None:
        return None
    return gate_up_to_hf(tensor) if _in_mok_layout(module) else tensor


def _experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, module) for name, module in model.named_modules() if is_experts_module(module)]


def attach(model: nn.Module) -> nn.Module:
    """Sets experts_implementation="mok" on `model` (a transformers PreTrainedModel, sub-models
    included) and converts every experts module to mok's layout now, instead of at its first call.
    Raises UnsupportedExperts, before changing anything, naming the first experts module mok
    cannot compute, or when the model has no experts module that dispatches through the interface
    (a dense model, or a MoE model whose experts do not use it). Returns the model."""
    experts = _experts_modules(model)
    if not experts:
        raise UnsupportedExperts(f"{type(model).__name__}: no experts module dispatches through transformers' "
                                 "experts interface (@use_experts_implementation), so there is nothing for mok to "
                                 "compute")
    for name, module in experts:
        _check_supported(module, name)
    model.set_experts_implementation(NAME)
    for name, module in experts:
        if module.config._experts_implementation != NAME:
            raise UnsupportedExperts(f"{name} ({type(module).__name__}): its config did not take "
                                     f"experts_implementation='mok' (it has "
                                     f"{module.config._experts_implementation!r})")
        if not _in_mok_layout(module):
            _to_mok_layout(module, name)
    return model


def detach(model: nn.Module, experts_implementation: str = "grouped_mm") -> nn.Module:
    """Puts every experts module's `gate_up_proj` (and its grad) back in the Hugging Face layout
    and sets `experts_implementation` on the model. Returns the model."""
    for _, module in _experts_modules(model):
        if _in_mok_layout(module):
            _to_hf_layout(module)
    model.set_experts_implementation(experts_implementation)
    return model


# ---- the experts function -----------------------------------------------------------------------

def set_context(context: str) -> None:
    """What autograd keeps for mok's backward in every experts module from the next call on:
    "save" (default) or "recompute" (module docstring). Raises ValueError on any other value."""
    global _context
    if context not in CONTEXTS:
        raise ValueError(f"context: one of {CONTEXTS}, got {context!r}")
    _context = context


def get_context() -> str:
    """The context set by `set_context` ("save" unless changed)."""
    return _context


def _skip_other_ranks_experts(module: nn.Module, top_k_index: torch.Tensor) -> torch.Tensor:
    """Under transformers' expert parallelism a rank's experts module holds its E_l local experts
    and gets the routes to other ranks' experts as id E_l (its `num_experts`) with weight 0, as its
    own "eager" experts skip them; with `_is_expert_parallel` set, "grouped_mm" skips every id >= E_l.
    mok skips them the same way, as unused slots (-1); any other id outside [0, E_l) still raises."""
    local_experts = module.gate_up_proj.shape[0]
    if getattr(module, "_is_expert_parallel", False):
        off_rank = top_k_index >= local_experts
    else:
        off_rank = top_k_index == local_experts
    return top_k_index.masked_fill(off_rank, -1)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The ExpertsInterface function: sum_j top_k_weights[:, j] * F_{top_k_index[:, j]}(x) for the
    (T, H) `hidden_states`, returned in their dtype. Computed by mok::forward in bf16 with fp32
    router weights by `mok.functional.forward` in the context `set_context` chose; differentiable
    (mok::backward). The first call converts the module's weights to mok's layout (module
    docstring)."""
    if not _in_mok_layout(self):
        _to_mok_layout(self)
    if top_k_index.dtype not in (torch.int32, torch.int64):
        top_k_index = top_k_index.long()
    top_k_index = _skip_other_ranks_experts(self, top_k_index)
    weights = _functional.FusedExpertWeights(*(weight.to(torch.bfloat16).contiguous()
                                                for weight in (self.gate_up_proj, self.down_proj)))
    y = _functional.forward(hidden_states.to(torch.bfloat16).contiguous(), top_k_index.contiguous(),
                            top_k_weights.to(torch.float32).contiguous(), weights, context=_context)
    return y.to(hidden_states.dtype)


def register() -> None:
    """Registers `experts_forward` as experts_implementation="mok" (done on import; idempotent)."""
    _hf_moe.ExpertsInterface.register(NAME, experts_forward)


register()
