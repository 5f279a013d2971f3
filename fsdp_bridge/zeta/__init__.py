"""Drop-in for Zeta's FSDP helper: `from fsdp_bridge.zeta import fsdp` (for `zeta.training`)."""

from __future__ import annotations

from torch import nn

from fsdp_bridge.mixed_dialects import refuse_other_dialects
from fsdp_bridge.wrapper import ShardedWrapper, shard_flat
from fsdp_bridge.zeta._translate import FRONTEND, build_plan

__all__ = ["fsdp"]


class ZetaFSDP(ShardedWrapper):
    """What `fsdp()` returns: the model wrapped, with FSDP1's methods (no_sync,
    clip_grad_norm_, state_dict_type, summon_full_params, ...)."""

    _frontend = FRONTEND
    # Zeta's fsdp() calls torch's FSDP1 with its auto-wrap policy: a wrapper per unit.
    _wrapper_per_unit = True

    def __init__(self, model: nn.Module, plan):
        super().__init__()
        sharded = shard_flat(model, plan)
        self._attach(model, sharded, {})


def fsdp(model: nn.Module, auto_wrap: bool = False, mp: str = "fp32",
         shard_strat: str = "NO_SHARD", TransformerBlock=None) -> ZetaFSDP:
    """Zeta's `fsdp()`: wrap `model` for sharded data-parallel training (see the table in
    `fsdp_bridge.zeta._translate`)."""
    refuse_other_dialects(FRONTEND, model)
    plan = build_plan(model, auto_wrap=auto_wrap, mp=mp, shard_strat=shard_strat,
                      TransformerBlock=TransformerBlock)
    return ZetaFSDP(model, plan)
