"""Activation checkpointing and odd call orders through our front-ends, against native torch
(FSDP2) or the single-process reference on the global batch (FSDP1, YaFSDP), on spawned gloo
ranks (one world, many cases; see test_recompute.py)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests import models as M
from tests.frontends.parity_cases import _layer_cls, _model, dialect
from tests.native_torch import fsdp2_case
from tests.world import run_case_table

STEPS = 3
GLOBAL_BATCH = 8


def _batches():
    return M.global_batches(STEPS, GLOBAL_BATCH)


def _train(model, rank, world, steps=STEPS, loss_fn=M.lm_loss):
    optim = M.make_adamw(model.parameters())
    losses = []
    for step in range(steps):
        loss = loss_fn(model, M.rank_slice(_batches()[step], rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss.item()))
    return losses


def _hf_checkpointing(model, reentrant: bool):
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    return model


def fsdp2_hf(which, rank, world, reentrant, before):
    """HF gradient_checkpointing_enable() before or after fully_shard."""
    fsdp = dialect(which)
    model = _model("llama")
    if before:
        _hf_checkpointing(model, reentrant)
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    if not before:
        _hf_checkpointing(model, reentrant)
    return _train(model, rank, world)


def fsdp2_apply_before(which, rank, world):
    """apply_activation_checkpointing(LlamaDecoderLayer) before fully_shard (torchtitan's order)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    fsdp = dialect(which)
    model = _model("llama")
    layer_cls = _layer_cls("llama")
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_cls))
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return _train(model, rank, world)


def _fsdp1(model):
    from fsdp_bridge.fsdp import FullyShardedDataParallel
    from fsdp_bridge.fsdp.wrap import transformer_auto_wrap_policy

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={_layer_cls("llama")})
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                    device_id=torch.device("cpu"))


def fsdp1_hf(rank, world, reentrant):
    return _train(_fsdp1(_hf_checkpointing(_model("llama"), reentrant)), rank, world)


def fsdp1_apply_linear(rank, world):
    """apply_activation_checkpointing with a lambda check_fn on every Linear, after wrapping."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    model = _fsdp1(_model("llama"))
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    return _train(model, rank, world)


def yafsdp_hf(rank, world, reentrant):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fsdp_bridge.ya_fsdp import YaFSDP

    model = _hf_checkpointing(_model("llama"), reentrant)
    layers = [(layer, f"model.layers.{i}") for i, layer in enumerate(model.model.layers)]
    model = YaFSDP(model, zero_stage=3, modules_to_wrap_with_names=layers,
                   rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
                   layer_norm_module_cls=LlamaRMSNorm, gradient_accumulation_steps=1)
    return _train(model, rank, world)


def checkpoint_in_forward(which, rank, world):
    """torch.utils.checkpoint called by the model's own code around a fully_shard-ed layer."""
    fsdp = dialect(which)
    model = _model("llama")
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    layer = model.model.layers[1]
    original = layer.forward

    def checkpointed(*args, **kwargs):
        return checkpoint(original, *args, use_reentrant=False, **kwargs)

    layer.forward = checkpointed
    return _train(model, rank, world)


def two_forwards_one_backward(rank, world):
    """Two forwards (halves of the batch), then one backward of their sum: FSDP1, 3 layers."""
    model = _fsdp1(_model("llama"))

    def loss_fn(model, ids):
        first, second = ids.chunk(2)
        return (M.lm_loss(model, first) + M.lm_loss(model, second)) / 2

    return _train(model, rank, world, loss_fn=loss_fn)


def reference(rank, world, halves=False):
    model = _model("llama")
    optim = M.make_adamw(model.parameters())
    losses = []
    for batch in _batches():
        if halves:  # each rank's batch split in two, as two_forwards_one_backward does
            parts = [part for r in range(world) for part in M.rank_slice(batch, r, world).chunk(2)]
            loss = sum(M.lm_loss(model, part) for part in parts) / len(parts)
        else:
            loss = M.lm_loss(model, batch)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def peak_memory(rank, world):
    """Peak heap of one training step of our FSDP2 model, with and without HF activation
    checkpointing (glibc's bytes in use, sampled at every op, above the step's start)."""
    import gc

    from fsdp_bridge.bench import heap_in_use, step_probe

    fsdp = dialect("ours")
    ids = torch.randint(0, M.VOCAB, (8, 64), generator=torch.Generator().manual_seed(rank))
    out = {}
    for checkpointed in (False, True):
        model = _model("llama")
        if checkpointed:
            _hf_checkpointing(model, reentrant=False)
        for layer in model.model.layers:
            fsdp.fully_shard(layer)
        fsdp.fully_shard(model)
        M.lm_loss(model, ids).backward()  # warm-up: the runtime and gradients exist
        gc.collect()
        start = heap_in_use()
        with step_probe() as probe:
            M.lm_loss(model, ids).backward()
        out["checkpointed" if checkpointed else "plain"] = probe.peak_heap - start
        del model
    return out


def compiled(which, rank, world):
    """torch.compile of a fully_shard-ed model (dynamo through our hooks; aot_eager keeps the
    test fast: the engine's code is traced, not the kernels generated)."""
    fsdp = dialect(which)
    model = _model("llama")
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    return _train(torch.compile(model, backend="aot_eager"), rank, world)


def _both(fn, *args):
    @fsdp2_case
    def run(rank, world):
        out = {}
        for which in ("native", "ours"):
            torch.manual_seed(0)
            out[which] = fn(which, rank, world, *args)
            dist.barrier()
        return out
    return run


CASES = {
    **{f"fsdp2_hf_{'reentrant' if r else 'plain'}_{'before' if b else 'after'}":
       _both(fsdp2_hf, r, b) for r in (True, False) for b in (True, False)},
    "fsdp2_apply_before": _both(fsdp2_apply_before),
    "fsdp2_checkpoint_in_forward": _both(checkpoint_in_forward),
    "fsdp2_compiled": _both(compiled),
    "fsdp1_hf_reentrant": lambda rank, world: fsdp1_hf(rank, world, True),
    "fsdp1_hf_plain": lambda rank, world: fsdp1_hf(rank, world, False),
    "fsdp1_apply_linear": fsdp1_apply_linear,
    "yafsdp_hf_reentrant": lambda rank, world: yafsdp_hf(rank, world, True),
    "yafsdp_hf_plain": lambda rank, world: yafsdp_hf(rank, world, False),
    "two_forwards_one_backward": two_forwards_one_backward,
    "peak_memory": peak_memory,
    "reference": reference,
    "reference_halves": lambda rank, world: reference(rank, world, halves=True),
}


def run_cases(rank, world):
    return run_case_table(CASES)
