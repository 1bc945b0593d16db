"""mok under transformers' own expert parallelism (transformers.distributed: two ranks on gloo, on
the CPU), where each rank's experts module holds half of every layer's experts and transformers
brings them their tokens: by all-to-all (routes as local ids), or, for ranks that share a batch,
by all-reduce (routes to the other rank's experts marked as id E_l, weight 0). A tiny Qwen3-MoE
model trained two steps with "mok" and with "grouped_mm" on the same ranks, each rank's expert
gradients against an fp64 run of the model ("eager" experts) under the same parallelism: mok's
error no larger than grouped_mm's (as the single-process tests hold it, up to the factor that
whole models allow); a rerun bitwise the same; checkpoints in the Hugging Face layout before and
after training."""

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

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "transformers_ep_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
        num_hidden_layers=2, num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3-moe")
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return str(path)


def run_ranks(model_dir, out_dir, implementation, ep_implementation, dtype="bfloat16"):
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", WORKER,
               model_dir, str(out_dir), implementation, ep_implementation, dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return [torch.load(f"{out_dir}/rank{rank}.pt") for rank in range(2)]


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Whole models in bf16: the attention, norms and routers every implementation shares move the
# error by some percent either way (test_transformers_experts.py's MODEL_ERROR_FACTOR).
MODEL_ERROR_FACTOR = 1.25


def expert_grads(rank_result):
    grads = rank_result["grads"]
    return torch.cat([grads[name].double().flatten() for name in sorted(grads)])


@pytest.mark.parametrize("ep_implementation", ["all_to_all", "all_reduce"])
def test_mok_trains_under_transformers_expert_parallelism(model_dir, tmp_path, ep_implementation):
    oracle = run_ranks(model_dir, tmp_path / "fp64", "eager", ep_implementation, "float64")
    mine = run_ranks(model_dir, tmp_path / "mok", mt.NAME, ep_implementation)
    theirs = run_ranks(model_dir, tmp_path / "grouped_mm", "grouped_mm", ep_implementation)
    again = run_ranks(model_dir, tmp_path / "mok-again", mt.NAME, ep_implementation)
    for rank in range(2):
        assert mine[rank]["grads"].keys() == oracle[rank]["grads"].keys() and mine[rank]["grads"]
        reference = expert_grads(oracle[rank])
        mine_error = rel_l2(expert_grads(mine[rank]), reference)
        their_error = rel_l2(expert_grads(theirs[rank]), reference)
        assert 0 < mine_error <= MODEL_ERROR_FACTOR * their_error, f"rank {rank}: mok {mine_error:.3e}, " \
            f"grouped_mm {their_error:.3e}"
        assert abs(mine[rank]["loss"] - oracle[rank]["loss"]) <= 1e-3 * abs(oracle[rank]["loss"])
        for name, grad in mine[rank]["grads"].items():
            assert torch.equal(grad, again[rank]["grads"][name]), f"rank {rank} {name}: rerun"
        # state_dict() gives the Hugging Face layout though the parameters hold mok's.
        for name, weight in theirs[rank]["before"].items():
            assert torch.equal(mine[rank]["before"][name], weight), name
            assert torch.equal(mine[rank]["after"][name], weight), name
