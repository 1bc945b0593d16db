"""mok's GPU layer in the FP8 modes (fp8: LayerForwardFp8 and LayerBackwardFp8; mxfp8:
LayerForwardMxfp8 and LayerBackwardMxfp8, the numerics mode on the bf16 engine) through the torch
front end on one Hopper GPU (EP = 1): the forward and, through autograd or
mok.functional.backward, the backward (save or recompute mode, on the weight cache the forward
made). y and every gradient against the CPU backend's same mode (the same recipe and rounding
points) and against an fp64 oracle of the bf16 inputs, within the FP8 rule of the C++ tests (no
more than 5 % above the CPU backend's error); bitwise repeats, save = recompute mode, autograd =
mok.functional.backward; the weight cache made anew after an in-place change of a weight (between
steps, and between a forward and a backward, and between calls of the two modes on one
workspace); no host synchronisation. Run as

    python3 -m pytest python/tests/test_torch_cuda_fp8.py

Without a Hopper GPU every test skips with the reason.
"""

import pytest
import torch
import torch.nn.functional as F
from test_torch_cuda_backward import SKIP_REASON, gradients, leaves, plain_layer  # (a sibling module)

import mok
from mok import functional as mf

# The bf16 GPU backward's tests bring the GPU requirements (SKIP_REASON) and the autograd helpers:
# plain_layer (the layer in plain PyTorch autograd; in fp64, the oracle), leaves, gradients.
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

FP8 = mf.MoKConfig(precision="fp8")
MXFP8 = mf.MoKConfig(precision="mxfp8")
CONFIGS = {"fp8": FP8, "mxfp8": MXFP8}
PRECISIONS = list(CONFIGS)
# (H, I, I_s, E, k, T): whole 128-blocks; two of them along I, one token count not a multiple of 128.
SHAPES = [(256, 256, 128, 16, 4, 301), (512, 128, 0, 8, 2, 72)]
SHAPE_IDS = ["H{}-I{}-Is{}-E{}-k{}-T{}".format(*s) for s in SHAPES]
# mxfp8's blocks of 32 only: H, I and I_s not multiples of 128.
MX_SHAPES = [(160, 96, 64, 8, 2, 75)]
# (precision, shape): each mode on every shape its blocks divide.
CASES = [("fp8", shape) for shape in SHAPES] + [("mxfp8", shape) for shape in SHAPES + MX_SHAPES]
CASE_IDS = [f"{precision}-" + "H{}-I{}-Is{}-E{}-k{}-T{}".format(*shape) for precision, shape in CASES]


def problem(shape, seed):
    hidden, inter, shared, experts, top_k, tokens = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(torch.bfloat16)

    x = randn(tokens, hidden)
    scores = torch.randn(tokens, experts, generator=gen)
    topk_w, topk_idx = scores.softmax(-1).topk(top_k, dim=-1)
    topk_w = (topk_w * torch.sign(torch.randn(tokens, top_k, generator=gen))).contiguous()
    topk_idx = topk_idx.to(torch.int32)
    topk_idx[3, top_k - 1] = -1  # an unused slot
    weights = mf.ExpertWeights(
        randn(experts, inter, hidden, scale=hidden ** -0.5), randn(experts, inter, hidden, scale=hidden ** -0.5),
        randn(experts, hidden, inter, scale=inter ** -0.5),
        *((randn(shared, hidden, scale=hidden ** -0.5), randn(shared, hidden, scale=hidden ** -0.5),
           randn(hidden, shared, scale=shared ** -0.5)) if shared else (None, None, None)))
    return x, topk_idx, topk_w, weights


def upstream(shape, seed):
    """dy (T, H) bf16, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape[5], shape[0], generator=gen).to(torch.bfloat16)


def oracle(x, topk_idx, topk_w, weights):
    """The layer in fp64 on the bf16 inputs."""
    x = x.double()
    y = torch.zeros_like(x)
    for token in range(x.shape[0]):
        for slot in range(topk_idx.shape[1]):
            expert = int(topk_idx[token, slot])
            if expert < 0:
                continue
            h = F.silu(x[token] @ weights.w_gate[expert].double().T) * (x[token] @ weights.w_up[expert].double().T)
            y[token] += float(topk_w[token, slot]) * (h @ weights.w_down[expert].double().T)
    if weights.w_shared_gate is not None:
        h = F.silu(x @ weights.w_shared_gate.double().T) * (x @ weights.w_shared_up.double().T)
        y += h @ weights.w_shared_down.double().T
    return y


def rel_l2(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def on_cuda(weights):
    return type(weights)(*(t.cuda() if t is not None else None for t in weights))


def clones(weights):
    """New tensors (new addresses) with the same values: a call on them quantizes anew."""
    return type(weights)(*(t.detach().clone() if t is not None else None for t in weights))


def training_step(x, idx, w, weights, dy, context="save", config=FP8):
    """Forward and backward through autograd in `config`'s FP8 mode on fresh leaves: y and every
    gradient."""
    mx, mw, mweights = leaves(x, w, weights)
    y = mf.forward(mx, idx, mw, mweights, context=context, config=config)
    y.backward(dy)
    result = gradients(mx, mw, mweights)
    result["y"] = y.detach()
    return result


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("precision,shape", CASES, ids=CASE_IDS)
def test_fp8_forward_follows_the_cpu_recipe(precision, shape):
    config = CONFIGS[precision]
    x, idx, w, weights = problem(shape, 5)
    exact = oracle(x, idx, w, weights)
    cpu = mf.forward(x, idx, w, weights, config=config)
    gpu_weights = on_cuda(weights)
    with torch.no_grad():
        y = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=config)
        again = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=config)
    mf.check_errors()
    assert torch.isfinite(y.float()).all()
    assert torch.equal(y.view(torch.int16), again.view(torch.int16)), "a repeat differs bitwise"
    gpu_error, cpu_error = rel_l2(y.cpu(), exact), rel_l2(cpu, exact)
    print(f"{precision} y vs fp64 {shape}: GPU {gpu_error:.5f}, CPU backend {cpu_error:.5f}, "
          f"GPU vs CPU {rel_l2(y.cpu(), cpu):.5f}")
    assert gpu_error <= 1.05 * cpu_error, (gpu_error, cpu_error)
    # The same recipe: the two differ by the accumulation (fp8: the tensor cores' FP8 sums; mxfp8:
    # the same exact products summed in another order) and the E4M3 rounding of h that it moves,
    # far less than the quantization itself (~6 % here).
    assert rel_l2(y.cpu(), cpu) < 0.25 * cpu_error


@pytest.mark.parametrize("precision,shape", CASES, ids=CASE_IDS)
def test_fp8_training_step_follows_the_cpu_recipe(precision, shape):
    """y, dx, d_topk_w and every weight gradient of an autograd step in the FP8 mode on CUDA
    against the CPU backend's step in that mode on the same inputs and against fp64 autograd of the
    bf16 inputs: the GPU's error no more than 5 % above the CPU backend's, the two far closer to
    each other than to the oracle (the same recipe; they differ by the sums' order and the
    roundings that moves, as the forward does)."""
    config = CONFIGS[precision]
    x, idx, w, weights = problem(shape, 8)
    weights = weights.fused()  # the layout mok.nn.MoE keeps (gradients in it too)
    dy = upstream(shape, 9)
    cpu = training_step(x, idx, w, weights, dy, config=config)
    gpu = training_step(x.cuda(), idx.cuda(), w.cuda(), on_cuda(weights), dy.cuda(), config=config)
    mf.check_errors()

    # (fp64 autograd on the GPU: on a few CPU cores it takes tens of seconds)
    ox, ow, oweights = leaves(x.cuda(), w.cuda(), on_cuda(weights), torch.float64)
    exact_y = plain_layer(ox, idx.cuda(), ow, oweights, torch.float64)
    (exact_y * dy.cuda().double()).sum().backward()
    exact = {name: value.cpu() for name, value in gradients(ox, ow, oweights).items()}
    exact["y"] = exact_y.detach().cpu()

    assert gpu.keys() == cpu.keys() == exact.keys()
    for name in gpu:
        mine = gpu[name].cpu()
        assert mine.dtype == cpu[name].dtype and mine.shape == cpu[name].shape, name
        assert torch.isfinite(mine.float()).all(), f"{name}: non-finite (unwritten?)"
        gpu_error, cpu_error = rel_l2(mine, exact[name]), rel_l2(cpu[name], exact[name])
        apart = rel_l2(mine, cpu[name])
        print(f"{precision} {name} vs fp64 {shape}: GPU {gpu_error:.5f}, CPU backend {cpu_error:.5f}, "
              f"GPU vs CPU {apart:.5f}")
        assert gpu_error <= 1.05 * cpu_error, (name, gpu_error, cpu_error)
        assert apart < 0.25 * cpu_error, (name, apart, cpu_error)
    assert gpu["d_topk_w"][3, shape[4] - 1].item() == 0.0, "the unused slot's d_topk_w"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp8_backward_repeats_bitwise(precision):
    """Autograd steps on new leaves (the cache quantized anew each time), the save and recompute
    contexts, and mok.functional.backward on the same tensors (the cache as it is) all give the
    same bits; the bf16 gradients autograd gets for bf16 parameters
    are the fp32 ones rounded once."""
    config = CONFIGS[precision]
    shape = SHAPES[0]
    x, idx, w, weights = problem(shape, 10)
    x, idx, w, weights, dy = x.cuda(), idx.cuda(), w.cuda(), on_cuda(weights.fused()), upstream(shape, 11).cuda()
    first = training_step(x, idx, w, weights, dy, config=config)
    for context in ("save", "recompute", "save"):
        again = training_step(x, idx, w, weights, dy, context, config)
        for name, value in first.items():
            assert same_bits(value, again[name]), f"{name} ({context})"
    functional = [mf.backward(dy, x, idx, w, weights, config=config) for _ in range(2)]
    mf.check_errors()
    for grads in functional:
        assert same_bits(grads.dx, first["dx"])
        assert same_bits(grads.d_topk_w, first["d_topk_w"])
        for name, grad in zip(weights._fields, grads.weights):
            if grad is not None:
                assert grad.dtype == torch.float32
                assert same_bits(grad.to(torch.bfloat16), first[f"grad_{name}"]), name
    for name, grad in zip(weights._fields, functional[0].weights):
        if grad is not None:
            assert same_bits(grad, getattr(functional[1].weights, name)), name


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fp8_saved_context_gives_the_recompute_bits(precision, shape):
    """forward_save in an FP8 mode keeps the gate/up GEMM's sums in the bf16 layer's layout
    (bf16, T * k rows at EP 1 and the shared expert's T rows), its y is forward's, and the
    backward reading them gives the bits of the backward that recomputes them."""
    x, idx, w, weights = problem(shape, 12)
    x, idx, w, fused, dy = x.cuda(), idx.cuda(), w.cuda(), on_cuda(weights.fused()), upstream(shape, 13).cuda()
    y, gate_up, shared_gate_up = torch.ops.mok.forward_save(x, idx, w, *fused, 0, precision)
    tokens, top_k = idx.shape
    assert gate_up.dtype == torch.bfloat16
    assert gate_up.shape == (tokens * top_k, fused[0].shape[1])
    if fused[2] is not None:
        assert shared_gate_up.shape == (tokens, fused[2].shape[0])
    assert same_bits(y, torch.ops.mok.forward(x, idx, w, *fused, 0, precision))
    grads = torch.ops.mok.backward(dy, x, idx, w, *fused, 0, False, gate_up, shared_gate_up, precision)
    expected = torch.ops.mok.backward(dy, x, idx, w, *fused, 0, False, None, None, precision)
    for mine, theirs in zip(grads, expected):
        assert same_bits(mine, theirs)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp8_weight_cache_follows_in_place_updates(precision):
    config = CONFIGS[precision]
    x, idx, w, weights = problem(SHAPES[0], 6)
    gpu_weights = on_cuda(weights)
    with torch.inference_mode():
        before = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=config)
    with torch.no_grad():
        gpu_weights.w_down.mul_(-2.0)  # an optimizer step, in place (same tensors, same addresses)
        weights.w_down.mul_(-2.0)
        after = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=config)
    mf.check_errors()
    cpu_after = mf.forward(x, idx, w, weights, config=config)
    assert rel_l2(after.cpu(), cpu_after) < 0.02, "the forward read a stale weight cache"
    assert not torch.equal(before, after)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_fp8_backward_sees_weights_changed_after_the_forward(precision):
    """A backward differentiates the layer at the weights passed to it: changed in place since the
    forward that made the cache, they are quantized anew (the same bits as new tensors of their
    values give)."""
    config = CONFIGS[precision]
    shape = SHAPES[0]
    x, idx, w, weights = problem(shape, 14)
    x, idx, w, fused, dy = x.cuda(), idx.cuda(), w.cuda(), on_cuda(weights.fused()), upstream(shape, 15).cuda()
    with torch.no_grad():
        mf.forward(x, idx, w, fused, config=config)  # the cache: these weights, as they are now
    before = mf.backward(dy, x, idx, w, fused, config=config)
    with torch.no_grad():
        fused.w_gate_up.mul_(-0.5)
        fused.w_shared_down.mul_(3.0)
    changed = mf.backward(dy, x, idx, w, fused, config=config)
    fresh = mf.backward(dy, x, idx, w, clones(fused), config=config)
    mf.check_errors()
    assert not torch.equal(before.dx, changed.dx)
    assert same_bits(changed.dx, fresh.dx), "the backward read a stale weight cache"
    assert same_bits(changed.d_topk_w, fresh.d_topk_w)
    for mine, theirs in zip(changed.weights, fresh.weights):
        assert same_bits(mine, theirs)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_module_training_in_fp8_sees_optimizer_steps(precision):
    """mok.nn.MoE in an FP8 mode on CUDA: steps of forward, backward and an in-place update of the
    expert weights (an optimizer step: same tensors, new values). Each step's y and gradients are
    those of the weights as they are at that step: the bits of the same calls on new tensors of
    their values, on a workspace of their own (so the module's automatic workspace, and its weight
    cache, serve the module alone: only the in-place change tells it to quantize anew)."""
    config = CONFIGS[precision]
    torch.manual_seed(16)
    hidden, inter, shared, experts, top_k = 256, 256, 128, 16, 4
    layer = mok.nn.MoE(hidden, inter, experts, top_k, shared_intermediate=shared, config=config, device="cuda")
    x = torch.randn(3, 70, hidden, device="cuda")
    dy = torch.randn(3, 70, hidden, device="cuda").to(torch.bfloat16)
    tokens = x.reshape(-1, hidden)
    checker = mf.create_workspace(layer.shape, tokens.shape[0], "cuda", config=config)
    params = (layer.w_gate_up, layer.w_down, layer.w_shared_gate_up, layer.w_shared_down)
    outputs = []
    try:
        for step in range(3):
            layer.zero_grad(set_to_none=True)
            y = layer(x)
            y.backward(dy)
            with torch.no_grad():
                idx, w = layer.route(tokens)
                values = clones(layer.expert_weights())
                expected_y = mf.forward(tokens.to(torch.bfloat16), idx, w, values, workspace=checker)
                expected = mf.backward(dy.reshape(-1, hidden), tokens.to(torch.bfloat16), idx, w, values,
                                       workspace=checker)
            assert same_bits(y.reshape(-1, hidden).detach(), expected_y), f"step {step}: y"
            for param, grad in zip(params, expected.weights):
                assert same_bits(param.grad, grad.to(torch.bfloat16)), f"step {step}: gradient"
            assert layer.router.grad is not None and torch.isfinite(layer.router.grad).all()
            outputs.append(y.detach().clone())
            with torch.no_grad():  # the optimizer step, in place
                for param in params:
                    param.sub_(param.grad, alpha=0.5)
        mf.check_errors()
    finally:
        checker.close()
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[1], outputs[2])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_no_host_sync_in_an_fp8_training_step(precision):
    config = CONFIGS[precision]
    shape = SHAPES[0]
    x, idx, w, weights = problem(shape, 17)
    x, idx, w, fused, dy = x.cuda(), idx.cuda(), w.cuda(), on_cuda(weights.fused()), upstream(shape, 18).cuda()
    training_step(x, idx, w, fused, dy, config=config)  # workspaces and buffers made (their allocation syncs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        training_step(x, idx, w, fused, dy, config=config)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fp8_and_mxfp8_share_a_workspace():
    """The two FP8 modes keep a weight cache each on one workspace, and the torch ops keep the
    weights of its last FP8 call alive: alternating calls give each mode's own bits, and weights
    changed in place between them reach both modes (the bits of new tensors of their values)."""
    shape = SHAPES[0]
    x, idx, w, weights = problem(shape, 20)
    x, idx, w, fused = x.cuda(), idx.cuda(), w.cuda(), on_cuda(weights.fused())
    with torch.no_grad():
        fp8 = mf.forward(x, idx, w, fused, config=FP8)
        mxfp8 = mf.forward(x, idx, w, fused, config=MXFP8)
        assert not torch.equal(fp8, mxfp8)
        assert same_bits(mf.forward(x, idx, w, fused, config=FP8), fp8)
        assert same_bits(mf.forward(x, idx, w, fused, config=MXFP8), mxfp8)
        fused.w_down.mul_(-2.0)  # in place: same tensors, same addresses
        changed = {name: mf.forward(x, idx, w, fused, config=config) for name, config in CONFIGS.items()}
        fresh = {name: mf.forward(x, idx, w, clones(fused), config=config) for name, config in CONFIGS.items()}
    mf.check_errors()
    for name in CONFIGS:
        assert same_bits(changed[name], fresh[name]), f"{name} read a stale weight cache"
    assert not torch.equal(changed["mxfp8"], mxfp8)
