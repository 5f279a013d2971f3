"""Zeta's `fsdp(model, auto_wrap, mp, shard_strat, TransformerBlock)` -> Plan. Pure.

Zeta (zeta.training.fsdp) builds torch FSDP1 with a transformer wrap policy, one of three
precision presets and one of three strategy strings. We keep its semantics (bf16 / fp16 reduce
in low precision, as Zeta does) and fix its traps with clear errors: the real torch name
`SHARD_GRAD_OP` is accepted besides Zeta's `SHARD_GRAD`, and `auto_wrap=True` without a block
class is refused up front instead of crashing inside the policy.
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_bridge import policies
from fsdp_bridge.plan import MixedPrecision, Plan, ShardingMode, UnitSpec, UnsyncedGradSum
from fsdp_bridge.translation import (
    ArgumentTable,
    Shown,
    bad_argument,
    module_paths,
    register_table,
    translated,
)

FRONTEND = "zeta.fsdp"

TABLE = register_table(
    ArgumentTable(
        FRONTEND,
        (
            translated("model", "the model; the result is a wrapper with FSDP1's methods"),
            translated("auto_wrap", "True -> every TransformerBlock instance is a unit "
                       "(transformer_auto_wrap_policy), wrapped in the tree by a wrapper of "
                       "its own as torch's FSDP1 does (Zeta calls it); False -> the root is the "
                       "only unit"),
            translated("mp", "'fp32' -> no mixed precision; 'bf16' / 'fp16' -> param, reduce "
                       "and buffer dtype all bf16 / fp16 (Zeta reduces in low precision)"),
            translated("shard_strat", "'FULL_SHARD' -> ZeRO-3; 'SHARD_GRAD' or 'SHARD_GRAD_OP' "
                       "-> ZeRO-2; 'NO_SHARD' (default) -> replicate (DDP-like)"),
            translated("TransformerBlock", "the block class for auto_wrap (required with "
                       "auto_wrap=True)"),
            translated("(fixed) backward_prefetch=BACKWARD_PRE, forward_prefetch=True, "
                       "use_orig_params=True", "same numerics; the engine prefetches the next "
                       "unit in forward, and in backward at BACKWARD_POST's point on the CPU (the "
                       "lower peak memory), BACKWARD_PRE's on CUDA"),
        ),
    )
)

_MP = {
    "fp32": None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_STRATEGIES = {
    "FULL_SHARD": (ShardingMode.SHARD, True),
    "SHARD_GRAD": (ShardingMode.SHARD, False),
    "SHARD_GRAD_OP": (ShardingMode.SHARD, False),
    "NO_SHARD": (ShardingMode.REPLICATE, False),
}


def build_plan(model, auto_wrap=False, mp="fp32", shard_strat="NO_SHARD",
               TransformerBlock=None) -> Plan:
    if not isinstance(model, nn.Module):
        raise bad_argument(FRONTEND, "model", model, "an nn.Module", "Pass the model.",
                           exc=TypeError)
    if not isinstance(auto_wrap, bool):
        raise bad_argument(FRONTEND, "auto_wrap", auto_wrap, "True or False",
                           "Pass auto_wrap=True together with TransformerBlock=<class>.",
                           exc=TypeError)
    if not isinstance(mp, str) or mp not in _MP:
        raise bad_argument(FRONTEND, "mp", mp, "'bf16', 'fp16' or 'fp32'", "e.g. mp='bf16'.")
    if not isinstance(shard_strat, str) or shard_strat.upper() not in _STRATEGIES:
        raise bad_argument(FRONTEND, "shard_strat", shard_strat, "'FULL_SHARD', 'SHARD_GRAD' "
                           "(or torch's name 'SHARD_GRAD_OP') or 'NO_SHARD'",
                           "e.g. shard_strat='FULL_SHARD'.")
    mode, reshard = _STRATEGIES[shard_strat.upper()]
    units = []
    if auto_wrap:
        if not (isinstance(TransformerBlock, type) and issubclass(TransformerBlock, nn.Module)):
            raise bad_argument(FRONTEND, "TransformerBlock", TransformerBlock, "an nn.Module "
                               "subclass when auto_wrap=True", "Pass the block class, e.g. "
                               "fsdp(model, auto_wrap=True, TransformerBlock=MyBlock), or "
                               "auto_wrap=False.", exc=TypeError)
        paths = module_paths(model)
        blocks = policies.modules_of_classes(model, (TransformerBlock,))
        if not blocks:
            present = sorted({type(m).__name__ for m in model.modules()} - {type(model).__name__})
            raise bad_argument(FRONTEND, "TransformerBlock", Shown(TransformerBlock.__name__),
                               "a class with instances in the model (it has "
                               + ", ".join(present[:8]) + ")", "Pass the class of the model's "
                               "repeated layer; with none, only the root would be sharded "
                               "(pass auto_wrap=False for that).")
        units = [UnitSpec(paths[id(m)], reshard) for m in blocks]
    elif TransformerBlock is not None and not isinstance(TransformerBlock, type):
        raise bad_argument(FRONTEND, "TransformerBlock", TransformerBlock, "None or an "
                           "nn.Module subclass", "Pass the class itself.", exc=TypeError)
    dtype = _MP[mp]
    precision = (MixedPrecision(cast_root_forward_inputs=False) if dtype is None else
                 MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype))
    # Zeta wraps with torch's FSDP1: its reductions, no_sync sums and kept gradients follow
    # FSDP1's arithmetic.
    return Plan(units=tuple(units) + (UnitSpec("", reshard),), mode=mode,
                mixed_precision=precision, divide_around_reduce=True,
                unsynced_grad_sum=UnsyncedGradSum.COMPUTE_DTYPE, rereduce_kept_grad=True,
                frontend=FRONTEND)
