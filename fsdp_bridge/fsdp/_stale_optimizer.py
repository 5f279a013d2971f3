"""Refuse an optimizer built before `fully_shard` (FSDP2).

[Note: optimizers built before fully_shard]
`fully_shard` replaces each parameter it manages by a new DTensor parameter (as FSDP2 does; a
plain tensor cannot become a DTensor in place). An optimizer built before the call holds the
old objects, which no backward reaches any more: native FSDP2 then trains nothing, silently.
FSDP1-style front-ends keep the user's Parameter objects live instead (see FlatGroup), so
there the order does not matter. Here a global optimizer step pre-hook (torch's public
`register_optimizer_step_pre_hook`) refuses the first step of such an optimizer, naming the
parameter and the fix. Each optimizer is checked once per set of parameters it holds.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_bridge.fsdp import _fsdp2_translate as T

REPLACED_NAME = "_fsdp_bridge_replaced_name"  # on an original parameter: its name then
_CHECKED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
_HOOK: list = []


def mark_replaced(param: torch.nn.Parameter, name: str) -> None:
    """Record that `fully_shard` replaced `param` (then called `name`); installs the check."""
    setattr(param, REPLACED_NAME, name)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_replaced_params))


def _refuse_replaced_params(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    params = tuple(id(p) for group in optimizer.param_groups for p in group["params"])
    if _CHECKED.get(optimizer) == params:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = getattr(param, REPLACED_NAME, None)
            if name is not None:
                raise T.bad(
                    f"{type(optimizer).__name__}'s parameter {name!r}",
                    f"the plain tensor of shape {tuple(param.shape)} that fully_shard replaced "
                    "by a DTensor parameter", "the module's current parameters",
                    "This optimizer was built before fully_shard: stepping it would train "
                    "nothing (native FSDP2 silently does). Build the optimizer after the "
                    "fully_shard calls, e.g. AdamW(model.parameters()).", exc=RuntimeError)
    _CHECKED[optimizer] = params
