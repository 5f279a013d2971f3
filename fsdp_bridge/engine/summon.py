"""Full parameters of a sharded model outside the training step (FSDP1's
`summon_full_params`)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from fsdp_bridge.engine.flat_params import originals_registered
from fsdp_bridge.engine.runtime import ShardedModel

SUMMONED = "_fsdp_bridge_summoned"  # on each full parameter put in place here


@contextlib.contextmanager
def summon_full_params(
    sharded: ShardedModel,
    writeback: bool = True,
    rank0_only: bool = False,
    with_grads: bool = False,
    offload_to_cpu: bool = False,
    groups: Optional[list] = None,
):
    """Inside the context, every parameter (of `groups`, default all) is its full fp32 value
    (a plain `nn.Parameter`); with `writeback`, in-place changes are copied back into the
    shards on exit. With `rank0_only`, other ranks keep their shards; with `offload_to_cpu`,
    the full values (and gradients) live on the CPU. With flat parameters, the original
    parameters are registered meanwhile, as native FSDP1 does. A collective: every rank must
    enter."""
    with originals_registered(sharded):
        with _summoned(sharded, writeback, rank0_only, with_grads, offload_to_cpu,
                       sharded.flat_groups() if groups is None else groups):
            yield


@contextlib.contextmanager
def _summoned(sharded: ShardedModel, writeback: bool, rank0_only: bool, with_grads: bool,
              offload_to_cpu: bool, groups: list):
    on_this_rank = not rank0_only or sharded.comm.world_rank == 0
    swapped = []  # (owner, attr, local param)
    gathered = []  # (group, full flat)
    for group in groups:
        flat = group.gather_full_master()
        if offload_to_cpu and on_this_rank:
            flat = flat.cpu()  # written back from here on exit
        grads = None
        if with_grads and group.requires_grad and any(
            p.grad is not None for p in group.local_params
        ):
            local = torch.zeros_like(group.master)
            for index, param in enumerate(group.local_params):
                lo, hi = group.local_range(index)
                if param.grad is not None:
                    local[lo:hi] = param.grad
            grads = group.gather_full(local)
            if offload_to_cpu:
                grads = grads.cpu()
        gathered.append((group, flat))
        if not on_this_rank:
            continue
        grad_views = ([view for _, view in group.split(grads)] if grads is not None
                      else [None] * len(group.slots))
        for (slot, value), grad in zip(group.split(flat), grad_views):
            full = nn.Parameter(value, requires_grad=group.requires_grad)
            full.grad = grad
            setattr(full, SUMMONED, True)
            for owner, attr in slot.owners:
                swapped.append((owner, attr, owner._parameters[attr]))
                owner._parameters[attr] = full
    try:
        yield
    finally:
        for owner, attr, local in reversed(swapped):
            owner._parameters[attr] = local
        if writeback and not rank0_only:
            for group, flat in gathered:
                group.load_full_master(flat.to(group.master.device))
