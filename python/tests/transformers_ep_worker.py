"""One rank of test_transformers_expert_parallel.py (started by torchrun, two ranks on gloo, CPU):
loads the tiny model in MODEL_DIR sharded by transformers itself, PARALLEL being "ep:all_to_all"
or "ep:all_reduce" (expert parallelism: each rank holds half of every layer's experts, the ranks
share one batch; the name after "ep:" is how tokens reach the experts) or "fsdp" (FSDP over the two
ranks, a batch each), with the experts implementation named, in DTYPE (bfloat16, or float64 for
the oracle); ATTACH "attach" converts the model with mok.integrations.transformers.attach after
loading. Runs three training steps and writes what the test compares to OUT_DIR/rank<r>.pt: the
losses, this rank's expert gradients (local shards) in the Hugging Face layout, its gate_up_proj
shards from state_dict() before and after; or the UnsupportedExperts message mok raised.

  torchrun --nproc-per-node 2 transformers_ep_worker.py MODEL_DIR OUT_DIR IMPLEMENTATION PARALLEL DTYPE [ATTACH]
"""
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed.configuration_utils import DistributedConfig

import mok.integrations.transformers as mt


def local(tensor):
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def gate_up_shards(model):
    return {name: local(value) for name, value in model.state_dict().items() if name.endswith("gate_up_proj")}


def main(model_dir, out_dir, implementation, parallel, dtype, attach=""):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if parallel == "fsdp":
        config = DistributedConfig(fsdp_size=2)
    else:
        config = DistributedConfig(ep_size=2, tp_size=2, tp_plan={}, ep_implementation=parallel.split(":")[1])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 experts_implementation=implementation, attn_implementation="eager",
                                                 distributed_config=config)
    if attach == "attach":
        mt.attach(model)
    before = gate_up_shards(model)
    seed = 1 + rank if parallel == "fsdp" else 1  # FSDP's ranks hold a batch each
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    losses = []
    try:
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            loss = model(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach().double())
    except mt.UnsupportedExperts as error:
        torch.save({"error": str(error)}, f"{out_dir}/rank{rank}.pt")
        dist.destroy_process_group()
        return
    grads = {}
    for name, module in mt._experts_modules(model):
        gate_up = local(mt.gate_up_proj_hf(module, grad=True))
        grads[f"{name}.gate_up_proj"] = gate_up
        grads[f"{name}.down_proj"] = local(module.down_proj.grad)
    torch.save({"losses": torch.stack(losses), "grads": grads, "before": before, "after": gate_up_shards(model)},
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
