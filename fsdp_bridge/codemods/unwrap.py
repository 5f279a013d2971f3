"""`model.module` on a wrapped model (FB106): neither FSDP2 nor YaFSDP leaves a `.module`.

Where the receiver is proven to hold the wrapper the attribute goes; where it may, the runtime
helper `fsdp1_unwrap()` decides when the script runs (see [Note: which receivers are FSDP
modules] in `facts.py`).
"""

from __future__ import annotations

import libcst as cst

from fsdp_bridge.codemods import rules
from fsdp_bridge.codemods.base import IN_PLACE, RUNTIME
from fsdp_bridge.codemods.facts import MAYBE, PROVEN
from fsdp_bridge.codemods.helpers import code
from fsdp_bridge.codemods.names import RUNTIME_MODULE


class UnwrapRule:
    """`x.module` -> `x` or `fsdp1_unwrap(x)`; expects the receivers of `FactsMixin`."""

    # Why `.module` goes (the report's reason); set by each command.
    UNWRAP_REASON = ""

    def unwrap_module_attribute(self, original: cst.Attribute, updated: cst.Attribute):
        kind = self.receiver(original.value)
        if kind == PROVEN:
            self.site(rules.MODULE_ATTRIBUTE, IN_PLACE, original, f"{code(original.value)}.module", self.UNWRAP_REASON)
            return updated.value
        if kind == MAYBE:
            self.site(rules.MODULE_ATTRIBUTE, RUNTIME, original, f"{code(original.value)}.module",
                      f"{code(original.value)} is not proven to be the wrapped model here: "
                      "fsdp1_unwrap() gives the model itself for a sharded one and .module otherwise")
            self.need(RUNTIME_MODULE, "fsdp1_unwrap")
            return cst.Call(func=cst.Name("fsdp1_unwrap"), args=[cst.Arg(updated.value)])
        return updated
