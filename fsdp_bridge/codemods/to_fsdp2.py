"""`--to fsdp2`: rewrite FSDP1 (`FullyShardedDataParallel`) code into native torch FSDP2.

    python -m libcst.tool codemod to_fsdp2.ToFsdp2Command PATH

The walk and the rules shared with `--to yafsdp` (first pass, diagnostics, type checks,
`.module`) come from `Fsdp1Codemod`; this command adds the FSDP2 translations of the
constructor (`fully_shard.py`), of the wrapper's methods (`wrapper_methods.py`) and of state
dicts and static methods (`state_dict.py`). The rule codes it reports are listed, with what
each means, in `rules.py`.
"""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.codemods import rules
from fsdp_bridge.codemods.fsdp1_codemod import Fsdp1Codemod
from fsdp_bridge.codemods.fully_shard import FullyShardRules
from fsdp_bridge.codemods.names import FSDP
from fsdp_bridge.codemods.state_dict import StateDictRules
from fsdp_bridge.codemods.wrapper_methods import WrapperMethodRules


class ToFsdp2Command(FullyShardRules, WrapperMethodRules, StateDictRules, Fsdp1Codemod):
    DESCRIPTION = "Rewrite FSDP1 (FullyShardedDataParallel) code into native torch FSDP2 (fully_shard)."
    WRAPPED_CLASS = (FSDP, "FSDPModule", rules.FSDP2_TYPE_CHECK, "FSDP2 modules are instances of FSDPModule")
    UNWRAP_REASON = "fully_shard works in place: the wrapped model is the model"
    RECLASSES_MODULES = True  # FSDP<Block>(FSDPModule, Block)
    RESHAPES_PARAMETERS = True
    PARAMETERS_SHOWN = "FSDP2 shows the original parameters, as DTensors of their full shapes"
    STRATEGY_READ_REASON = (
        "fully_shard modules have no sharding_strategy attribute (the read fails on the migrated "
        "model, or finds an attribute of the model itself) and FSDP2 states the strategy as "
        "reshard_after_forward plus the mesh's shape, so a test of a ShardingStrategy value may no "
        "longer describe how the model is sharded: check what this code decides with it")

    # A `with` item may be a state_dict_type context or a `no_sync()` to expand; both are
    # noted on the way in and handled on the way out, `no_sync` first.

    def visit_With(self, node: cst.With) -> None:
        self.enter_state_dict_block(node)
        self.note_no_sync_block(node)

    def leave_With(self, original: cst.With, updated: cst.With):
        context = self.leave_state_dict_block()
        call = self.no_sync_block_call(original)
        if call is not None:
            return self.expand_no_sync_block(original, updated, call)
        return self.translate_state_dict_block(original, updated, context)
