"""What the dialect examples of this folder share, so that each shows only the lines of its
dialect: a tiny Llama (random weights, the same on every rank; nothing is downloaded), random
token batches (each rank trains on its slice of one global batch), and the loop that trains it
with AdamW and prints `step N loss X` (the mean over the global batch) on rank 0.

`run(shard, script)` is an example's whole program: under torchrun, it starts the process group
(gloo: CPU ranks), builds the model, hands it to `shard` (the dialect's lines), trains it and
ends the process group. Started with plain `python`, it says in one line how to run it.
"""

import os
import sys

import torch
import torch.distributed as dist

VOCAB, SEQ, BATCH, STEPS = 128, 16, 8, 4  # BATCH: the global batch, split over the ranks


def run(shard, script: str) -> None:
    if "RANK" not in os.environ:
        sys.exit(f"{os.path.basename(script)}: run it under torchrun, one process per rank, "
                 f"e.g. torchrun --standalone --nproc_per_node 2 {script}")
    dist.init_process_group("gloo")
    try:
        train(shard(tiny_llama()))
    finally:
        dist.destroy_process_group()


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # every rank starts from the same weights
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64))


def global_batches(steps: int = STEPS) -> torch.Tensor:
    """Token ids of shape (steps, BATCH, SEQ), the same on every rank."""
    return torch.randint(0, VOCAB, (steps, BATCH, SEQ),
                         generator=torch.Generator().manual_seed(1234))


def train(model, steps: int = STEPS) -> list:
    """`steps` AdamW steps, each rank on its slice of the global batch; the global losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step, batch in enumerate(global_batches(steps), start=1):
        ids = batch.chunk(world)[rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    return losses
