"""`--to yafsdp`: rewrite FSDP1 code for `fsdp_bridge.ya_fsdp.YaFSDP`.

    python -m libcst.tool codemod to_yafsdp.ToYafsdpCommand PATH

`FSDP(model, ...)` with literal arguments becomes `YaFSDP(model, zero_stage=...,
modules_to_wrap_with_names=[...], param_dtype=..., gradient_accumulation_steps=1, ...)` (the
mapping of YaFSDP's own constructor: FULL_SHARD is zero stage 3, SHARD_GRAD_OP stage 2); other
values go through `fsdp1_to_yafsdp`, and settings YaFSDP cannot express keep the FSDP1 call
under a TODO. `no_sync()` blocks stay as they are: `fsdp_bridge.ya_fsdp.YaFSDP` keeps FSDP's
`no_sync()` beside YaFSDP's declared `gradient_accumulation_steps` (written as 1).

The walk and the rules shared with `--to fsdp2` (first pass, diagnostics, type checks,
`.module`, the FB2xx TODOs) come from `Fsdp1Codemod`; the rule codes are listed in `rules.py`.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ScopeProvider

from fsdp_bridge.codemods import fsdp1, rules
from fsdp_bridge.codemods.base import IN_PLACE, RUNTIME
from fsdp_bridge.codemods.facts import PROVEN
from fsdp_bridge.codemods.fsdp1 import STATE_DICT_TYPE_PARAMS
from fsdp_bridge.codemods.fsdp1_codemod import Fsdp1Codemod
from fsdp_bridge.codemods.helpers import (
    append_args,
    call_arguments,
    code,
    comments_in,
    dotted,
    fit,
    is_literal,
    keyword_arg,
    lost_comments,
    rebuild_args,
    tight_equal,
    unwrap_with,
)
from fsdp_bridge.codemods.mixed_precision import FP32, literal_keywords, mixed_precision
from fsdp_bridge.codemods.module_tree import UnitWalk
from fsdp_bridge.codemods.names import RUNTIME_MODULE, STATE_DICT_METHODS, STATE_DICT_TYPE, YAFSDP_MODULE
from fsdp_bridge.codemods.state_dict import KEPT, Block, StateDictRules, configures_elsewhere

# FSDP1 arguments YaFSDP takes under the same or another name.
RENAMED = {"device_id": "device_id", "sync_module_states": "sync_module_states",
           "param_init_fn": "param_init_fn", "process_group": "data_parallel_process_group"}
DROPPED = ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params")
ZERO_STAGE = {"FULL_SHARD": "3", "SHARD_GRAD_OP": "2"}
# FSDP1's optimizer state-dict statics: torch's checkpoint helpers (get_/set_optimizer_state_dict)
# take a YaFSDP model as they take an FSDP2 one, so they translate as under --to fsdp2.
OPTIMIZER_STATICS = ("optim_state_dict", "full_optim_state_dict", "optim_state_dict_to_load",
                     "scatter_full_optim_state_dict")
# Statics left under a TODO, with what YaFSDP offers instead.
UNTRANSLATED_STATICS = {
    "fsdp_modules": "YaFSDP wraps the model once: its units (modules_to_wrap_with_names) stay plain modules, so "
                    "the model itself is the only YaFSDP module; walk the units by name instead",
    "summon_full_params": "YaFSDP has no context that gathers full parameters in place; read them from "
                          "model.state_dict() (a full state dict) instead, or migrate with --to fsdp2",
    "set_state_dict_type": "YaFSDP keeps no state-dict mode: its state_dict() is full; pass StateDictOptions to "
                           "get_/set_model_state_dict where another kind is taken",
}


class _Rank0Only(cst.CSTTransformer):
    """`model.state_dict()` -> `model.state_dict(rank0_only=True)`: FSDP1's rank0_only config of
    the `state_dict_type` block the call was in, as YaFSDP's state_dict takes it."""

    def __init__(self, model: str | None) -> None:
        super().__init__()
        self.model = model

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        func = updated.func
        if (isinstance(func, cst.Attribute) and func.attr.value == "state_dict" and not updated.args
                and self.model is not None and dotted(func.value) == self.model):
            return updated.with_changes(args=[keyword_arg("rank0_only", "True")])
        return updated


class _UnitStateDict(cst.CSTTransformer):
    """`unit.state_dict()` -> the expression that takes it from the root (see `_unit_state_dict`)."""

    def __init__(self, unit: str, replacement: cst.BaseExpression) -> None:
        super().__init__()
        self.unit, self.replacement = unit, replacement

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        func = updated.func
        if isinstance(func, cst.Attribute) and func.attr.value == "state_dict" and dotted(func.value) == self.unit:
            return self.replacement.deep_clone()
        return updated


class ToYafsdpCommand(StateDictRules, Fsdp1Codemod):
    DESCRIPTION = "Rewrite FSDP1 (FullyShardedDataParallel) code for fsdp_bridge.ya_fsdp.YaFSDP."
    WRAPPED_CLASS = (YAFSDP_MODULE, "YaFSDP", rules.YAFSDP_TYPE_CHECK, "the wrapped model is a YaFSDP instance")
    UNWRAP_REASON = "YaFSDP has no .module: it forwards attribute reads to the model and its own " \
        "state_dict/load_state_dict/no_sync take the place of the wrapped module's"
    TARGET = "YaFSDP"
    UNITS_ARE_WRAPPERS = False  # one YaFSDP model; its units are plain modules
    PARAMETERS_SHOWN = "YaFSDP shows the original parameters under their names (1-D pieces of this rank's shard)"
    ACCEPT_FSDP1_TOO = True  # the tree may keep FSDP1 constructors (TODOs) in other files
    STRATEGY_READ_REASON = (
        "YaFSDP has no sharding_strategy attribute (the read fails on the migrated model, or finds "
        "an attribute of the model itself); its strategy is zero_stage (3 for FULL_SHARD, 2 for "
        "SHARD_GRAD_OP), so a test of a ShardingStrategy value may no longer describe how the model "
        "is sharded: check what this code decides with it")

    def __init__(self, context) -> None:
        super().__init__(context)
        # Per enclosing `with`, as `state_dict_blocks`: rank0_only of a FULL block YaFSDP's own
        # state_dict() answers, None for any other.
        self.own_full_blocks: list[bool | None] = []
        # Per enclosing `with`: the walk that found the unit of its state_dict_type (see _unit_of).
        self.unit_blocks: list[UnitWalk | None] = []

    # -- FSDP(...) -----------------------------------------------------------------------

    def translate_constructor(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        args = fsdp1.constructor_arguments(original)
        values = {n: a.value for n, a in (args or {}).items()}
        unsupported = self._unsupported(values)
        if unsupported:
            self.todo(rules.YAFSDP_UNSUPPORTED, original, "FullyShardedDataParallel(...)", unsupported)
            self.keeps_fsdp1(rules.YAFSDP_UNSUPPORTED, original)
            return updated
        self._check_precision(original, values.get("mixed_precision"))
        reasons = self._needs_runtime(original, args, values)
        if reasons:
            self.site(rules.YAFSDP_AT_RUN_TIME, RUNTIME, original, "FullyShardedDataParallel(...)",
                      "; ".join(reasons) + self._accumulation_note(rules.YAFSDP_AT_RUN_TIME))
            self.need(RUNTIME_MODULE, "fsdp1_to_yafsdp")
            self.drop_import_of(original.func)
            return fit(updated.with_changes(func=cst.Name("fsdp1_to_yafsdp"), args=append_args(
                updated.args, [keyword_arg("gradient_accumulation_steps", "1")])), original)
        return self._in_place(original, updated, args)

    def _accumulation_note(self, rule: str) -> str:
        """`gradient_accumulation_steps=1` in a file that accumulates gradients with `no_sync()`: a
        note above the call says why 1 is right (for the report: the same, after "; ")."""
        if not self.uses_no_sync:
            return ""
        why = ("gradient_accumulation_steps=1 although this file accumulates gradients with no_sync(): "
               "fsdp_bridge's YaFSDP keeps FSDP's no_sync(), which holds the reduction back until the "
               "backward outside the block, as FSDP1 did; upstream YaFSDP has no no_sync() and needs the "
               "number of micro-batches here instead")
        self.note(rule, why)
        return "; " + why

    def _check_precision(self, call: cst.Call, node: cst.BaseExpression | None) -> None:
        """A TODO for the precision settings of a literal MixedPrecision YaFSDP cannot express."""
        fields = literal_keywords(node, self.fsdp) if node is not None else {}
        param, reduce = fields.get("param_dtype"), fields.get("reduce_dtype")
        problems = []
        if reduce is not None and reduce not in FP32 and reduce != param:
            problems.append(f"reduce_dtype={reduce} (YaFSDP reduces in fp32, or in param_dtype with "
                            "bit16_reduce_scatter=True)")
        if "buffer_dtype" in fields:
            problems.append(f"buffer_dtype={fields['buffer_dtype']} (no YaFSDP field: fsdp1_to_yafsdp casts "
                            "floating-point buffers once, so checkpoints hold them in that dtype)")
        if fields.get("keep_low_precision_grads", "False") != "False":
            problems.append("keep_low_precision_grads (no YaFSDP field: gradients are kept in fp32)")
        if problems:
            self.todo(rules.YAFSDP_PRECISION, call, "MixedPrecision(...)", "; ".join(problems))

    def _bit16_reduce(self, node: cst.BaseExpression | None) -> bool:
        """True where FSDP1 reduces gradients in a 16-bit param_dtype (reduce_dtype unset or equal)."""
        fields = literal_keywords(node, self.fsdp) if node is not None else {}
        param = fields.get("param_dtype")
        return param is not None and param not in FP32 and fields.get("reduce_dtype", param) == param

    def _unsupported(self, values) -> str | None:
        """Why YaFSDP cannot express these literal settings (None: it can)."""
        possible = self.possible_strategies(values.get("sharding_strategy"))
        if possible and not possible & set(ZERO_STAGE):
            # Every value it can hold is one YaFSDP lacks: fsdp1_to_yafsdp would raise at setup.
            return (f"YaFSDP has no {' or '.join(sorted(possible))} (zero_stage is 3 for FULL_SHARD or 2 for "
                    "SHARD_GRAD_OP)")
        if "cpu_offload" in values and fsdp1.cpu_offload(values["cpu_offload"], self.fsdp):
            return "YaFSDP has no CPU offload"
        for name in ("ignored_modules", "ignored_states", "device_mesh"):
            if name in values and not is_literal(values[name], "None"):
                return f"YaFSDP has no {name}; keep FSDP1 here or migrate with --to fsdp2"
        return None

    def possible_strategies(self, node: cst.BaseExpression | None, depth: int = 0) -> set[str]:
        """Every ShardingStrategy member `node` can hold, as far as the file shows: a literal, either
        branch of `a if c else b`, or a name whose every assignment reaching here is one of those
        (empty: unknown, a value the file does not show)."""
        if node is None or depth > 3:
            return set() if node is not None else {"FULL_SHARD"}
        if isinstance(node, cst.IfExp):
            body, orelse = (self.possible_strategies(n, depth + 1) for n in (node.body, node.orelse))
            return body | orelse if body and orelse else set()
        member = fsdp1.strategy(node, self.fsdp)
        if member is not None:
            return {member}
        scope = self.get_metadata(ScopeProvider, node, None) if isinstance(node, cst.Name) else None
        if scope is None:
            return set()
        referents = {r for access in scope.accesses[node.value] if access.node is node for r in access.referents}
        values = [self.assigned_values.get(id(getattr(r, "node", None))) for r in referents]
        if not values or any(value is None for value in values):
            return set()
        found = [self.possible_strategies(value, depth + 1) for value in values]
        return set().union(*found) if all(found) else set()

    def _needs_runtime(self, call, args, values=None) -> list[str]:
        if args is None:
            return ["the call passes *args/**kwargs"]
        if "module" not in values:
            return ["the module argument is missing"]
        reasons = []
        if fsdp1.strategy(values.get("sharding_strategy"), self.fsdp) is None:
            reasons.append("sharding_strategy is not a literal ShardingStrategy member")
        if "cpu_offload" in values and fsdp1.cpu_offload(values["cpu_offload"], self.fsdp) is None:
            reasons.append("cpu_offload is not a literal CPUOffload(...)")
        mp = values.get("mixed_precision")
        if mp is not None and not is_literal(mp, "None") and isinstance(mixed_precision(mp, self.fsdp), str):
            reasons.append(mixed_precision(mp, self.fsdp))
        if "process_group" in values and isinstance(values["process_group"], cst.Tuple):
            reasons.append("a tuple process_group is FSDP1's hybrid sharding")
        policy = fsdp1.policy(values.get("auto_wrap_policy"), self.fsdp, self.qualified)
        if policy == "runtime":
            reasons.append("auto_wrap_policy is not a literal transformer/ModuleWrapPolicy/lambda policy")
        elif policy is not None and dotted(values["module"]) is None:
            reasons.append("the wrapped module is an expression, not a name")
        return reasons

    def _in_place(self, original: cst.Call, updated: cst.Call, args) -> cst.Call:
        values = {n: a.value for n, a in args.items()}
        by_id = {id(arg): name for name, arg in args.items()}
        module = code(values["module"])
        new_args, reasons, dropped_notes, moved_comments = [], [], [], []
        for old, new in zip(original.args, updated.args):
            name = by_id[id(old)]
            keyword, value = self._yafsdp_arg(name, old.value, module)
            if name == "module":
                new_args.append(new)
            elif keyword is None:
                if name in DROPPED and not is_literal(old.value, "None"):
                    reasons.append(f"dropped {name}: YaFSDP schedules its own prefetching")
                comments = comments_in(code(old))
                moved_comments.extend(comments)
                if comments:
                    dropped_notes.append(f"{name}={code(old.value)} ({' '.join(comments)})")
                self.drop_import_of(old.value)
                self.drop_policy_imports(old.value)
            else:
                new_args.append(new.with_changes(
                    keyword=cst.Name(keyword), value=value if value is not None else new.value,
                    equal=new.equal if new.keyword else tight_equal(),
                ))
                self.drop_import_of(old.value)
                self.drop_policy_imports(old.value)
        if dropped_notes:
            self.todo(rules.DROPPED_COMMENT, original, "dropped FSDP1 arguments", "; ".join(dropped_notes))
        present = {a.keyword.value for a in new_args if a.keyword}
        extra = [keyword_arg(k, v) for k, v in (("zero_stage", "3"), ("modules_to_wrap_with_names", "[]"))
                 if k not in present]
        if self._bit16_reduce(values.get("mixed_precision")):
            extra.append(keyword_arg("bit16_reduce_scatter", "True"))
            reasons.append("gradients reduced in param_dtype, as FSDP1 does (bit16_reduce_scatter=True)")
        extra.append(keyword_arg("gradient_accumulation_steps", "1"))
        summary = "; ".join(reasons) or "YaFSDP with the same settings"
        self.site(rules.YAFSDP_IN_PLACE, IN_PLACE, original, "FullyShardedDataParallel(...)",
                  summary + self._accumulation_note(rules.YAFSDP_IN_PLACE))
        self.need(YAFSDP_MODULE, "YaFSDP")
        self.drop_import_of(original.func)
        result = fit(updated.with_changes(func=cst.Name("YaFSDP"),
                                          args=append_args(rebuild_args(updated.args, new_args), extra)), original)
        self.comment_above(*lost_comments(updated, result, moved_comments))
        return result

    def _yafsdp_arg(self, name: str, old: cst.BaseExpression, module: str):
        """(YaFSDP keyword, new value node or None to keep the value) or (None, None) to drop."""
        if name in RENAMED:
            return (None, None) if is_literal(old, "None") and name == "process_group" else (RENAMED[name], None)
        if name == "sharding_strategy":
            return "zero_stage", cst.Integer(ZERO_STAGE[fsdp1.strategy(old, self.fsdp)])
        if name == "mixed_precision":
            mp = mixed_precision(old, self.fsdp)
            if isinstance(mp, str) or mp.param_dtype is None:
                return None, None
            return "param_dtype", cst.parse_expression(mp.param_dtype)
        if name == "auto_wrap_policy":
            policy = fsdp1.policy(old, self.fsdp, self.qualified)
            if policy is None:
                return None, None
            var, label = self.fresh("submodule"), self.fresh("name")
            listing = (f"[({var}, {label}) for {label}, {var} in {module}.named_modules() "
                       f"if {var} is not {module} and {policy.cond(var)}]")
            return "modules_to_wrap_with_names", cst.parse_expression(listing)
        return None, None  # dropped (prefetch/rate-limit flags, cpu_offload=None...)

    # -- other sites ---------------------------------------------------------------------

    def translate_static_method(self, original: cst.Call, updated: cst.Call, method: str) -> cst.BaseExpression:
        if method == "state_dict_type" and id(original) in self.state_dict_type_items:
            return updated
        if method == "state_dict_type":
            self.todo(rules.YAFSDP_STATE_DICT_TYPE, original, "FSDP.state_dict_type(...) used as a value", "YaFSDP's "
                      "state_dict() is always full; choose the state dict where it is taken")
            return updated
        if method in OPTIMIZER_STATICS:
            return StateDictRules.translate_static_method(self, original, updated, method)
        self.todo(rules.OTHER_FSDP1_USE, original, f"FullyShardedDataParallel.{method}(...)",
                  UNTRANSLATED_STATICS.get(method, "no YaFSDP equivalent is known to the codemod"))
        return updated

    def translate_method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """`model.state_dict()` / `load_state_dict(sd)` in a block that takes torch's checkpoint
        helpers (a sharded type, or options known at run time): `get_/set_model_state_dict`."""
        method, receiver = original.func.attr.value, dotted(original.func.value)
        index = next((i for i in reversed(range(len(self.state_dict_blocks)))
                      if isinstance(self.state_dict_blocks[i], Block)), None)
        if (method not in STATE_DICT_METHODS or index is None or self.own_full_blocks[index] is not None
                or receiver != self.state_dict_blocks[index].model):
            return updated
        return self.model_state_dict(original, updated, receiver, method, PROVEN, self.state_dict_blocks[index])

    def visit_With(self, node: cst.With) -> None:
        self.enter_state_dict_block(node)
        translated = isinstance(self.state_dict_blocks[-1], Block)
        unit = self._unit_of(node)
        if unit is not None:
            self.state_dict_blocks[-1] = KEPT  # its calls are not the root's: see _unit_state_dict
        self.unit_blocks.append(unit)
        self.own_full_blocks.append(self._own_full_block(node) if translated else None)

    def _unit_of(self, node: cst.With) -> UnitWalk | None:
        """The walk that found the module of `with FSDP.state_dict_type(unit, ...)`, where `unit` is
        bound by a `for` over a model's modules: under FSDP1 an FSDP unit, under YaFSDP a plain
        module of the one YaFSDP model."""
        call = node.items[0].item if len(node.items) == 1 else None
        if not isinstance(call, cst.Call) or self.fsdp(call.func) != STATE_DICT_TYPE:
            return None
        args = call_arguments(call, STATE_DICT_TYPE_PARAMS) or {}
        return self.unit_walk_of(dotted(args["module"].value)) if "module" in args else None

    def model_state_by_dcp(self) -> bool:
        return self._own_full_block(self._with_node) is None  # YaFSDP's state_dict() answers the others

    def _own_full_block(self, node: cst.With) -> bool | None:
        """rank0_only of a single `with FSDP.state_dict_type(model, FULL_STATE_DICT, <literal config>)`
        item, which YaFSDP's own state_dict() answers; None for any other block."""
        if len(node.items) > 1 or node.items[0].asname or not isinstance(node.items[0].item, cst.Call):
            return None
        args = call_arguments(node.items[0].item, STATE_DICT_TYPE_PARAMS) or {}
        kind = self.fsdp(self._config_value(args["state_dict_type"])) if "state_dict_type" in args else None
        if kind != "StateDictType.FULL_STATE_DICT":
            return None
        config = args.get("state_dict_config")
        flags = fsdp1.state_dict_config(config and (self.literal_value(config.value) or config.value),
                                        self.fsdp, False)
        return None if flags is None else flags[1]

    def leave_With(self, original: cst.With, updated: cst.With):
        """`with FSDP.state_dict_type(model, FULL_STATE_DICT)`: YaFSDP's state dict is already full;
        other types and configs known at run time: torch's checkpoint helpers, as for FSDP2."""
        context, rank0_only = self.leave_state_dict_block(), self.own_full_blocks.pop()
        unit = self.unit_blocks.pop()
        item = next((item for item in original.items if isinstance(item.item, cst.Call)
                     and (self.fsdp(item.item.func) or "") == STATE_DICT_TYPE), None)
        if item is None:
            return updated
        if unit is not None:
            return self._unit_state_dict(original, updated, item.item, unit, self._own_full_block(original))
        if rank0_only is not None:
            return self._own_full_state_dict(original, updated, item.item, rank0_only)
        if isinstance(context, Block):
            return self.translate_state_dict_block(original, updated, context)
        args = call_arguments(item.item, STATE_DICT_TYPE_PARAMS) or {}
        if configures_elsewhere(original, dotted(args["module"].value) if "module" in args else None, self.fsdp,
                                self.qualified):
            self.todo(rules.STATE_DICT_TYPE_ELSEWHERE, original, "with FSDP.state_dict_type(...)",
                      "the block does more than take this model's state dict (calls made elsewhere "
                      "read the setting): YaFSDP's state_dict() is always full; check what those calls "
                      "save, then remove the block")
            return updated
        self.todo(rules.YAFSDP_STATE_DICT_TYPE, original, "FSDP.state_dict_type(...)",
                  "YaFSDP has no local (flat-parameter) state dict, and a block held under a name or with "
                  "other items is not translated: pass StateDictOptions to get_/set_model_state_dict where "
                  "the state dict is taken, then remove the block")
        return updated

    def _unit_state_dict(self, original: cst.With, updated: cst.With, call: cst.Call, walk: UnitWalk,
                         rank0_only: bool | None):
        """A full state dict of one unit found by name in a walk over the wrapped model (a LoRA save):
        YaFSDP's units are plain modules, whose state_dict() holds this rank's pieces and takes no
        rank0_only. `unit.state_dict()` becomes `yafsdp_unit_state_dict(root, name)`, the keys of the
        root's full state dict under the unit's name; anything else is left under a TODO."""
        root = walk.root
        while isinstance(root, cst.Attribute) and root.attr.value in ("module", "_orig_mod"):
            root = root.value  # the YaFSDP model itself
        uses = [node for node in m.findall(original.body, m.Name(walk.unit))]
        calls = [node for node in m.findall(original.body, m.Call(func=m.Attribute(value=m.Name(walk.unit))))]
        only_state_dicts = len(uses) == len(calls) and all(
            node.func.attr.value == "state_dict" and not node.args for node in calls)
        if rank0_only is None or walk.name is None or self.receiver(root) is None or not calls or not only_state_dicts:
            self.todo(rules.YAFSDP_STATE_DICT_TYPE, original, f"with FSDP.state_dict_type({walk.unit}, ...)",
                      f"{walk.unit} is a unit found in a walk over the model: YaFSDP's units are plain modules, whose "
                      "state_dict() and load_state_dict() see this rank's pieces (and take no rank0_only); take "
                      "or load the root's full state dict, the unit's keys under its name "
                      "(yafsdp_unit_state_dict(root, name) in fsdp_bridge.migrate.runtime takes one), then remove "
                      "the block")
            return updated
        self.site(rules.YAFSDP_STATE_DICT_TYPE, RUNTIME, original,
                  f"with FSDP.state_dict_type({walk.unit}, FULL_STATE_DICT)",
                  f"{walk.unit} is a unit found by name in a walk over the model, and YaFSDP's units are plain "
                  "modules: yafsdp_unit_state_dict() takes the root's full state dict and keeps the keys under the "
                  "unit's name (the whole model is gathered for each unit; FSDP1 gathered the unit alone)")
        self.need(RUNTIME_MODULE, "yafsdp_unit_state_dict")
        self.drop_import_of(call.func)
        for arg in call.args[1:]:
            self.drop_import_of(arg.value)
        helper = f"yafsdp_unit_state_dict({code(root)}, {walk.name}{', rank0_only=True' if rank0_only else ''})"
        body = updated.body.visit(_UnitStateDict(walk.unit, cst.parse_expression(helper)))
        return unwrap_with(updated.with_changes(body=body))

    def _own_full_state_dict(self, original: cst.With, updated: cst.With, call: cst.Call, rank0_only: bool):
        self.site(rules.YAFSDP_STATE_DICT_TYPE, IN_PLACE, original, "with FSDP.state_dict_type(FULL_STATE_DICT)",
                  "YaFSDP's state_dict() is already a full state dict (on the CPU)"
                  + ("; rank0_only=True passed to the model's state_dict()" if rank0_only else ""))
        self.drop_import_of(call.func)
        for arg in call.args[1:]:
            self.drop_import_of(arg.value)
        if rank0_only:
            model = dotted((call_arguments(call, STATE_DICT_TYPE_PARAMS) or {})["module"].value)
            updated = updated.with_changes(body=updated.body.visit(_Rank0Only(model)))
        return unwrap_with(updated)
