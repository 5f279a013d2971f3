"""Evaluation code that reaches into FSDP1's full parameters and internals."""
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def export_weights(model):
    model = FSDP(model)
    with FSDP.summon_full_params(model, writeback=False):
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    inner = model._fsdp_wrapped_module
    return weights, inner


def generate(model, tokens):
    with torch.no_grad():
        return model(tokens)
