"""What happens once, before sharding: materialising meta modules, agreeing on the plan across
ranks, and preparing module buffers (dtype, rank 0's values)."""

from __future__ import annotations

import difflib
import warnings
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.engine.comm import Comm
from fsdp_bridge.plan import ParamLayout, Plan


def warn_unhonoured_offload(plan: Plan, device: torch.device) -> None:
    """CPU offload is implemented for flat parameters; fully_shard's DTensor parameters stay
    on an accelerator. Say so rather than pretend. (On a CPU device nothing moves anyway.)"""
    if plan.cpu_offload and device.type != "cpu" and plan.param_layout is ParamLayout.ROWS:
        warnings.warn(
            f"fsdp_bridge ({plan.frontend}): CPU offload is not implemented yet for "
            f"fully_shard's DTensor parameters; the master shards and their gradients stay "
            f"on {device}. Numerics are the same; memory on the device is not reduced. Drop "
            "the offload setting to silence this warning.",
            stacklevel=3)


def _has_meta_state(module: nn.Module) -> bool:
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return any(t.is_meta for t in tensors)


def materialize(
    module: nn.Module, device: torch.device, param_init_fn: Optional[Callable[[nn.Module], None]]
) -> None:
    """Give meta-device modules real storage, then move everything to `device`.

    With `param_init_fn`, it is called on each module that still has meta parameters or
    buffers, outermost first (FSDP1/YaFSDP semantics: it may initialise the whole subtree).
    Without it, each such module gets `to_empty` and its own `reset_parameters()`.
    """
    for submodule in module.modules():
        if not _has_meta_state(submodule):
            continue
        if param_init_fn is not None:
            param_init_fn(submodule)
        else:
            submodule.to_empty(device=device, recurse=False)
            reset = getattr(submodule, "reset_parameters", None)
            if callable(reset):
                reset()
    still_meta = [name for name, t in _named_states(module) if t.is_meta]
    if still_meta:
        raise ValueError(
            f"param_init_fn left {len(still_meta)} tensors on the meta device "
            f"(first: {still_meta[0]!r}). It is called once per module that has meta "
            "parameters or buffers and must give them storage, e.g. "
            "`lambda m: m.to_empty(device=device, recurse=False)` followed by your init."
        )
    # Only when something is elsewhere: `to()` swaps DTensor parameters for new objects, which
    # fails while torch.compile holds references to them.
    if any(t.device != device for _, t in _named_states(module)):
        module.to(device)


def _named_states(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def describe_rank(module: nn.Module, device: torch.device) -> str:
    """What else every rank must agree on: the device type (indices differ by rank) and each
    buffer's name, shape and dtype (rank 0's values are broadcast into them)."""
    lines = [f"device type: {device.type}"]
    lines.extend(f"buffer {name} {tuple(buffer.shape)} {buffer.dtype}"
                 for name, buffer in module.named_buffers())
    return "\n".join(lines)


def check_ranks_agree(plan: Plan, layout_text: str, comm: Comm, device: torch.device) -> None:
    """Fail with a readable diff, instead of hanging in a collective later, when ranks built
    different plans (different wrapping, dtypes, or parameter shapes)."""
    group = comm.world_group
    if group is None or dist.get_world_size(group) == 1:
        return
    description = plan.describe() + "\n" + layout_text
    # NCCL communicates device tensors only: the engine's device, not the current one (a
    # rank whose device_id is not the current device would talk through another GPU).
    on = device if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([plan.fingerprint(layout_text)], dtype=torch.int64, device=on)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    if all(int(g) == int(gathered[0]) for g in gathered):
        return
    descriptions: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(descriptions, description, group=group)
    first_other = next(i for i, g in enumerate(gathered) if int(g) != int(gathered[0]))
    diff = "\n".join(
        list(
            difflib.unified_diff(
                str(descriptions[0]).splitlines(),
                str(descriptions[first_other]).splitlines(),
                "rank 0",
                f"rank {first_other}",
                lineterm="",
            )
        )[:40]
    )
    raise ValueError(
        f"fsdp_bridge: ranks disagree on the sharding plan (plan built by {plan.frontend}): "
        f"rank 0 and rank {first_other} differ. Every rank must wrap the same modules of the "
        f"same model with the same settings; the difference:\n{diff}"
    )


def prepare_buffers(module: nn.Module, plan: Plan, comm: Comm) -> dict[str, torch.dtype]:
    """Broadcast rank 0's buffers (sync_module_states) and cast floating buffers to
    `buffer_dtype`. Returns each cast buffer's original dtype, for full state dicts."""
    original_dtypes = {}
    buffer_dtype = plan.mixed_precision.buffer_dtype
    for name, buffer in module.named_buffers():
        if plan.sync_module_states:
            comm.broadcast_from_first(buffer)
        if buffer_dtype is not None and buffer.is_floating_point() and buffer.dtype != buffer_dtype:
            original_dtypes[name] = buffer.dtype
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._buffers[attr] = buffer.to(buffer_dtype)
    return original_dtypes


def ignored_parameters(module: nn.Module, plan: Plan) -> list[nn.Parameter]:
    ignored = set(plan.ignored_params)
    return [p for name, p in module.named_parameters() if name in ignored]
