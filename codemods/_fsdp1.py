"""Reading FSDP1 call sites: which arguments were passed, and which of them are literals we can
translate at migration time (the rest goes to the runtime helper, see DESIGN §6)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import libcst as cst

from codemods._common import call_arguments, dotted, is_literal

# FSDP1's constructor, in positional order (torch 2.13, torch_fsdp.md §1.1).
FSDP1_PARAMS = (
    "module",
    "process_group",
    "sharding_strategy",
    "cpu_offload",
    "auto_wrap_policy",
    "backward_prefetch",
    "mixed_precision",
    "ignored_modules",
    "param_init_fn",
    "device_id",
    "sync_module_states",
    "forward_prefetch",
    "limit_all_gathers",
    "use_orig_params",
    "ignored_states",
    "device_mesh",
)
MIXED_PRECISION_PARAMS = (
    "param_dtype",
    "reduce_dtype",
    "buffer_dtype",
    "keep_low_precision_grads",
    "cast_forward_inputs",
    "cast_root_forward_inputs",
    "_module_classes_to_ignore",
)
STATE_DICT_TYPE_PARAMS = ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")

# `resolve(node)` gives the short FSDP name a node refers to ("ShardingStrategy.FULL_SHARD"),
# `qualified(node)` all its qualified names; both come from the codemod's metadata.
Resolve = Callable[[cst.CSTNode], "str | None"]
Qualified = Callable[[cst.CSTNode], "set[str]"]

PARTIAL = "functools.partial"


def code(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def strategy(node: cst.BaseExpression | None, resolve: Resolve) -> str | None:
    """"FULL_SHARD" for `ShardingStrategy.FULL_SHARD` (and for a literal None); None if unknown."""
    if node is None or is_literal(node, "None"):
        return "FULL_SHARD"
    name = resolve(node) or ""
    return name.split(".", 1)[1] if name.startswith("ShardingStrategy.") else None


@dataclasses.dataclass(frozen=True)
class Policy:
    """A literal wrap policy as a condition on one module (`cond("submodule")` -> code)."""

    cond: Callable[[str], str]
    what: str


def _classes_tuple(node: cst.BaseExpression) -> str:
    """`{A, B}` -> `(A, B)`; a variable `X` -> `tuple(X)` (isinstance wants a tuple)."""
    if isinstance(node, (cst.Set, cst.List, cst.Tuple)):
        items = [code(element.value) for element in node.elements]
        return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
    return f"tuple({code(node)})"


def policy(node: cst.BaseExpression | None, resolve: Resolve, qualified: Qualified):
    """Classify an `auto_wrap_policy` value: None (no policy), a `Policy`, or "runtime"."""
    if node is None or is_literal(node, "None"):
        return None
    if isinstance(node, cst.Call):
        name = resolve(node.func)
        if name == "ModuleWrapPolicy" and len(node.args) == 1 and not node.args[0].star:
            classes = _classes_tuple(node.args[0].value)
            return Policy(lambda var: f"isinstance({var}, {classes})", "ModuleWrapPolicy")
        if PARTIAL in qualified(node.func) and node.args and not node.args[0].star:
            inner = resolve(node.args[0].value)
            keywords = {a.keyword.value: a.value for a in node.args[1:] if a.keyword}
            if len(keywords) != len(node.args) - 1 or len(keywords) != 1:
                return "runtime"
            if inner == "transformer_auto_wrap_policy" and "transformer_layer_cls" in keywords:
                classes = _classes_tuple(keywords["transformer_layer_cls"])
                return Policy(lambda var: f"isinstance({var}, {classes})", "transformer_auto_wrap_policy")
            if inner == "lambda_auto_wrap_policy" and "lambda_fn" in keywords:
                fn = keywords["lambda_fn"]
                fn_code = code(fn) if dotted(fn) else f"({code(fn)})"
                return Policy(lambda var: f"{fn_code}({var})", "lambda_auto_wrap_policy")
    return "runtime"


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


def _bool(node: cst.BaseExpression | None, default: bool) -> bool | None:
    if node is None:
        return default
    if is_literal(node, "True", "False"):
        return node.value == "True"  # type: ignore[union-attr]
    return None


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
            return f"MixedPrecision({name}=...) has no FSDP2 field"
    if _bool(values.get("keep_low_precision_grads"), False) is not False:
        return "MixedPrecision(keep_low_precision_grads=...) has no FSDP2 field"
    cast = _bool(values.get("cast_forward_inputs"), False)
    cast_root = _bool(values.get("cast_root_forward_inputs"), True)
    if cast is None or cast_root is None:
        return "MixedPrecision cast flags are not literal booleans"

    def dtype(name: str) -> str | None:
        value = values.get(name)
        return None if value is None or is_literal(value, "None") else code(value)

    return MixedPrecisionLiteral(dtype("param_dtype"), dtype("reduce_dtype"), cast, cast_root)


def cpu_offload(node: cst.BaseExpression, resolve: Resolve) -> bool | None:
    """True/False for a literal `CPUOffload(...)` (or None literal); None when not a literal."""
    if is_literal(node, "None"):
        return False
    if isinstance(node, cst.Call) and resolve(node.func) == "CPUOffload":
        args = call_arguments(node, ("offload_params",))
        if args is None:
            return None
        return _bool(args["offload_params"].value if args else None, False)
    return None


def state_dict_config(
    node: cst.BaseExpression | None, resolve: Resolve, optimizer: bool
) -> tuple[bool, bool] | None:
    """(offload_to_cpu, rank0_only) of a literal `Full[Optim]StateDictConfig(...)` or None."""
    defaults = (optimizer, False)  # FullOptimStateDictConfig offloads by default, the model one doesn't
    if node is None or is_literal(node, "None"):
        return defaults
    if not isinstance(node, cst.Call):
        return None
    name = resolve(node.func)
    if name not in ("FullStateDictConfig", "FullOptimStateDictConfig", "ShardedStateDictConfig",
                    "ShardedOptimStateDictConfig"):
        return None
    args = call_arguments(node, ("offload_to_cpu", "rank0_only"))
    if args is None:
        return None
    offload = _bool(args["offload_to_cpu"].value if "offload_to_cpu" in args else None, defaults[0])
    rank0 = _bool(args["rank0_only"].value if "rank0_only" in args else None, False)
    if offload is None or rank0 is None:
        return None
    return offload, rank0
