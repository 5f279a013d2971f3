"""The YaFSDP example of the FSDP -> YaFSDP migration guide, on a tiny Llama, with only the
import changed (`from ya_fsdp import YaFSDP` -> `from fsdp_bridge.ya_fsdp import YaFSDP`).

Two typos of the guide's snippet are fixed, nothing else: the rogue norm of a
`LlamaForCausalLM` is `model.model.norm` (the guide writes `model.norm`), and a comma was
missing after that argument; and started without torchrun, it says how to run it
instead of failing on a missing RANK. Run it on 2 CPU ranks:

    python -m torch.distributed.run --nproc_per_node 2 fsdp_bridge/examples/yafsdp_llama.py --steps 5

Every rank trains on its slice of one global batch; rank 0 prints `step N loss X` (the mean
loss over the global batch) after each optimizer step.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fsdp_bridge.ya_fsdp import YaFSDP

GLOBAL_BATCH, SEQ, VOCAB = 8, 32, 256


def build_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batches(steps: int) -> torch.Tensor:
    """Token ids (steps, GLOBAL_BATCH, SEQ), the same on every rank: a learnable pattern
    (each sequence counts up from a random start) so the loss visibly falls."""
    generator = torch.Generator().manual_seed(1234)
    starts = torch.randint(0, VOCAB, (steps, GLOBAL_BATCH, 1), generator=generator)
    return (starts + torch.arange(SEQ)) % VOCAB


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-5, weight_decay=0.01)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--sharding-strategy", default="ShardingStrategy.FULL_SHARD")
    parser.add_argument("--bf16", action="store_true", help="gather and compute in bfloat16")
    return parser.parse_args()


def main():
    args = parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # started with python, not by a launcher: say how to run it
        sys.exit(f"{os.path.basename(__file__)}: run it under torchrun, one process per rank, "
                 f"e.g. torchrun --nproc_per_node 2 {__file__}")
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)

    model: LlamaForCausalLM = build_model()
    sharding_strategy = args.sharding_strategy
    param_dtype = torch.bfloat16 if args.bf16 else torch.float32
    sync_module_states, param_init_fn = False, None
    gradient_accumulation_steps = 1

    # --- the guide's snippet -------------------------------------------------------------
    model = YaFSDP(
        model,
        zero_stage={
            "ShardingStrategy.FULL_SHARD": 3,
            "ShardingStrategy.SHARD_GRAD_OP": 2
        }[sharding_strategy],
        modules_to_wrap_with_names=[
            (model.model.embed_tokens, "model.embed_tokens"),
            *((m, f"model.layers.{i}") for i, m in enumerate(model.model.layers)),
            (model.lm_head, "lm_head")
        ],
        rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
        layer_norm_module_cls=LlamaRMSNorm,
        param_dtype=param_dtype,
        sync_module_states=sync_module_states,
        param_init_fn=param_init_fn,
        device_id=device,
        gradient_accumulation_steps=gradient_accumulation_steps,
    )
    # ---------------------------------------------------------------------------------------

    optimizer = make_optimizer(model.parameters())
    per_rank = GLOBAL_BATCH // world
    for step, batch in enumerate(batches(args.steps), start=1):
        ids = batch[rank * per_rank : (rank + 1) * per_rank].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step} loss {mean.item() / world:.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
