"""Fine-tunes a small Hugging Face transformers MoE model with experts_implementation="mok": every
MoE layer's routed experts run on mok, forward and backward, while routing, shared experts,
attention and the rest stay transformers' own code. The model is a random init from a small
config of the chosen family, the data synthetic (arithmetic sequences modulo the vocabulary, a
task a small model learns in a few dozen steps); it prints loss and tokens/s as it goes.

    python examples/finetune_transformers_moe.py                      # qwen3_moe on the CPU
    python examples/finetune_transformers_moe.py --family deepseek_v3 --device cuda --steps 300
    python examples/finetune_transformers_moe.py --experts-implementation grouped_mm   # transformers' own

What runs where: --device cpu runs mok's CPU backend, --device cuda mok's GPU layer. The weights
are bf16 (mok computes in bf16 and takes bf16 weights without a copy); gate_up_proj is permuted
once, in place, into mok's layout at the first step, and --save writes a checkpoint in the usual
Hugging Face layout (mok.integrations.transformers' docstring says how).
"""

import argparse
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

import mok
import mok.integrations.transformers as mok_transformers

# Small configs, one per family: the attribute names differ from family to family.
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", lambda hidden, experts, top_k: dict(
        head_dim=32, intermediate_size=4 * hidden, moe_intermediate_size=hidden, num_experts=experts,
        num_experts_per_tok=top_k, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", lambda hidden, experts, top_k: dict(
        head_dim=32, intermediate_size=hidden, num_local_experts=experts, num_experts_per_tok=top_k)),
    "deepseek_v3": ("DeepseekV3Config", lambda hidden, experts, top_k: dict(
        intermediate_size=4 * hidden, moe_intermediate_size=hidden, n_routed_experts=experts,
        num_experts_per_tok=top_k, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
        kv_lora_rank=32, q_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)),
}


def make_config(args):
    name, family_kwargs = FAMILIES[args.family]
    heads = max(1, args.hidden // 32)
    return getattr(transformers, name)(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=heads, max_position_embeddings=args.seq, tie_word_embeddings=False,
        **family_kwargs(args.hidden, args.experts, args.top_k))


def synthetic_batch(batch, seq, vocab, generator, device):
    """Token sequences start, start + stride, start + 2 stride, ... modulo the vocabulary."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 16, (batch, 1), generator=generator)
    return ((start + stride * torch.arange(seq)) % vocab).to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="qwen3_moe",
                        help="model family (default %(default)s)")
    parser.add_argument("--experts-implementation", default=mok_transformers.NAME,
                        help="'mok' (default), or transformers' own 'grouped_mm', 'batched_mm', 'eager' to compare")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps (default %(default)s)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default %(default)s)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default %(default)s)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden size H (default %(default)s)")
    parser.add_argument("--layers", type=int, default=3, help="decoder layers (default %(default)s)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts (default %(default)s)")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token (default %(default)s)")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (default %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW learning rate (default %(default)s)")
    parser.add_argument("--log-every", type=int, default=10,
                        help="steps between progress lines (default %(default)s)")
    parser.add_argument("--save", metavar="DIR", help="save_pretrained the fine-tuned model here (HF layout)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(args), dtype=torch.bfloat16,
                                             experts_implementation=args.experts_implementation).to(device)
    experts = [module for module in model.modules() if mok_transformers.is_experts_module(module)]
    parameters = sum(parameter.numel() for parameter in model.parameters())
    print(f"{type(model).__name__}: {args.layers} layers, H {args.hidden}, {len(experts)} MoE layers of "
          f"{args.experts} experts (top-{args.top_k}), {parameters / 1e6:.1f} M parameters, bf16, on {device}; "
          f"experts_implementation={model.config._experts_implementation!r}", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    tokens_per_step = args.batch * args.seq
    first_loss = None
    window_start, window_tokens = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        ids = synthetic_batch(args.batch, args.seq, args.vocab, generator, device)
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        window_tokens += tokens_per_step
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            value = loss.item()  # synchronises
            first_loss = value if first_loss is None else first_loss
            elapsed = time.perf_counter() - window_start
            print(f"step {step:4d}/{args.steps}  loss {value:.4f}  {window_tokens / elapsed:,.0f} tokens/s",
                  flush=True)
            window_start, window_tokens = time.perf_counter(), 0

    model.eval()
    with torch.no_grad():
        ids = synthetic_batch(args.batch, args.seq, args.vocab, torch.Generator().manual_seed(2), device)
        predicted = model(ids).logits[:, 1:-1].argmax(-1)  # from two tokens on, the stride is known
        accuracy = (predicted == ids[:, 2:]).float().mean().item()
    print(f"loss {first_loss:.4f} -> {value:.4f}; next-token accuracy on fresh sequences {accuracy:.1%}")
    if device.type == "cuda" and args.experts_implementation == mok_transformers.NAME:
        mok.functional.check_errors(device=device)  # raises if a mok call recorded a device fault
    if args.save:
        model.save_pretrained(args.save)
        print(f"saved to {args.save} (gate_up_proj in the Hugging Face layout)")


if __name__ == "__main__":
    main()
