"""`--to yafsdp`: rewrite FSDP1 code for `fsdp_bridge.ya_fsdp.YaFSDP` (seed 000's mapping).

    python -m libcst.tool codemod to_yafsdp.ToYafsdpCommand PATH

FB300  `FSDP(model, ...)` with literal arguments -> `YaFSDP(model, zero_stage=..., 
       modules_to_wrap_with_names=[...], param_dtype=..., gradient_accumulation_steps=1, ...)`.
FB301  `FSDP(model, ...)` with non-literal values -> `fsdp1_to_yafsdp(model, ...)` (runtime helper).
FB302  FSDP1 settings YaFSDP cannot express (hybrid/NO_SHARD, CPU offload, ignored modules,
       device_mesh): the call is left as it was, with a TODO.
FB303  `isinstance(x, FSDP)` -> `isinstance(x, (YaFSDP, FSDP))`: constructors this run could not
       translate (here or in other files of the tree) still build FSDP1 modules; the report names
       them when the run saw them.
FB304  `with FSDP.state_dict_type(model, FULL_STATE_DICT...)`: YaFSDP's `state_dict()` is full, so
       the block's body stays and the `with` goes (kept with FB209 when the block configures
       calls made elsewhere); other types, or the context used as a value, get a TODO.
FB106  `model.module` -> `model` where `model` is proven to hold the wrapper (YaFSDP has no
       `.module`), `fsdp1_unwrap(model)` where it may.
`no_sync()` blocks stay as they are: `fsdp_bridge.ya_fsdp.YaFSDP` keeps FSDP's `no_sync()` beside
YaFSDP's declared `gradient_accumulation_steps` (written as 1).
The FSDP1 uses it cannot translate share FSDP2's codes (FB201-FB299).
"""

from __future__ import annotations

import libcst as cst

from codemods import _fsdp1
from codemods._common import IN_PLACE, RUNTIME, RUNTIME_MODULE, call_arguments, comments_in, dotted, is_literal
from codemods._fsdp1 import FSDP1_PARAMS, code
from codemods.to_fsdp2 import FSDP1, ToFsdp2Command, _arg, lost_comments, rebuild_args

YAFSDP_MODULE = "fsdp_bridge.ya_fsdp"
# FSDP1 arguments YaFSDP takes under the same or another name.
RENAMED = {"device_id": "device_id", "sync_module_states": "sync_module_states",
           "param_init_fn": "param_init_fn", "process_group": "data_parallel_process_group"}
DROPPED = ("backward_prefetch", "forward_prefetch", "limit_all_gathers", "use_orig_params")
ZERO_STAGE = {"FULL_SHARD": "3", "SHARD_GRAD_OP": "2"}


class ToYafsdpCommand(ToFsdp2Command):
    DESCRIPTION = "Rewrite FSDP1 (FullyShardedDataParallel) code for fsdp_bridge.ya_fsdp.YaFSDP."
    WRAPPED_CLASS = ("fsdp_bridge.ya_fsdp", "YaFSDP", "FB303", "the wrapped model is a YaFSDP instance")
    UNWRAP_REASON = "YaFSDP has no .module: it forwards attribute reads to the model and its own " \
        "state_dict/load_state_dict/no_sync take the place of the wrapped module's"
    ACCEPT_FSDP1_TOO = True  # the tree may keep FSDP1 constructors (TODOs) in other files
    ROUTE_NO_SYNC_REFERENCES = False  # YaFSDP keeps no_sync()
    STRATEGY_READ_REASON = (
        "YaFSDP has no sharding_strategy attribute (the read fails on the migrated model, or finds "
        "an attribute of the model itself); its strategy is zero_stage (3 for FULL_SHARD, 2 for "
        "SHARD_GRAD_OP), so a test of a ShardingStrategy value may no longer describe how the model "
        "is sharded: check what this code decides with it")

    # -- FSDP(...) -----------------------------------------------------------------------

    def _constructor(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        args = call_arguments(original, FSDP1_PARAMS)
        values = {n: a.value for n, a in (args or {}).items()}
        unsupported = self._unsupported(values)
        if unsupported:
            self.todo("FB302", original, "FullyShardedDataParallel(...)", unsupported)
            self.keeps_fsdp1("FB302", original)
            return updated
        reasons = self._needs_runtime(original, args, values)
        if reasons:
            self.site("FB301", RUNTIME, original, "FullyShardedDataParallel(...)", "; ".join(reasons))
            self.need(RUNTIME_MODULE, "fsdp1_to_yafsdp")
            self.drop_import_of(original.func)
            return updated.with_changes(func=cst.Name("fsdp1_to_yafsdp"),
                                        args=self._append(updated.args, [_arg("gradient_accumulation_steps", "1")]))
        return self._in_place(original, updated, args)

    def _unsupported(self, values) -> str | None:
        """Why YaFSDP cannot express these literal settings (None: it can)."""
        strategy = _fsdp1.strategy(values.get("sharding_strategy"), self.fsdp)
        if strategy is not None and strategy not in ZERO_STAGE:
            return f"YaFSDP has no {strategy} (zero_stage is 3 for FULL_SHARD or 2 for SHARD_GRAD_OP)"
        if "cpu_offload" in values and _fsdp1.cpu_offload(values["cpu_offload"], self.fsdp):
            return "YaFSDP has no CPU offload"
        for name in ("ignored_modules", "ignored_states", "device_mesh"):
            if name in values and not is_literal(values[name], "None"):
                return f"YaFSDP has no {name}; keep FSDP1 here or migrate with --to fsdp2"
        return None

    def _needs_runtime(self, call, args, values=None) -> list[str]:
        if args is None:
            return ["the call passes *args/**kwargs"]
        if "module" not in values:
            return ["the module argument is missing"]
        reasons = []
        if _fsdp1.strategy(values.get("sharding_strategy"), self.fsdp) is None:
            reasons.append("sharding_strategy is not a literal ShardingStrategy member")
        if "cpu_offload" in values and _fsdp1.cpu_offload(values["cpu_offload"], self.fsdp) is None:
            reasons.append("cpu_offload is not a literal CPUOffload(...)")
        mp = values.get("mixed_precision")
        if mp is not None and not is_literal(mp, "None") and isinstance(_fsdp1.mixed_precision(mp, self.fsdp), str):
            reasons.append(_fsdp1.mixed_precision(mp, self.fsdp))
        if "process_group" in values and isinstance(values["process_group"], cst.Tuple):
            reasons.append("a tuple process_group is FSDP1's hybrid sharding")
        policy = _fsdp1.policy(values.get("auto_wrap_policy"), self.fsdp, self.qualified)
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
                self._drop_policy_imports(old.value)
            else:
                new_args.append(new.with_changes(
                    keyword=cst.Name(keyword), value=value if value is not None else new.value,
                    equal=new.equal if new.keyword else _arg("x", "0").equal,
                ))
                self.drop_import_of(old.value)
                self._drop_policy_imports(old.value)
        if dropped_notes:
            self.todo("FB110", original, "dropped FSDP1 arguments", "; ".join(dropped_notes))
        present = {a.keyword.value for a in new_args if a.keyword}
        extra = [_arg(k, v) for k, v in (("zero_stage", "3"), ("modules_to_wrap_with_names", "[]"))
                 if k not in present]
        extra.append(_arg("gradient_accumulation_steps", "1"))
        self.site("FB300", IN_PLACE, original, "FullyShardedDataParallel(...)",
                  "; ".join(reasons + ["YaFSDP reduces gradients in fp32"]))
        self.need(YAFSDP_MODULE, "YaFSDP")
        self.drop_import_of(original.func)
        result = updated.with_changes(func=cst.Name("YaFSDP"),
                                      args=self._append(rebuild_args(updated.args, new_args), extra))
        self.comment_above(*lost_comments(updated, result, moved_comments))
        return result

    def _yafsdp_arg(self, name: str, old: cst.BaseExpression, module: str):
        """(YaFSDP keyword, new value node or None to keep the value) or (None, None) to drop."""
        if name in RENAMED:
            return (None, None) if is_literal(old, "None") and name == "process_group" else (RENAMED[name], None)
        if name == "sharding_strategy":
            return "zero_stage", cst.Integer(ZERO_STAGE[_fsdp1.strategy(old, self.fsdp)])
        if name == "mixed_precision":
            mp = _fsdp1.mixed_precision(old, self.fsdp)
            if isinstance(mp, str) or mp.param_dtype is None:
                return None, None
            return "param_dtype", cst.parse_expression(mp.param_dtype)
        if name == "auto_wrap_policy":
            policy = _fsdp1.policy(old, self.fsdp, self.qualified)
            if policy is None:
                return None, None
            var, label = self.fresh("submodule"), self.fresh("name")
            listing = (f"[({var}, {label}) for {label}, {var} in {module}.named_modules() "
                       f"if {var} is not {module} and {policy.cond(var)}]")
            return "modules_to_wrap_with_names", cst.parse_expression(listing)
        return None, None  # dropped (prefetch/rate-limit flags, cpu_offload=None...)

    @staticmethod
    def _append(args, extra: list[cst.Arg]) -> list[cst.Arg]:
        """Append keyword arguments, following the call's one-per-line layout if it has one."""
        args = list(args)
        if not args:
            return extra
        last = args[-1]
        comma = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else cst.Comma(
            whitespace_after=cst.SimpleWhitespace(" "))
        own = comma
        if (isinstance(last.comma, cst.Comma) and isinstance(last.comma.whitespace_after, cst.ParenthesizedWhitespace)
                and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)):
            # The next line gets the template's indentation; this line keeps its own comment.
            own = comma.with_changes(whitespace_after=comma.whitespace_after.with_changes(
                first_line=last.comma.whitespace_after.first_line))
        args[-1] = last.with_changes(comma=own, whitespace_after_arg=cst.SimpleWhitespace(""))
        closing = last.comma
        if isinstance(closing, cst.Comma) and isinstance(closing.whitespace_after, cst.ParenthesizedWhitespace):
            closing = closing.with_changes(whitespace_after=closing.whitespace_after.with_changes(
                first_line=cst.TrailingWhitespace()))
        extra = [a.with_changes(comma=comma) for a in extra]
        extra[-1] = extra[-1].with_changes(comma=closing, whitespace_after_arg=last.whitespace_after_arg)
        return args + extra

    # -- other sites ---------------------------------------------------------------------

    def _method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        # fsdp_bridge's YaFSDP has no_sync, clip_grad_norm_, state_dict and load_state_dict.
        return updated

    def _static_method(self, original: cst.Call, updated: cst.Call, method: str) -> cst.BaseExpression:
        if method == "state_dict_type" and id(original) in self._sdt_with_items:
            return updated
        if method == "state_dict_type":
            self.todo("FB304", original, "FSDP.state_dict_type(...) used as a value", "YaFSDP's "
                      "state_dict() is always full; choose the state dict where it is taken")
            return updated
        self.todo("FB299", original, f"FullyShardedDataParallel.{method}(...)",
                  "no YaFSDP equivalent is known to the codemod")
        return updated

    def visit_With(self, node: cst.With) -> None:
        self._state_dict.append(None)

    def leave_With(self, original: cst.With, updated: cst.With):
        self._state_dict.pop()
        for item in original.items:
            call = item.item
            if not (isinstance(call, cst.Call) and (self.fsdp(call.func) or "") == f"{FSDP1}.state_dict_type"):
                continue
            args = call_arguments(call, _fsdp1.STATE_DICT_TYPE_PARAMS) or {}
            kind = self.fsdp(args["state_dict_type"].value) if "state_dict_type" in args else None
            if self._configures_elsewhere(original, dotted(args["module"].value) if "module" in args else None):
                self.todo("FB209", original, "with FSDP.state_dict_type(...)", "the block does more than "
                          "take this model's state dict (calls made elsewhere read the setting): YaFSDP's "
                          "state_dict() is always full; check what those calls save, then remove the block")
                return updated
            if kind != "StateDictType.FULL_STATE_DICT" or len(original.items) > 1 or item.asname:
                self.todo("FB304", original, "FSDP.state_dict_type(...)", "YaFSDP's state_dict() is "
                          "always full; other state-dict types have no YaFSDP form")
                return updated
            self.site("FB304", IN_PLACE, original, "with FSDP.state_dict_type(FULL_STATE_DICT)",
                      "YaFSDP's state_dict() is already a full state dict")
            self.drop_import_of(call.func)
            for arg in call.args[1:]:
                self.drop_import_of(arg.value)
            return self._unwrap(updated)
        return updated
