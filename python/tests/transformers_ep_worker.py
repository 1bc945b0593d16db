"""One rank of test_transformers_expert_parallel.py (started by torchrun, two ranks on gloo, CPU):
loads the tiny model in MODEL_DIR under transformers' expert parallelism (two ranks, each
holding half of every layer's experts; tokens reach them by ep_implementation), with the experts
implementation named, in DTYPE (bfloat16, or float64 for the oracle), runs two training steps and
writes what the test compares to
OUT_DIR/rank<r>.pt: the last loss, this rank's experts' gradients in the Hugging Face layout, and
its gate_up_proj from state_dict() before and after.

  torchrun --nproc-per-node 2 transformers_ep_worker.py MODEL_DIR OUT_DIR IMPLEMENTATION EP_IMPLEMENTATION DTYPE
"""
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed.configuration_utils import DistributedConfig

import mok.integrations.transformers as mt


def local(tensor):
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def experts_modules(model):
    return [(name, module) for name, module in model.named_modules() if mt.is_experts_module(module)]


def main(model_dir, out_dir, implementation, ep_implementation, dtype):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = DistributedConfig(ep_size=2, tp_size=2, tp_plan={}, ep_implementation=ep_implementation)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 experts_implementation=implementation, attn_implementation="eager",
                                                 distributed_config=config)
    before = {name: local(value) for name, value in model.state_dict().items() if name.endswith("gate_up_proj")}
    ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = model(ids, labels=ids).loss
        loss.backward()
    grads = {}
    for name, module in experts_modules(model):
        gate_up = local(module.gate_up_proj.grad)
        grads[f"{name}.gate_up_proj"] = mt.gate_up_to_hf(gate_up) if implementation == mt.NAME else gate_up
        grads[f"{name}.down_proj"] = local(module.down_proj.grad)
    after = {name: local(value) for name, value in model.state_dict().items() if name.endswith("gate_up_proj")}
    torch.save({"loss": loss.detach().float(), "grads": grads, "before": before, "after": after},
               f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:6])
