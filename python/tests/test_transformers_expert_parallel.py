"""mok in models that transformers itself shards over ranks (transformers.distributed, two ranks on
gloo, on the CPU). Expert parallelism: each rank's experts module holds half of every layer's
experts and transformers brings them their tokens, by all-to-all (routes as local ids) or, for
ranks that share a batch, by all-reduce (routes to the other rank's experts marked as id E_l,
weight 0). FSDP: the weights are gathered into each layer for its forward, so mok's one-time
layout conversion has to happen on the stored shards (attach); at the first call instead it
refuses, naming the remedy. A tiny Qwen3-MoE model trained three steps with "mok" and with
"grouped_mm" on the same ranks, each rank's expert gradients against an fp64 run ("eager" experts)
under the same sharding: mok's error no larger than grouped_mm's (up to the factor whole models
allow, as in test_transformers_experts.py); the same loss every step (the weights do not change);
a rerun bitwise the same; checkpoints in the Hugging Face layout before and after."""

import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
mt = pytest.importorskip("mok.integrations.transformers")
pytest.importorskip("accelerate", reason="transformers loads a distributed model through accelerate")
try:
    from transformers.distributed.configuration_utils import DistributedConfig
except ImportError:
    DistributedConfig = None
if DistributedConfig is None or "ep_implementation" not in getattr(DistributedConfig, "__dataclass_fields__", {}):
    pytest.skip(f"transformers {transformers.__version__} has no expert-parallel DistributedConfig",
                allow_module_level=True)
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

# The tiny Qwen3-MoE config, the error measure and the whole-model factor of the single-process tests.
from test_transformers_experts import MODEL_ERROR_FACTOR, rel_l2, tiny_config  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformers_ep_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = tiny_config("qwen3_moe")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3-moe")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return str(path)


def run_ranks(model_dir, out_dir, implementation, parallel, dtype="bfloat16", attach=""):
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
               model_dir, str(out_dir), implementation, parallel, dtype, attach]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [torch.load(f"{out_dir}/rank{rank}.pt") for rank in range(2)]


def expert_grads(rank_result):
    grads = rank_result["grads"]
    return torch.cat([grads[name].double().flatten() for name in sorted(grads)])


@pytest.mark.parametrize("parallel", ["ep:all_to_all", "ep:all_reduce", "fsdp"])
def test_mok_trains_in_models_transformers_shards(model_dir, tmp_path, parallel):
    # Under FSDP mok's layout must be converted on the stored shards: attach after sharding.
    attach = "attach" if parallel == "fsdp" else ""
    oracle = run_ranks(model_dir, tmp_path / "fp64", "eager", parallel, "float64")
    mine = run_ranks(model_dir, tmp_path / "mok", mt.NAME, parallel, attach=attach)
    theirs = run_ranks(model_dir, tmp_path / "grouped_mm", "grouped_mm", parallel)
    again = run_ranks(model_dir, tmp_path / "mok-again", mt.NAME, parallel, attach=attach)
    for rank in range(2):
        assert mine[rank]["grads"].keys() == oracle[rank]["grads"].keys() and mine[rank]["grads"]
        reference = expert_grads(oracle[rank])
        mine_error = rel_l2(expert_grads(mine[rank]), reference)
        their_error = rel_l2(expert_grads(theirs[rank]), reference)
        assert 0 < mine_error <= MODEL_ERROR_FACTOR * their_error, f"rank {rank}: mok {mine_error:.3e}, " \
            f"grouped_mm {their_error:.3e}"
        losses, oracle_losses = mine[rank]["losses"], oracle[rank]["losses"]
        assert torch.all(losses == losses[0]), f"rank {rank}: the loss moved with unchanged weights: {losses}"
        assert abs(losses[0] - oracle_losses[0]) <= 1e-3 * abs(oracle_losses[0])
        for name, grad in mine[rank]["grads"].items():
            assert torch.equal(grad, again[rank]["grads"][name]), f"rank {rank} {name}: rerun"
        # state_dict() gives the Hugging Face layout though the parameters hold mok's.
        for name, weight in theirs[rank]["before"].items():
            assert torch.equal(mine[rank]["before"][name], weight), name
            assert torch.equal(mine[rank]["after"][name], weight), name


def test_fsdp_without_attach_is_refused_naming_the_remedy(model_dir, tmp_path):
    """The first call's conversion would rewrite the copy FSDP gathered for that forward, and the
    next gather would bring the old layout back: mok refuses, naming attach."""
    for rank in run_ranks(model_dir, tmp_path / "mok", mt.NAME, "fsdp"):
        assert "FSDP" in rank["error"] and "attach(model)" in rank["error"], rank["error"]
