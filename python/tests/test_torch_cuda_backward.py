"""mok's GPU forward and backward through the torch front end on one Hopper GPU (EP = 1), on
shapes besides the presets (top-1 to top-6, odd token counts, I not a multiple of 128): y and every
gradient against an fp64 autograd oracle, no worse than a bf16 PyTorch autograd layer measured against the
same oracle; bitwise repeats; save mode (the forward keeps the gate/up pre-activations) against
recompute mode, bitwise; the low-memory backward (MoKConfig.low_memory_backward) against the
default one, bitwise; a CUDA graph of forward + backward replayed; main_grad accumulation;
no host synchronisation. Run as

    python3 -m pytest python/tests/test_torch_cuda_backward.py

Without a Hopper GPU every test skips with the reason.
"""

import pytest
import torch
import torch.nn.functional as F

import mok
from mok import functional as mf


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability()[0] != 9:
        return "needs a Hopper GPU (mok's GPU layer is built for sm_90a)"
    if not mok._ops.HAVE_GPU_LAYER:
        return "this build of mok has no GPU layer"
    return None


SKIP_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))

# (H, I, I_s, E, k, T): the tiny preset; a wider one with top-6 and an odd token count.
SHAPES = [(256, 128, 128, 16, 4, 300), (512, 192, 64, 16, 6, 301), (256, 136, 0, 8, 1, 77)]


def problem(shape, seed):
    hidden, inter, shared, experts, top_k, tokens = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=gen) * scale).to(torch.bfloat16).cuda()

    x = randn(tokens, hidden)
    scores = torch.randn(tokens, experts, generator=gen)
    topk_w, topk_idx = scores.softmax(-1).topk(top_k, dim=-1)
    topk_w = (topk_w * torch.sign(torch.randn(tokens, top_k, generator=gen))).contiguous()  # any sign
    topk_idx = topk_idx.to(torch.int32)
    topk_idx[3, top_k - 1] = -1  # an unused slot
    weights = mf.ExpertWeights(
        randn(experts, inter, hidden, scale=hidden ** -0.5), randn(experts, inter, hidden, scale=hidden ** -0.5),
        randn(experts, hidden, inter, scale=inter ** -0.5),
        *((randn(shared, hidden, scale=hidden ** -0.5), randn(shared, hidden, scale=hidden ** -0.5),
           randn(hidden, shared, scale=shared ** -0.5)) if shared else (None, None, None)))
    dy = randn(tokens, hidden)
    return x, topk_idx.cuda(), topk_w.cuda(), weights.fused(), dy


def plain_layer(x, topk_idx, topk_w, weights, dtype):
    """The layer in plain PyTorch autograd, every op in `dtype` (bf16: what a PyTorch user gets
    without mok; float64: the oracle)."""
    gate, up = mf.split_gate_up(weights.w_gate_up)
    xs = x.to(dtype)
    y = torch.zeros_like(xs)
    if weights.w_shared_gate_up is not None:
        shared_gate, shared_up = mf.split_gate_up(weights.w_shared_gate_up)
        shared_hidden = F.silu(xs @ shared_gate.to(dtype).t()) * (xs @ shared_up.to(dtype).t())
        y = y + shared_hidden @ weights.w_shared_down.to(dtype).t()
    for j in range(topk_idx.shape[1]):
        for expert in range(gate.shape[0]):
            rows = (topk_idx[:, j] == expert).nonzero().flatten()
            if rows.numel():
                h = F.silu(xs[rows] @ gate[expert].to(dtype).t()) * (xs[rows] @ up[expert].to(dtype).t())
                out = h @ weights.w_down[expert].to(dtype).t()
                y = y.index_add(0, rows, topk_w[rows, j, None].to(dtype) * out)
    return y


def leaves(x, topk_w, weights, dtype=None):
    def leaf(t):
        return (t.detach().clone() if dtype is None else t.detach().to(dtype)).requires_grad_()

    return leaf(x), leaf(topk_w), mf.FusedExpertWeights(*(leaf(t) if t is not None else None for t in weights))


def gradients(x, topk_w, weights):
    names = ["dx", "d_topk_w"] + [f"grad_{n}" for n in weights._fields]
    values = [x.grad, topk_w.grad] + [t.grad if t is not None else None for t in weights]
    return {n: v for n, v in zip(names, values) if v is not None}


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-I{}-Is{}-E{}-k{}-T{}".format(*s))
def test_output_and_gradients_no_worse_than_bf16_autograd(shape):
    x, idx, w, weights, dy = problem(shape, seed=1)
    mx, mw, mweights = leaves(x, w, weights)
    y = mf.forward(mx, idx, mw, mweights)
    y.backward(dy)
    torch.cuda.synchronize()
    mine = gradients(mx, mw, mweights)
    mine["y"] = y.detach()

    ox, ow, oweights = leaves(x, w, weights, torch.float64)
    oracle_y = plain_layer(ox, idx, ow, oweights, torch.float64)
    (oracle_y * dy.double()).sum().backward()
    oracle = gradients(ox, ow, oweights)
    oracle["y"] = oracle_y.detach()

    bx, bw, bweights = leaves(x, w, weights)
    bf16_y = plain_layer(bx, idx, bw, bweights, torch.bfloat16)
    bf16_y.backward(dy)
    bf16 = gradients(bx, bw, bweights)
    bf16["y"] = bf16_y.detach()

    assert mine.keys() == oracle.keys()
    for name in mine:
        assert torch.isfinite(mine[name].float()).all(), f"{name}: non-finite (unwritten?)"
        mok_error, torch_error = rel_l2(mine[name], oracle[name]), rel_l2(bf16[name], oracle[name])
        assert mok_error <= torch_error + 1e-4, f"{name}: mok {mok_error:.3e} vs bf16 autograd {torch_error:.3e}"
    unused = (3, shape[4] - 1)
    assert mine["d_topk_w"][unused].item() == 0.0


def run_step(x, idx, w, weights, dy, context="save", workspace=None):
    mx, mw, mweights = leaves(x, w, weights)
    mf.forward(mx, idx, mw, mweights, workspace=workspace, context=context).backward(dy)
    return gradients(mx, mw, mweights)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-I{}-Is{}-E{}-k{}-T{}".format(*s))
def test_save_mode_equals_recompute_mode_bitwise(shape):
    x, idx, w, weights, dy = problem(shape, seed=6)
    saved = run_step(x, idx, w, weights, dy, "save")
    recomputed = run_step(x, idx, w, weights, dy, "recompute")
    assert saved.keys() == recomputed.keys()
    for name, value in saved.items():
        assert torch.equal(value.view(torch.uint8), recomputed[name].view(torch.uint8)), name


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}-I{}-Is{}-E{}-k{}-T{}".format(*s))
def test_low_memory_backward_equals_the_default_bitwise(shape):
    # MoKConfig(low_memory_backward=True): the routed experts in chunks of 1.5 T rows, no sum split.
    hidden, inter, shared, experts, top_k, tokens = shape
    x, idx, w, weights, dy = problem(shape, seed=9)
    workspace = mf.create_workspace(mf.LayerShape(hidden, inter, experts, top_k, shared), tokens, "cuda",
                                    config=mf.MoKConfig(low_memory_backward=True))
    for context in ("save", "recompute"):
        default = run_step(x, idx, w, weights, dy, context)
        chunked = run_step(x, idx, w, weights, dy, context, workspace)
        assert default.keys() == chunked.keys()
        for name, value in default.items():
            assert torch.equal(value.view(torch.uint8), chunked[name].view(torch.uint8)), f"{context}: {name}"


def test_save_mode_context_shapes():
    x, idx, w, weights, dy = problem(SHAPES[0], seed=7)
    y, gate_up, shared_gate_up = torch.ops.mok.forward_save(x, idx, w, *weights, 0)
    tokens, top_k = idx.shape
    assert gate_up.shape == (tokens * top_k, weights.w_gate_up.shape[1]) and gate_up.dtype == torch.bfloat16
    assert shared_gate_up.shape == (tokens, weights.w_shared_gate_up.shape[0])
    assert torch.equal(y.view(torch.int16), mf.forward(x, idx, w, weights).view(torch.int16))
    with pytest.raises(ValueError, match="saved_gate_up"):  # a context of another call's size
        torch.ops.mok.backward(dy, x, idx, w, *weights, 0, False, gate_up[:-1], shared_gate_up)


def test_backward_repeats_bitwise():
    x, idx, w, weights, dy = problem(SHAPES[1], seed=2)
    first = run_step(x, idx, w, weights, dy)
    for _ in range(2):
        again = run_step(x, idx, w, weights, dy)
        for name, value in first.items():
            assert torch.equal(value.view(torch.uint8), again[name].view(torch.uint8)), name


def test_no_host_sync_in_forward_and_backward():
    x, idx, w, weights, dy = problem(SHAPES[0], seed=3)
    run_step(x, idx, w, weights, dy)  # workspaces made (the only sync: their allocation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_step(x, idx, w, weights, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_of_a_training_step_replays_bitwise():
    x, idx, w, weights, dy = problem(SHAPES[0], seed=4)
    eager = [mf.backward(dy, x, idx, w, weights)]
    static = [t.clone() for t in (x, dy)]
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mf.backward(static[1], static[0], idx, w, weights)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = mf.backward(static[1], static[0], idx, w, weights)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.dx.view(torch.int16), eager[0].dx.view(torch.int16))
    assert torch.equal(captured.d_topk_w, eager[0].d_topk_w)
    for mine, expected in zip(captured.weights, eager[0].weights):
        if mine is not None:
            assert torch.equal(mine, expected)


def test_cuda_graph_of_a_save_mode_training_step_replays_bitwise():
    x, idx, w, weights, dy = problem(SHAPES[1], seed=8)
    eager = run_step(x, idx, w, weights, dy)
    mx, mw, mweights = leaves(x, w, weights)

    def step():
        for t in (mx, mw, *mweights):
            if t is not None:
                t.grad = None
        mf.forward(mx, idx, mw, mweights).backward(dy)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in (mx, mw, *mweights):
        if t is not None and t.grad is not None:
            t.grad.fill_(float("nan"))  # poisoned: the replay must write every gradient
    graph.replay()
    torch.cuda.synchronize()
    for name, value in gradients(mx, mw, mweights).items():
        assert torch.equal(value.view(torch.uint8), eager[name].view(torch.uint8)), name


def test_main_grads_accumulate():
    x, idx, w, weights, dy = problem(SHAPES[0], seed=5)
    fresh = mf.backward(dy, x, idx, w, weights)
    main = mf.FusedExpertWeights(*(torch.full(t.shape, 0.5, device="cuda") if t is not None else None
                                   for t in weights))
    mf.backward(dy, x, idx, w, weights, main_grads=main)
    for buffer, grad in zip(main, fresh.weights):
        if buffer is not None:
            torch.testing.assert_close(buffer, grad + 0.5, rtol=0, atol=1e-6)
