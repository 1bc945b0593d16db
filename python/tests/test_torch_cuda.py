"""The torch front end on two GPUs: mok's GPU layer forward at EP = 2 over a torch.distributed
group (and EP = 1), against a plain-PyTorch layer, bitwise determinism, CUDA-graph replay, opcheck,
torch.compile, the reference backward and the core's errors. Run as

    torchrun --nproc-per-node=2 -m pytest python/tests/test_torch_cuda.py

Both ranks run every test in the same order (most of them are collectives). Without two Hopper
GPUs, torch.distributed or torchrun, every test skips with the reason.

The global problem (2T tokens, E experts) is made from a seed on both ranks; rank r holds tokens
[rT, (r+1)T) and experts [rE/2, (r+1)E/2), as DESIGN.md §1 places them.
"""

import datetime
import os

import pytest
import torch
import torch.nn.functional as F

import mok
from mok import functional as mf

# T tokens per rank (not a multiple of the tile); I the intermediate size, as in the shapes.
H, I, I_S, E, K, T = 256, 128, 128, 8, 2, 200  # noqa: E741
RANKS = 2


def _skip_reason():
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.device_count() < RANKS:
        return f"needs {RANKS} GPUs, {torch.cuda.device_count()} visible"
    if not torch.distributed.is_available():
        return "needs torch.distributed"
    if int(os.environ.get("WORLD_SIZE", "1")) != RANKS:
        return f"run under torchrun --nproc-per-node={RANKS} (WORLD_SIZE={os.environ.get('WORLD_SIZE')})"
    if torch.cuda.get_device_capability()[0] != 9:
        return "needs Hopper GPUs (mok's GPU layer is built for sm_90a)"
    if not mok._ops.HAVE_GPU_LAYER:
        return "this build of mok has no GPU layer"
    return None


SKIP_REASON = _skip_reason()
pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=str(SKIP_REASON))


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120),
                                device_id=torch.device("cuda", local_rank))
    return dist.group.WORLD


def rank():
    return torch.distributed.get_rank()


def device():
    return torch.device("cuda", torch.cuda.current_device())


def global_problem(seed, shared=True, tokens=RANKS * T):
    """x (tokens, H), topk_idx int32, topk_w, FusedExpertWeights of all E experts, on this GPU."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    x = randn(tokens, H)
    topk_w, topk_idx = torch.randn(tokens, E, generator=gen).softmax(-1).topk(K, dim=-1)
    topk_idx = topk_idx.to(torch.int32)
    topk_idx[3, 1] = -1  # unused slots, on both ranks
    topk_idx[tokens - 5, 0] = -1
    weights = mf.ExpertWeights(
        randn(E, I, H, scale=H ** -0.5), randn(E, I, H, scale=H ** -0.5), randn(E, H, I, scale=I ** -0.5),
        *((randn(I_S, H, scale=H ** -0.5), randn(I_S, H, scale=H ** -0.5), randn(H, I_S, scale=I_S ** -0.5))
          if shared else (None, None, None))).fused()
    on_gpu = mf.FusedExpertWeights(*(t.to(device()) if t is not None else None for t in weights))
    return x.to(device()), topk_idx.to(device()), topk_w.contiguous().to(device()), on_gpu


def rank_share(problem, r=None):
    """This rank's tokens and experts of the global problem (views, no copies)."""
    r = rank() if r is None else r
    x, idx, w, weights = problem
    tokens, local = slice(r * T, (r + 1) * T), slice(r * E // RANKS, (r + 1) * E // RANKS)
    return x[tokens], idx[tokens], w[tokens], weights._replace(w_gate_up=weights.w_gate_up[local],
                                                               w_down=weights.w_down[local])


def swiglu_ffn(x, gate, up, down):
    return (F.silu(x @ gate.t()) * (x @ up.t())) @ down.t()


def torch_layer(x, topk_idx, topk_w, weights):
    """The layer in plain PyTorch, fp32 math on the bf16 values, every expert (EP = 1)."""
    xf = x.float()
    gate, up = mf.split_gate_up(weights.w_gate_up)
    y = torch.zeros_like(xf)
    if weights.w_shared_gate_up is not None:
        shared_gate, shared_up = mf.split_gate_up(weights.w_shared_gate_up)
        y = y + swiglu_ffn(xf, shared_gate.float(), shared_up.float(), weights.w_shared_down.float())
    for j in range(topk_idx.shape[1]):
        for expert in range(gate.shape[0]):
            rows = (topk_idx[:, j] == expert).nonzero().flatten()
            if rows.numel():
                out = swiglu_ffn(xf[rows], gate[expert].float(), up[expert].float(), weights.w_down[expert].float())
                y = y.index_add(0, rows, topk_w[rows, j, None] * out)
    return y


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def bits(tensor):
    return tensor.view(torch.int16)


def poisoned_forward(x, *args, **kwargs):
    """mf.forward whose output starts as NaN: the op allocates y itself, so first free a NaN block
    of y's size for the caching allocator to hand it; an element mok never writes stays NaN."""
    poison = torch.full((x.shape[0], H), float("nan"), dtype=torch.bfloat16, device=x.device)
    address = poison.data_ptr()
    del poison
    y = mf.forward(x, *args, **kwargs)
    assert y.data_ptr() == address, "the poisoned block was not reused: the check below would prove nothing"
    return y


def ep2_workspace(group, shared=True, config=None):
    shape = mf.LayerShape(H, I, E, K, I_S if shared else 0)
    return mf.get_workspace(shape, T, device(), group, config)


@pytest.mark.parametrize("shared", [True, False])
def test_ep2_forward_matches_plain_torch(group, shared):
    problem = global_problem(100 + shared, shared)
    y = poisoned_forward(*rank_share(problem), workspace=ep2_workspace(group, shared))
    mf.check_errors(ep2_workspace(group, shared))
    assert y.shape == (T, H) and y.dtype == torch.bfloat16 and y.device == device()
    assert torch.isfinite(y).all(), "some outputs were never written"
    expected = torch_layer(*problem)[rank() * T:(rank() + 1) * T]
    assert rel_l2(y, expected) < 1e-2


def test_bitwise_repeat_ep1_equals_ep2_and_knobs(group):
    problem = global_problem(7)
    share = rank_share(problem)
    workspace = ep2_workspace(group)
    first = poisoned_forward(*share, workspace=workspace)
    again = poisoned_forward(*share, workspace=workspace)
    assert torch.equal(bits(first), bits(again)), "EP=2 repeat differs"
    # EP = 1 over the same global problem (this GPU alone, the automatic workspace): same bits.
    whole = poisoned_forward(*problem)
    mf.check_errors(device=device())
    assert torch.equal(bits(whole[rank() * T:(rank() + 1) * T]), bits(first)), "EP=1 and EP=2 differ"
    # Scheduling knobs and the index dtype change nothing. (No poisoning: the int64 ids' int32
    # copy is allocated before y; equal bits to `first` show every element written anyway.)
    fewer_copy_sms = ep2_workspace(group, config=mf.MoKConfig(num_comm_sms=4, minibatch_tokens=32))
    x, idx, w, weights = share
    assert torch.equal(bits(mf.forward(x, idx.long(), w, weights, workspace=fewer_copy_sms)), bits(first))
    mf.check_errors(fewer_copy_sms)
    # A ring of 256 rows (2 row blocks) takes this rank's received rows in several rounds.
    small_ring = ep2_workspace(group, config=mf.MoKConfig(ring_rows=256))
    assert torch.equal(bits(mf.forward(x, idx, w, weights, workspace=small_ring)), bits(first)), \
        "a ring smaller than the received rows changed the bits"
    mf.check_errors(small_ring)


def test_no_host_sync_in_forward(group):
    problem = global_problem(8)
    share = rank_share(problem)
    workspace = ep2_workspace(group)
    mf.forward(*share, workspace=workspace)  # warm
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = mf.forward(*share, workspace=workspace)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    mf.check_errors(workspace)
    assert torch.isfinite(y).all()


def test_cuda_graph_replay_equals_eager(group):
    """The op captured in a CUDA graph (both ranks at once) and replayed: same bits as the eager
    call, and new values in the captured input buffer are what the replay computes."""
    x, idx, w, weights = rank_share(global_problem(13))
    workspace = ep2_workspace(group)
    eager = mf.forward(x, idx, w, weights, workspace=workspace)
    static_x = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mf.forward(static_x, idx, w, weights, workspace=workspace)  # warm-up off the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static_y = mf.forward(static_x, idx, w, weights, workspace=workspace)
    for _ in range(2):
        static_y.fill_(float("nan"))
        graph.replay()
        mf.check_errors(workspace)
        assert torch.equal(bits(static_y), bits(eager)), "graph replay differs from the eager call"
    other_x = rank_share(global_problem(14))[0]
    expected = mf.forward(other_x, idx, w, weights, workspace=workspace)
    static_x.copy_(other_x)
    static_y.fill_(float("nan"))
    graph.replay()
    mf.check_errors(workspace)
    assert torch.equal(bits(static_y), bits(expected)), "the replay did not compute the new input"
    assert not torch.equal(bits(expected), bits(eager))


def test_opcheck_cuda_op(group):
    x, idx, w, weights = global_problem(9, tokens=96)
    leaves = [x.requires_grad_(), idx, w.requires_grad_(), *(t.requires_grad_() for t in weights)]
    torch.library.opcheck(torch.ops.mok.forward.default, (*leaves, 0))
    dy = torch.randn(x.shape, device=device()).to(torch.bfloat16)
    detached = [t.detach() for t in leaves]
    torch.library.opcheck(torch.ops.mok.backward.default, (dy, *detached, 0))


def test_ep2_reference_backward_matches_plain_autograd(group):
    problem = global_problem(11)
    x, idx, w, weights = (t.detach().clone() if isinstance(t, torch.Tensor) else t for t in rank_share(problem))
    weights = mf.FusedExpertWeights(*(t.detach().clone().requires_grad_() for t in weights))
    x.requires_grad_()
    w.requires_grad_()
    gen = torch.Generator().manual_seed(12)
    dy_global = torch.randn(RANKS * T, H, generator=gen).to(torch.bfloat16).to(device())
    mf.forward(x, idx, w, weights, workspace=ep2_workspace(group)).backward(dy_global[rank() * T:(rank() + 1) * T])

    gx, gidx, gw, gweights = problem
    gx = gx.float().requires_grad_()
    gw = gw.clone().requires_grad_()
    gweights = mf.FusedExpertWeights(*(t.float().requires_grad_() for t in gweights))
    (torch_layer(gx, gidx, gw, gweights) * dy_global.float()).sum().backward()
    mine = slice(rank() * T, (rank() + 1) * T)
    local = slice(rank() * E // RANKS, (rank() + 1) * E // RANKS)
    assert rel_l2(x.grad, gx.grad[mine]) < 1e-2
    assert rel_l2(w.grad, gw.grad[mine]) < 1e-2
    unused_slot = (3, 1) if rank() == 0 else (T - 5, 0)  # see global_problem
    assert w.grad[unused_slot] == 0
    assert rel_l2(weights.w_gate_up.grad, gweights.w_gate_up.grad[local]) < 1e-2
    assert rel_l2(weights.w_down.grad, gweights.w_down.grad[local]) < 1e-2
    # The shared expert's gradients cover this rank's tokens: their sum over ranks is the whole.
    for mine_grad, whole in ((weights.w_shared_gate_up.grad, gweights.w_shared_gate_up.grad),
                             (weights.w_shared_down.grad, gweights.w_shared_down.grad)):
        total = mine_grad.float()
        torch.distributed.all_reduce(total)
        assert rel_l2(total, whole) < 1e-2


def average_replicated_gradients(model, group):
    """Data parallelism over the EP group: replicated weights average their gradients; each rank's
    experts already hold every rank's tokens' gradient (sum), so they take the same 1/R."""
    for name, parameter in model.named_parameters():
        if parameter.grad is None:
            continue
        if name.endswith("w_gate_up") or name.endswith("w_down"):
            parameter.grad /= RANKS
        else:
            torch.distributed.all_reduce(parameter.grad, op=torch.distributed.ReduceOp.AVG, group=group)


def test_torch_compile_and_training_of_an_ep2_model(group):
    torch.manual_seed(0)  # the same replicated weights on both ranks; experts differ by rank
    model = torch.nn.Sequential(
        torch.nn.Linear(H, H), mok.nn.MoE(H, I, E, K, shared_intermediate=I_S, process_group=group)).to(device())
    x = torch.randn(4, 50, H, device=device()) + rank()
    eager = model(x)  # the first call makes the EP workspace (collective)
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    out = compiled(x)
    assert out.shape == (4, 50, H) and out.dtype == torch.bfloat16 and out.device == device()
    assert rel_l2(out, eager) < 1e-2
    out.float().square().mean().backward()
    assert model[1].w_gate_up.grad is not None and model[0].weight.grad is not None
    assert model[1].router.grad.abs().sum() > 0

    target = torch.randn(4, 50, H, device=device()) * 0.1
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = (compiled(x).float() - target).square().mean()
        loss.backward()
        average_replicated_gradients(model, group)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_core_errors_surface_as_python_exceptions(group):
    x, idx, w, weights = rank_share(global_problem(13))
    workspace = ep2_workspace(group)
    # Host checks of the core, raised on both ranks before anything is enqueued.
    with pytest.raises(ValueError, match=r"x: 201 tokens; the workspace holds at most 200 per rank"):
        big = torch.cat([x, x[:1]])
        torch.ops.mok.forward(big, torch.cat([idx, idx[:1]]), torch.cat([w, w[:1]]), *weights, workspace.handle)
    with pytest.raises(ValueError, match="intermediate: must be a multiple of 8, got 12"):
        mf.create_workspace(mf.LayerShape(H, 12, E, K), 64, device())
    with pytest.raises(ValueError, match="x: expected dtype BFloat16, got Float"):
        mf.forward(x.float(), idx, w, weights, workspace=workspace)
    # A fault found on the device (EP = 1 on each GPU): forward returns, check_errors reports it.
    whole = global_problem(14, tokens=64)
    bad = whole[1].clone()
    bad[5, 0] = 99
    mf.forward(whole[0], bad, whole[2], whole[3])
    with pytest.raises(RuntimeError, match=r"topk_idx: expert id 99 out of range \[-1, 8\) at rank 0 token 5 slot 0"):
        mf.check_errors(device=device())
    mf.reset_after_error(device=device())
    good = mf.forward(*whole)
    mf.check_errors(device=device())
    assert rel_l2(good, torch_layer(*whole)) < 1e-2
    torch.distributed.barrier()
