"""Mixed precision: reading a literal FSDP1 `MixedPrecision(...)` and writing FSDP2's policies.

FSDP1 casts forward inputs at the root only by default, FSDP2 in every module; the policy for
the root and the one for the other units are therefore written separately.
"""

from __future__ import annotations

import dataclasses

import libcst as cst

from fsdp_bridge.codemods.fsdp1 import Resolve, literal_bool
from fsdp_bridge.codemods.helpers import call_arguments, code, is_literal

MIXED_PRECISION_PARAMS = (
    "param_dtype",
    "reduce_dtype",
    "buffer_dtype",
    "keep_low_precision_grads",
    "cast_forward_inputs",
    "cast_root_forward_inputs",
    "_module_classes_to_ignore",
)


@dataclasses.dataclass(frozen=True)
class MixedPrecisionLiteral:
    """A literal `MixedPrecision(...)` we can express as FSDP2 `MixedPrecisionPolicy`s."""

    param_dtype: str | None
    reduce_dtype: str | None
    cast_forward_inputs: bool  # FSDP1: non-root units cast their inputs (default False)
    cast_root_forward_inputs: bool  # FSDP1: the root casts its inputs (default True)

    def policy(self, root: bool) -> str:
        fields = []
        if self.param_dtype is not None:
            fields.append(f"param_dtype={self.param_dtype}")
        if self.reduce_dtype is not None:
            fields.append(f"reduce_dtype={self.reduce_dtype}")
        # FSDP2 casts inputs in every module by default; FSDP1 only at the root by default.
        cast = (self.cast_root_forward_inputs or self.cast_forward_inputs) if root else self.cast_forward_inputs
        if not cast:
            fields.append("cast_forward_inputs=False")
        return f"MixedPrecisionPolicy({', '.join(fields)})"


def mixed_precision(node: cst.BaseExpression, resolve: Resolve) -> MixedPrecisionLiteral | str:
    """A `MixedPrecisionLiteral`, or the reason the value needs the runtime helper."""
    if not (isinstance(node, cst.Call) and resolve(node.func) == "MixedPrecision"):
        return "mixed_precision is not a literal MixedPrecision(...) call"
    args = call_arguments(node, MIXED_PRECISION_PARAMS)
    if args is None:
        return "MixedPrecision(...) uses **kwargs"
    values = {name: arg.value for name, arg in args.items()}
    for name in ("buffer_dtype", "_module_classes_to_ignore"):
        if name in values and not is_literal(values[name], "None"):
            return f"MixedPrecision({name}=...) has no literal translation"
    if literal_bool(values.get("keep_low_precision_grads"), False) is not False:
        return "MixedPrecision(keep_low_precision_grads=...) has no literal translation"
    cast = literal_bool(values.get("cast_forward_inputs"), False)
    cast_root = literal_bool(values.get("cast_root_forward_inputs"), True)
    if cast is None or cast_root is None:
        return "MixedPrecision cast flags are not literal booleans"

    def dtype(name: str) -> str | None:
        value = values.get(name)
        return None if value is None or is_literal(value, "None") else code(value)

    return MixedPrecisionLiteral(dtype("param_dtype"), dtype("reduce_dtype"), cast, cast_root)


FP32 = ("torch.float32", "torch.float")


def literal_keywords(node: cst.BaseExpression, resolve: Resolve) -> dict[str, str]:
    """The keyword arguments of a literal `MixedPrecision(...)` call, as code ({} otherwise)."""
    if not (isinstance(node, cst.Call) and resolve(node.func) == "MixedPrecision"):
        return {}
    args = call_arguments(node, MIXED_PRECISION_PARAMS) or {}
    return {name: code(arg.value) for name, arg in args.items() if not is_literal(arg.value, "None")}
