"""A realistic FSDP1 training script: tiny Llama, wrap policy, mixed precision, gradient
accumulation with no_sync, gradient clipping, and a full state dict saved at the end.

It is the input of `fsdp-bridge migrate --to fsdp2` in the tests and the demo script of the
equivalence harness. Run it on 2 CPU ranks:

    python -m torch.distributed.run --nproc_per_node 2 fsdp_bridge/examples/fsdp1_train_llama.py --steps 3

Prints one line per optimizer step: `step 1 loss 4.123456`.
"""

import argparse
import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp import (
    FullyShardedDataParallel as FSDP,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

MICRO_BATCHES = 2  # gradient accumulation: micro-batches per optimizer step
BATCH, SEQ = 4, 16  # per rank, per micro-batch


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default=None, help="directory for the final full state dict")
    return parser.parse_args()


def build_model():
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)  # same initial weights on every rank
    return LlamaForCausalLM(config)


def batches(rank, steps):
    """Each rank's micro-batches of one global batch per step (random tokens, fixed seed)."""
    generator = torch.Generator().manual_seed(1234)
    world = dist.get_world_size()
    for _ in range(steps):
        micro = []
        for _ in range(MICRO_BATCHES):
            tokens = torch.randint(0, 128, (BATCH * world, SEQ), generator=generator)
            micro.append(tokens[rank * BATCH : (rank + 1) * BATCH])
        yield micro


def main():
    args = parse_args()
    if "RANK" not in os.environ:  # started with python, not by a launcher: say how to run it
        sys.exit(f"{os.path.basename(__file__)}: run it under torchrun, one process per rank, "
                 f"e.g. torchrun --nproc_per_node 2 {__file__}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    model = build_model()
    model = FSDP(
        model,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer}
        ),
        mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),  # FSDP1 needs this on a CPU-only build
        use_orig_params=True,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    for step, micro in enumerate(batches(rank, args.steps), start=1):
        total = torch.zeros(())
        for index, tokens in enumerate(micro):
            last = index == len(micro) - 1
            if not last:
                with model.no_sync():  # accumulate locally, reduce on the last micro-batch
                    loss = model(input_ids=tokens, labels=tokens).loss / len(micro)
                    loss.backward()
            else:
                loss = model(input_ids=tokens, labels=tokens).loss / len(micro)
                loss.backward()
            total += loss.detach()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step} loss {total.item() / dist.get_world_size():.6f}", flush=True)

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        state = model.state_dict()
    if rank == 0 and args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(state, os.path.join(args.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
