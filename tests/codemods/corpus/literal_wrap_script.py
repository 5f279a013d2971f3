"""A small training script with literal FSDP settings."""
import functools

import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from transformers.models.llama.modeling_llama import LlamaDecoderLayer


def main(model, loader, steps, accumulation):
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step, batch in enumerate(loader):
        if (step + 1) % accumulation:
            with model.no_sync():
                model(**batch).loss.backward()
            continue
        model(**batch).loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
