"""mok's GPU forward in precision fp8 through the torch front end on one Hopper GPU (EP = 1): the
forward only so far, where autograd does not record it. y against the CPU backend's fp8 mode (the
same recipe and rounding points) and against an fp64 oracle of the bf16 inputs, within the FP8
rule of the C++ tests (no more than 5 % above the CPU backend's error); bitwise repeats; the weight
cache made anew after an in-place change of a weight; training refused with a clear error. Run as

    python3 -m pytest python/tests/test_torch_cuda_fp8.py

Without a Hopper GPU every test skips with the reason.
"""

import pytest
import torch
import torch.nn.functional as F
from test_torch_cuda_backward import SKIP_REASON  # the same GPU requirements (a sibling module)

from mok import functional as mf

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

FP8 = mf.MoKConfig(precision="fp8")
# (H, I, I_s, E, k, T): whole 128-blocks; two of them along I, one token count not a multiple of 128.
SHAPES = [(256, 256, 128, 16, 4, 301), (512, 128, 0, 8, 2, 72)]


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
    return mf.ExpertWeights(*(t.cuda() if t is not None else None for t in weights))


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_forward_follows_the_cpu_recipe(shape):
    x, idx, w, weights = problem(shape, 5)
    exact = oracle(x, idx, w, weights)
    cpu = mf.forward(x, idx, w, weights, config=FP8)
    gpu_weights = on_cuda(weights)
    with torch.no_grad():
        y = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=FP8)
        again = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=FP8)
    mf.check_errors()
    assert torch.isfinite(y.float()).all()
    assert torch.equal(y.view(torch.int16), again.view(torch.int16)), "a repeat differs bitwise"
    gpu_error, cpu_error = rel_l2(y.cpu(), exact), rel_l2(cpu, exact)
    print(f"fp8 y vs fp64 {shape}: GPU {gpu_error:.5f}, CPU backend {cpu_error:.5f}, "
          f"GPU vs CPU {rel_l2(y.cpu(), cpu):.5f}")
    assert gpu_error <= 1.05 * cpu_error, (gpu_error, cpu_error)
    # The same recipe: the two differ by the accumulation (the tensor cores' FP8 sums) and the
    # E4M3 rounding of h that it moves, far less than the quantization itself (~6 % here).
    assert rel_l2(y.cpu(), cpu) < 0.25 * cpu_error


def test_fp8_weight_cache_follows_in_place_updates():
    x, idx, w, weights = problem(SHAPES[0], 6)
    gpu_weights = on_cuda(weights)
    with torch.inference_mode():
        before = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=FP8)
    with torch.no_grad():
        gpu_weights.w_down.mul_(-2.0)  # an optimizer step, in place (same tensors, same addresses)
        weights.w_down.mul_(-2.0)
        after = mf.forward(x.cuda(), idx.cuda(), w.cuda(), gpu_weights, config=FP8)
    mf.check_errors()
    cpu_after = mf.forward(x, idx, w, weights, config=FP8)
    assert rel_l2(after.cpu(), cpu_after) < 0.02, "the forward read a stale weight cache"
    assert not torch.equal(before, after)


def test_fp8_training_on_cuda_is_refused():
    x, idx, w, weights = problem(SHAPES[1], 7)
    trained = mf.ExpertWeights(*(t.cuda().requires_grad_() if t is not None else None for t in weights))
    with pytest.raises(NotImplementedError, match="fp8 on CUDA tensors runs the forward only so far"):
        mf.forward(x.cuda(), idx.cuda(), w.cuda(), trained, config=FP8)
