"""Reading FSDP1 call sites: which arguments were passed, and which of them are literals we can
translate at migration time (the rest goes to the runtime helpers of `fsdp_bridge.migrate.runtime`,
which do the same translation when the script runs)."""

from __future__ import annotations

import dataclasses
from typing import Callable

import libcst as cst

from fsdp_bridge.codemods.helpers import call_arguments, code, dotted, is_literal
from fsdp_bridge.codemods.names import PARTIAL

# FSDP1's constructor, in positional order (as in torch 2.13).
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
# Keywords FSDP1 took under another name in torch 2.0 (torch 2.1 renamed them): old -> current.
RENAMED_KEYWORDS = {"ignored_parameters": "ignored_states"}
STATE_DICT_TYPE_PARAMS = ("module", "state_dict_type", "state_dict_config", "optim_state_dict_config")

# `resolve(node)` gives the short FSDP name a node refers to ("ShardingStrategy.FULL_SHARD"),
# `qualified(node)` all its qualified names; both come from the codemod's metadata.
Resolve = Callable[[cst.CSTNode], "str | None"]
Qualified = Callable[[cst.CSTNode], "set[str]"]


def constructor_arguments(call: cst.Call) -> dict[str, cst.Arg] | None:
    """The arguments of an `FSDP(...)` call by FSDP1's current parameter names (a torch 2.0
    keyword such as `ignored_parameters` counts as its new name), or None as `call_arguments`.
    The values are `call`'s own argument nodes."""
    renamed = current_keywords(call)
    bound = call_arguments(renamed, FSDP1_PARAMS)
    if bound is None:
        return None
    own = {id(new): old for new, old in zip(renamed.args, call.args)}
    return {name: own[id(arg)] for name, arg in bound.items()}


def current_keywords(call: cst.Call) -> cst.Call:
    """`call` with torch 2.0's constructor keywords renamed as current torch names them (the same
    argument nodes otherwise, so positions and comments stay)."""
    if not any(a.keyword is not None and a.keyword.value in RENAMED_KEYWORDS for a in call.args):
        return call
    return call.with_changes(args=[
        a.with_changes(keyword=cst.Name(RENAMED_KEYWORDS[a.keyword.value]))
        if a.keyword is not None and a.keyword.value in RENAMED_KEYWORDS else a for a in call.args])


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


def literal_bool(node: cst.BaseExpression | None, default: bool) -> bool | None:
    """The value of a literal True/False (`default` when absent), None for anything else."""
    if node is None:
        return default
    if is_literal(node, "True", "False"):
        return node.value == "True"  # type: ignore[union-attr]
    return None


def cpu_offload(node: cst.BaseExpression, resolve: Resolve) -> bool | None:
    """True/False for a literal `CPUOffload(...)` (or None literal); None when not a literal."""
    if is_literal(node, "None"):
        return False
    if isinstance(node, cst.Call) and resolve(node.func) == "CPUOffload":
        args = call_arguments(node, ("offload_params",))
        if args is None:
            return None
        return literal_bool(args["offload_params"].value if args else None, False)
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
    offload = literal_bool(args["offload_to_cpu"].value if "offload_to_cpu" in args else None, defaults[0])
    rank0 = literal_bool(args["rank0_only"].value if "rank0_only" in args else None, False)
    if offload is None or rank0 is None:
        return None
    return offload, rank0
