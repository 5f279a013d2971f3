"""Rank-side cases of test_accelerate.py: the same accelerate training script run with stock
`accelerate.Accelerator` (native FSDP2) and with `fsdp_bridge.integrations.accelerate.Accelerator`
(our engine), on the CPU through the test-only FSDP switch (accelerate_cpu.py).

Each case returns {"native": ..., "ours": ...} with what a user sees: per-step losses and
clipped gradient norms, the final full state dict, and the losses after resuming from a
checkpoint written by `save_state` (ours from ours, ours from native)."""

from __future__ import annotations

import os

import torch
from torch import nn

from tests import models as M
from tests.integrations.accelerate_cpu import accelerator_on_cpu_fsdp
from tests.integrations.common import engine_of, full_state
from tests.world import run_case_table

STEPS = 4
RESUME_AT = 2
GLOBAL_BATCH = 8
WHICH = ("native", "ours")


def accelerator_class(which):
    if which == "native":
        from accelerate import Accelerator
        return Accelerator
    from fsdp_bridge.integrations.accelerate import Accelerator
    return Accelerator


def plugin(**settings):
    from accelerate import FullyShardedDataParallelPlugin

    llama = {"auto_wrap_policy": "transformer_based_wrap",
             "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"]}
    return FullyShardedDataParallelPlugin(fsdp_version=2, **{**llama, **settings})


def prepared(which, mixed_precision, settings, model=None):
    accelerator = accelerator_on_cpu_fsdp(accelerator_class(which), plugin(**settings),
                                          mixed_precision)
    model = M.tiny_llama() if model is None else model
    optimizer = M.make_adamw(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train(accelerator, model, optimizer, steps, rank, world):
    """(losses, clipped grad norms) of `steps`, each the global batch's."""
    batches = M.global_batches(STEPS, GLOBAL_BATCH)
    losses, norms = [], []
    for step in steps:
        ids = M.rank_slice(batches[step], rank, world)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(M.global_mean(loss.item()))
    return losses, norms


def run_and_resume(rank, world, folder, mixed_precision, **settings):
    """Per dialect: STEPS steps (a checkpoint saved after RESUME_AT), the final state; then a
    fresh model resumed from its own checkpoint and ours resumed from native's."""
    out = {}
    for which in WHICH:
        accelerator, model, optimizer = prepared(which, mixed_precision, settings)
        losses, norms = train(accelerator, model, optimizer, range(RESUME_AT), rank, world)
        accelerator.save_state(os.path.join(folder, which))
        more, more_norms = train(accelerator, model, optimizer, range(RESUME_AT, STEPS), rank,
                                 world)
        out[which] = {"losses": losses + more, "norms": norms + more_norms,
                      "state": full_state(model), "engine": engine_of(model)}
    for which, source in (("native", "native"), ("ours", "ours"), ("ours_from_native", "native")):
        dialect = "ours" if which.startswith("ours") else "native"
        accelerator, model, optimizer = prepared(dialect, mixed_precision, settings,
                                                 model=M.tiny_llama(seed=1))
        accelerator.load_state(os.path.join(folder, source))
        resumed, _ = train(accelerator, model, optimizer, range(RESUME_AT, STEPS), rank, world)
        out.setdefault(which, {})["resumed"] = resumed
    return out


def fp32_sharded_checkpoint(rank, world, folder):
    return run_and_resume(rank, world, os.path.join(folder, "fp32"), "no",
                          state_dict_type="SHARDED_STATE_DICT")


def bf16_full_checkpoint(rank, world, folder):
    return run_and_resume(rank, world, os.path.join(folder, "bf16"), "bf16",
                          state_dict_type="FULL_STATE_DICT")


def activation_checkpointing(rank, world, folder):
    out = {}
    for which in WHICH:
        accelerator, model, optimizer = prepared(which, "no", {"activation_checkpointing": True})
        losses, norms = train(accelerator, model, optimizer, range(2), rank, world)
        out[which] = {"losses": losses, "norms": norms, "state": full_state(model),
                      "layer": type(model.model.layers[0]).__name__}
    return out


def reshard_false_ignored_module(rank, world, folder):
    """reshard_after_forward=False, and the final norm left out of sharding (ignored_modules as
    a pattern of module names): it trains on each rank's data alone, natively too."""
    out = {}
    for which in WHICH:
        accelerator, model, optimizer = prepared(which, "no", {"reshard_after_forward": False,
                                                               "ignored_modules": "model.norm"})
        losses, norms = train(accelerator, model, optimizer, range(2), rank, world)
        out[which] = {"losses": losses, "norms": norms,
                      "norm_weight": model.model.norm.weight.detach().clone(),
                      "norm_is_plain": not hasattr(model.model.norm.weight, "device_mesh")}
    return out


class TwoRows(nn.Module):
    """Two parameters of one row each: on rank 1 of 2 both local shards are empty."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _two_rows_steps(model, optimizer, step_fn, rank, world):
    generator = torch.Generator().manual_seed(3)
    data = torch.randn(3, 4 * world, 8, generator=generator)
    losses = []
    for batch in data:
        loss = model(M.rank_slice(batch, rank, world)).square().mean()
        step_fn(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(M.global_mean(loss.item()))
    return losses


def empty_shards(rank, world, folder):
    """Ours through accelerate against native fully_shard with a plain loop (no accelerate)."""
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(TwoRows())
    optimizer = M.make_adamw(model.parameters())
    native = {"losses": _two_rows_steps(model, optimizer, lambda loss: loss.backward(), rank, world),
              "state": full_state(model)}
    accelerator = accelerator_on_cpu_fsdp(accelerator_class("ours"),
                                          plugin(auto_wrap_policy="no_wrap"), "no")
    model = TwoRows()
    optimizer = M.make_adamw(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    held = [id(p) for group in optimizer.param_groups for p in group["params"]]
    ours = {"held_once_each": held == [id(p) for p in model.parameters()],
            "losses": _two_rows_steps(model, optimizer, accelerator.backward, rank, world),
            "state": full_state(model)}
    return {"native": native, "ours": ours}


def refusals(rank, world, folder):
    """Settings the adapter cannot honour are refused by name."""
    messages = {}
    for name, settings in (("cpu_ram_efficient_loading", {"cpu_ram_efficient_loading": True}),):
        try:
            prepared("ours", "no", settings)
            messages[name] = None
        except ValueError as error:
            messages[name] = str(error)
    try:
        # (an FSDP1 plugin cannot be built without an accelerator: the version set afterwards)
        accelerator = accelerator_on_cpu_fsdp(accelerator_class("ours"), plugin(), "no")
        accelerator.state.fsdp_plugin.fsdp_version = 1
        model = M.tiny_llama()
        accelerator.prepare(model, M.make_adamw(model.parameters()))
        messages["fsdp_version"] = None
    except ValueError as error:
        messages["fsdp_version"] = str(error)
    return messages


CASES = {
    "fp32_sharded_checkpoint": fp32_sharded_checkpoint,
    "bf16_full_checkpoint": bf16_full_checkpoint,
    "activation_checkpointing": activation_checkpointing,
    "reshard_false_ignored_module": reshard_false_ignored_module,
    "empty_shards": empty_shards,
    "refusals": refusals,
}


def run_cases(rank, world, names, folder):
    table = {name: (lambda fn: lambda r, w: fn(r, w, folder))(CASES[name]) for name in names}
    return run_case_table(table)
