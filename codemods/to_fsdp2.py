"""`--to fsdp2`: rewrite FSDP1 (`FullyShardedDataParallel`) code into native torch FSDP2.

    python -m libcst.tool codemod to_fsdp2.ToFsdp2Command PATH

What it does (rule codes appear in the report and in TODO comments):

FB100  `FSDP(model, ...)` with literal arguments -> bottom-up `fully_shard` calls, root last;
       a literal policy becomes a loop over the matching submodules.
FB101  `FSDP(model, ...)` with non-literal values -> `fsdp1_fully_shard(model, ...)` (same
       arguments; the runtime helper translates them when the script runs).
FB102  `with model.no_sync():` -> `set_requires_gradient_sync(False)` / `try` / `finally: True`.
FB103  `model.clip_grad_norm_(...)` -> `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`.
FB104  `with FSDP.state_dict_type(...)` blocks, `model.state_dict()`, `FSDP.optim_state_dict*`
       -> `torch.distributed.checkpoint.state_dict` calls with `StateDictOptions`.
FB105  `isinstance(x, FSDP)` -> `isinstance(x, FSDPModule)`.
FB106  `model.module` on a wrapped model -> `model`.
FB110  a dropped FSDP1 argument carried a comment: the comment moves into a TODO.
FB2xx  left with a TODO: FSDP subclasses (201), `partial(FSDP, ...)` (202), private internals
       (203), `LOCAL_STATE_DICT` (204), `summon_full_params` (205), `enable_wrap`/`wrap` (206),
       `set_state_dict_type` (207), any other FSDP1 API use (299).
FB400  FSDP configured through Hugging Face Trainer / accelerate arguments (report only).
"""

from __future__ import annotations

from collections import Counter

import libcst as cst
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor

from codemods import _fsdp1
from codemods._common import (
    IN_PLACE,
    PRIVATE_ATTRIBUTES,
    PRIVATE_FSDP_PREFIX,
    RUNTIME,
    RUNTIME_MODULE,
    FsdpCodemod,
    call_arguments,
    comments_in,
    dotted,
    is_literal,
    parse_expr,
    parse_stmt,
)
from codemods._fsdp1 import FSDP1_PARAMS, STATE_DICT_TYPE_PARAMS, code

FSDP1 = "FullyShardedDataParallel"
DCP = "torch.distributed.checkpoint.state_dict"
FSDP = "torch.distributed.fsdp"

# FSDP1 arguments FSDP2 does not need; why, for the report.
DROPPED = {
    "backward_prefetch": "FSDP2 always prefetches in backward (set_modules_to_backward_prefetch for custom orders)",
    "forward_prefetch": "FSDP2 has no forward_prefetch flag (set_modules_to_forward_prefetch)",
    "limit_all_gathers": "FSDP2 needs no all-gather rate limiter",
    "use_orig_params": "FSDP2 always exposes the original parameters",
    "device_id": "FSDP2 takes the device from the mesh; call torch.cuda.set_device(local_rank) first on GPUs",
}
# Static methods of the FSDP1 class we leave alone, with the reason.
UNTRANSLATED_STATICS = {
    "summon_full_params": ("FB205", "FSDP2 has no exact equivalent: use unshard()/reshard() on each "
                                    "FSDPModule or DTensor.full_tensor(); writeback semantics differ"),
    "set_state_dict_type": ("FB207", "FSDP2 has no persistent state-dict mode: pass StateDictOptions "
                                     "to get_/set_model_state_dict where the state dict is taken"),
}
HF_CONFIG_CALLS = {
    "transformers.TrainingArguments",
    "transformers.training_args.TrainingArguments",
    "transformers.Seq2SeqTrainingArguments",
    "trl.SFTConfig",
}
ACCELERATE_PLUGIN = {"accelerate.FullyShardedDataParallelPlugin", "accelerate.utils.FullyShardedDataParallelPlugin"}


def _arg(keyword: str, value: str) -> cst.Arg:
    return cst.Arg(value=parse_expr(value), keyword=cst.Name(keyword),
                   equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))


def rebuild_args(original: tuple[cst.Arg, ...], kept: list[cst.Arg]) -> list[cst.Arg]:
    """Arguments after some were removed, keeping the layout of the closing parenthesis."""
    if kept and original and kept[-1] is not original[-1]:
        last, own = original[-1], kept[-1].comma
        comma = last.comma
        if (isinstance(own, cst.Comma) and isinstance(comma, cst.Comma)
                and isinstance(own.whitespace_after, cst.ParenthesizedWhitespace)
                and isinstance(comma.whitespace_after, cst.ParenthesizedWhitespace)):
            # One argument per line: keep this line's own trailing comment, take the layout
            # of the line before the closing parenthesis.
            comma = comma.with_changes(whitespace_after=comma.whitespace_after.with_changes(
                first_line=own.whitespace_after.first_line, empty_lines=own.whitespace_after.empty_lines))
        kept[-1] = kept[-1].with_changes(comma=comma, whitespace_after_arg=last.whitespace_after_arg)
    return kept


def lost_comments(before: cst.CSTNode, after: cst.CSTNode, moved: list[str]) -> list[str]:
    """Comments of `before` that neither `after` nor the `moved` list still holds."""
    remaining = Counter(comments_in(code(before)))
    remaining.subtract(comments_in(code(after)))
    remaining.subtract(moved)
    return [comment for comment, count in remaining.items() for _ in range(count) if count > 0]


class ToFsdp2Command(FsdpCodemod):
    DESCRIPTION = "Rewrite FSDP1 (FullyShardedDataParallel) code into native torch FSDP2 (fully_shard)."
    # What `isinstance(x, FSDP)` becomes: (module, class, rule, reason).
    WRAPPED_CLASS = (FSDP, "FSDPModule", "FB105", "FSDP2 modules are instances of FSDPModule")
    UNWRAP_MODULE_ATTRIBUTE = True  # `model.module` -> `model` (fully_shard works in place)

    def __init__(self, context) -> None:
        super().__init__(context)
        self._wrapped: set[str] = set()  # "model", "self.model": assigned from FSDP(...) in this file
        self._uses_fsdp1 = False
        self._claimed: set[int] = set()  # ids of FSDP1-class references a handler takes care of
        self._statement_calls: set[int] = set()  # calls that are a whole statement's value
        self._expand_no_sync: set[int] = set()
        self._state_dict: list[tuple[str | None, str, str]] = []  # (model, model opts, optim opts)
        self._in_import = 0
        self._names: set[str] = set()

    # -- file-level facts ----------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        import libcst.matchers as m

        for assign in m.findall(node, m.Assign(value=m.Call()) | m.AnnAssign(value=m.Call())):
            if self.fsdp(assign.value.func) == FSDP1:
                targets = [t.target for t in assign.targets] if isinstance(assign, cst.Assign) else [assign.target]
                self._wrapped.update(d for d in map(dotted, targets) if d)
        self._names = {n.value for n in m.findall(node, m.Name())}
        self._uses_fsdp1 = any(
            (self.fsdp(n) or "").split(".")[0] == FSDP1 for n in m.findall(node, m.Name() | m.Attribute())
        )

    def fresh(self, base: str) -> str:
        name, index = base, 1
        while name in self._names:
            name, index = f"{base}_{index}", index + 1
        self._names.add(name)
        return name

    def need(self, module: str, obj: str | None = None) -> None:
        AddImportsVisitor.add_needed_import(self.context, module, obj)

    def drop_import_of(self, node: cst.CSTNode) -> None:
        if self.remove_unused_imports:
            RemoveImportsVisitor.remove_unused_import_by_node(self.context, node)

    # -- bookkeeping visits --------------------------------------------------------------

    def visit_Import(self, node) -> None:
        self._in_import += 1
        for alias in node.names:
            if (code(alias.name) + ".").startswith(PRIVATE_FSDP_PREFIX):
                self.todo("FB203", node, f"import {code(alias.name)}", "private FSDP1 internals have no FSDP2 form")

    def leave_Import(self, original, updated):
        self._in_import -= 1
        return updated

    def visit_ImportFrom(self, node) -> None:
        self._in_import += 1
        module = code(node.module) if node.module else ""
        if (module + ".").startswith(PRIVATE_FSDP_PREFIX):
            self.todo("FB203", node, f"from {module} import ...", "private FSDP1 internals have no FSDP2 form")

    def leave_ImportFrom(self, original, updated):
        self._in_import -= 1
        return updated

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        for small in node.body:
            value = getattr(small, "value", None)
            if isinstance(small, (cst.Assign, cst.AnnAssign, cst.Return, cst.Expr)) and isinstance(value, cst.Call):
                self._statement_calls.add(id(value))

    def visit_Call(self, node: cst.Call) -> None:
        name = self.fsdp(node.func) or ""
        if name == FSDP1 or name.startswith(FSDP1 + "."):
            self._claim(node.func)
        qualified = self.qualified(node.func)
        if qualified & {"builtins.isinstance", "builtins.issubclass"} and len(node.args) == 2:
            classes = node.args[1].value
            for item in [e.value for e in classes.elements] if isinstance(classes, cst.Tuple) else [classes]:
                if self.fsdp(item) == FSDP1:
                    self._claim(item)
        if _fsdp1.PARTIAL in qualified and node.args and self.fsdp(node.args[0].value) == FSDP1:
            self._claim(node.args[0].value)
        if name in ("enable_wrap", "wrap"):
            for arg in node.args:
                self._claim(arg.value)
        if qualified & (HF_CONFIG_CALLS | ACCELERATE_PLUGIN):
            self._report_config(node, qualified)

    def _claim(self, node: cst.CSTNode) -> None:
        self._claimed.add(id(node))
        if isinstance(node, cst.Attribute):
            self._claimed.add(id(node.value))

    def _report_config(self, node: cst.Call, qualified: set[str]) -> None:
        keywords = {a.keyword.value for a in node.args if a.keyword}
        if qualified & ACCELERATE_PLUGIN:
            self.site("FB400", "report only", node, "FullyShardedDataParallelPlugin(...)",
                      "FSDP is configured through accelerate: set fsdp_version=2 there "
                      "(`accelerate to-fsdp2` maps HYBRID_SHARD to plain sharding: check the mesh)")
        elif keywords & {"fsdp", "fsdp_config"}:
            self.site("FB400", "report only", node, "TrainingArguments(fsdp=...)",
                      "FSDP is configured through Hugging Face Trainer flags: set "
                      "fsdp_config={'version': 2, ...}; there is no FSDP code to rewrite here")

    # -- unhandled references and private internals --------------------------------------

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        self._check_reference(original)
        return updated

    def _check_reference(self, node: cst.CSTNode) -> None:
        if self._in_import or id(node) in self._claimed:
            return
        if self.fsdp(node) == FSDP1:
            self.todo("FB299", node, code(node), "FullyShardedDataParallel is used in a way "
                      "the codemod does not translate; FSDP2 has no wrapper class (see FSDPModule)")
            return
        for name in self.qualified(node):
            if name.startswith(PRIVATE_FSDP_PREFIX):
                self.todo("FB203", node, code(node), "private FSDP1 internals have no FSDP2 form")
                return

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        self._check_reference(original)
        if original.attr.value in PRIVATE_ATTRIBUTES and self._uses_fsdp1:
            self.todo("FB203", original, f".{original.attr.value}",
                      "FSDP1's wrapper internals do not exist in FSDP2 (no wrapper, no flat parameter)")
        receiver = dotted(original.value)
        if original.attr.value == "module" and receiver in self._wrapped and self.UNWRAP_MODULE_ATTRIBUTE:
            self.site("FB106", IN_PLACE, original, f"{receiver}.module", "fully_shard works in place: "
                      "the wrapped model is the model")
            return updated.value
        return updated

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        for base in node.bases:
            if self.fsdp(base.value) == FSDP1:
                self._claim(base.value)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        for base in original.bases:
            if self.fsdp(base.value) == FSDP1:
                self.todo("FB201", original, f"class {original.name.value}(FullyShardedDataParallel)",
                          "FSDP2 is not a wrapper class to subclass; move the overrides onto the "
                          "model and call fully_shard on it")
        return updated

    def visit_Annotation(self, node: cst.Annotation) -> None:
        if self.fsdp(node.annotation) == FSDP1:
            self._claim(node.annotation)

    def leave_Annotation(self, original: cst.Annotation, updated: cst.Annotation) -> cst.Annotation:
        if self.fsdp(original.annotation) != FSDP1:
            return updated
        module, class_name, rule, reason = self.WRAPPED_CLASS
        self.site(rule, IN_PLACE, original, "annotation FullyShardedDataParallel", reason)
        self.need(module, class_name)
        self.drop_import_of(original.annotation)
        return updated.with_changes(annotation=cst.Name(class_name))

    # -- calls ---------------------------------------------------------------------------

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        name = self.fsdp(original.func) or ""
        qualified = self.qualified(original.func)
        if name == FSDP1:
            return self._constructor(original, updated)
        if name.startswith(FSDP1 + "."):
            return self._static_method(original, updated, name.split(".", 1)[1])
        if name in ("enable_wrap", "wrap"):
            self.todo("FB206", original, f"{name}(...)", "call fully_shard on each module after "
                      "construction, bottom-up, instead of wrap() inside enable_wrap()")
            return updated
        if _fsdp1.PARTIAL in qualified and original.args and self.fsdp(original.args[0].value) == FSDP1:
            self.todo("FB202", original, "partial(FullyShardedDataParallel, ...)", "FSDP2's fully_shard "
                      "works in place; call it where the partial is applied")
            return updated
        if qualified & {"builtins.isinstance", "builtins.issubclass"}:
            return self._isinstance(original, updated)
        if isinstance(original.func, cst.Attribute) and self._uses_fsdp1 and not self.imported(original.func):
            return self._method(original, updated)
        return updated

    def _isinstance(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if len(original.args) != 2:
            return updated
        classes, new_classes = original.args[1].value, updated.args[1].value
        module, class_name, rule, reason = self.WRAPPED_CLASS
        fsdp_module = cst.Name(class_name)
        if self.fsdp(classes) == FSDP1:
            new_classes = fsdp_module
        elif isinstance(classes, cst.Tuple):
            elements = [
                new.with_changes(value=fsdp_module) if self.fsdp(old.value) == FSDP1 else new
                for old, new in zip(classes.elements, new_classes.elements)
            ]
            if elements == list(new_classes.elements):
                return updated
            new_classes = new_classes.with_changes(elements=elements)
        else:
            return updated
        self.site(rule, IN_PLACE, original, "isinstance(..., FullyShardedDataParallel)", reason)
        self.need(module, class_name)
        self.drop_import_of(classes)
        return updated.with_changes(args=[updated.args[0], updated.args[1].with_changes(value=new_classes)])

    # -- FSDP(...) -----------------------------------------------------------------------

    def _constructor(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        args = call_arguments(original, FSDP1_PARAMS)
        reasons = self._needs_runtime(original, args)
        if reasons:
            return self._via_runtime(original, updated, reasons)
        return self._in_place(original, updated, args)

    def _needs_runtime(self, call: cst.Call, args) -> list[str]:
        """Why this constructor call cannot be translated at migration time (empty: it can)."""
        if args is None:
            return ["the call passes *args/**kwargs"]
        if "module" not in args:
            return ["the module argument is missing"]
        values = {name: arg.value for name, arg in args.items()}
        reasons = []
        resolve = self.fsdp
        for name in ("process_group", "ignored_modules", "ignored_states", "param_init_fn"):
            if name in values and not is_literal(values[name], "None"):
                reasons.append(f"{name} needs run-time translation")
        if "sync_module_states" in values and not is_literal(values["sync_module_states"], "False"):
            reasons.append("sync_module_states needs a broadcast at run time")
        if _fsdp1.strategy(values.get("sharding_strategy"), resolve) not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            reasons.append("sharding_strategy is not a literal FULL_SHARD/SHARD_GRAD_OP "
                           "(hybrid and NO_SHARD need a 2-D mesh built at run time)")
        if "cpu_offload" in values and _fsdp1.cpu_offload(values["cpu_offload"], resolve) is None:
            reasons.append("cpu_offload is not a literal CPUOffload(...)")
        if "mixed_precision" in values and not is_literal(values["mixed_precision"], "None"):
            mp = _fsdp1.mixed_precision(values["mixed_precision"], resolve)
            if isinstance(mp, str):
                reasons.append(mp)
        policy = _fsdp1.policy(values.get("auto_wrap_policy"), resolve, self.qualified)
        if policy == "runtime":
            reasons.append("auto_wrap_policy is not a literal transformer/ModuleWrapPolicy/lambda policy")
        elif policy is not None:
            if dotted(values["module"]) is None:
                reasons.append("the wrapped module is an expression, not a name")
            if id(call) not in self._statement_calls or not self.at_statement:
                reasons.append("the call is nested in an expression, so no loop can precede it")
        return reasons

    def _via_runtime(self, original: cst.Call, updated: cst.Call, reasons: list[str]) -> cst.Call:
        self.site("FB101", RUNTIME, original, "FullyShardedDataParallel(...)", "; ".join(reasons))
        self.need(RUNTIME_MODULE, "fsdp1_fully_shard")
        self.drop_import_of(original.func)
        return updated.with_changes(func=cst.Name("fsdp1_fully_shard"))

    def _in_place(self, original: cst.Call, updated: cst.Call, args: dict[str, cst.Arg]) -> cst.Call:
        values = {name: arg.value for name, arg in args.items()}
        resolve = self.fsdp
        kwargs: dict[str, str] = {}  # FSDP2 keyword -> code, for the non-root loop
        new_args, dropped_notes, reasons, moved_comments = [], [], [], []
        by_id = {id(arg): name for name, arg in args.items()}
        for old, new in zip(original.args, updated.args):
            name = by_id[id(old)]
            translated = self._translate_arg(name, old.value, new.value, resolve)
            if name == "module":
                new_args.append(new)
            elif translated is None:
                if name in DROPPED and not is_literal(old.value, "None"):
                    reasons.append(f"dropped {name}: {DROPPED[name]}")
                elif name == "sharding_strategy":
                    reasons.append("FULL_SHARD is FSDP2's default (the root stays unsharded after forward)")
                comments = comments_in(code(old))
                moved_comments.extend(comments)
                if comments:
                    dropped_notes.append(f"{name}={code(old.value)} ({' '.join(comments)})")
                self.drop_import_of(old.value)
            else:
                keyword, root_code, loop_code = translated
                kwargs[keyword] = loop_code
                new_args.append(new.with_changes(
                    keyword=cst.Name(keyword), value=parse_expr(root_code),
                    equal=new.equal if new.keyword else cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")),
                ))
                self.drop_import_of(old.value)
        if dropped_notes:
            self.todo("FB110", original, "dropped FSDP1 arguments", "; ".join(dropped_notes))
        policy = _fsdp1.policy(values.get("auto_wrap_policy"), resolve, self.qualified)
        if policy is not None:
            self._insert_loop(code(values["module"]), policy, kwargs)
            reasons.insert(0, f"{policy.what} expanded into a loop of fully_shard calls")
            if "mp_policy" in kwargs:
                # FSDP1 wraps _module_classes_to_ignore (BatchNorm by default) in their own fp32
                # units under a policy; the rewrite does not. Say so rather than change it silently.
                reasons.append("BatchNorm modules, which FSDP1 keeps in fp32 under a wrap policy "
                               "with mixed precision, get the same mp_policy as their parent: "
                               "fully_shard them first with MixedPrecisionPolicy() if the model has any")
        self.site("FB100", IN_PLACE, original, "FullyShardedDataParallel(...)",
                  "; ".join(reasons) or "fully_shard with the same settings")
        self.need(FSDP, "fully_shard")
        self.drop_import_of(original.func)
        result = updated.with_changes(func=cst.Name("fully_shard"), args=rebuild_args(updated.args, new_args))
        self.comment_above(*lost_comments(updated, result, moved_comments))
        return result

    def _translate_arg(self, name, old, new, resolve):
        """(FSDP2 keyword, code for the root, code for other units), or None to drop."""
        if name == "sharding_strategy":
            return ("reshard_after_forward", "False", "False") if _fsdp1.strategy(old, resolve) == "SHARD_GRAD_OP" else None
        if name == "device_mesh":
            return ("mesh", code(new), code(new))
        if name == "cpu_offload":
            if not _fsdp1.cpu_offload(old, resolve):
                return None
            self.need(FSDP, "CPUOffloadPolicy")
            self.need("torch")
            # Pinned memory needs an accelerator (torch_fsdp.md §6.5).
            policy = "CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())"
            return ("offload_policy", policy, policy)
        if name == "mixed_precision":
            mp = _fsdp1.mixed_precision(old, resolve)
            if isinstance(mp, str):  # a literal None
                return None
            self.need(FSDP, "MixedPrecisionPolicy")
            if isinstance(old, cst.Call):
                self.drop_import_of(old.func)
            return ("mp_policy", mp.policy(root=True), mp.policy(root=False))
        if name == "auto_wrap_policy" and not is_literal(old, "None"):
            self._drop_policy_imports(old)
        return None

    def _drop_policy_imports(self, node: cst.BaseExpression) -> None:
        if isinstance(node, cst.Call):
            self.drop_import_of(node.func)
            for arg in node.args:
                self.drop_import_of(arg.value)

    def _insert_loop(self, module: str, policy: _fsdp1.Policy, kwargs: dict[str, str]) -> None:
        var = self.fresh("submodule")
        extra = "".join(f", {k}={v}" for k, v in kwargs.items())
        loop = parse_stmt(
            f"for {var} in reversed(list({module}.modules())):  # children before parents\n"
            f"    if {var} is not {module} and {policy.cond(var)}:\n"
            f"        fully_shard({var}{extra})\n"
        )
        self.insert_before(loop)

    # -- FSDP.<static method>(...) -------------------------------------------------------

    def _static_method(self, original: cst.Call, updated: cst.Call, method: str) -> cst.BaseExpression:
        if method in UNTRANSLATED_STATICS:
            rule, reason = UNTRANSLATED_STATICS[method]
            self.todo(rule, original, f"FullyShardedDataParallel.{method}(...)", reason)
            return updated
        if method == "state_dict_type":
            return updated  # handled as a `with` block, see leave_With
        if method == "optim_state_dict" and len(original.args) == 2 and not any(a.keyword or a.star for a in original.args):
            options = self._optim_options()
            return self._dcp_call(original, updated, "get_optimizer_state_dict", list(updated.args), options)
        if method == "full_optim_state_dict" and len(original.args) == 2 and not any(a.keyword or a.star for a in original.args):
            # FSDP1's default is rank0_only=True: with cpu_offload, DCP gives the full dict on rank 0.
            options = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
            return self._dcp_call(original, updated, "get_optimizer_state_dict", list(updated.args), options)
        if method == "optim_state_dict_to_load" and len(original.args) == 3 and not any(a.keyword or a.star for a in original.args):
            options = self._optim_options()
            self.site("FB104", RUNTIME, original, f"FSDP.{method}(...)", "loads the state through "
                      "set_optimizer_state_dict and returns the loaded optimizer state")
            self.need(RUNTIME_MODULE, "fsdp1_optim_state_dict_to_load")
            self.need(DCP, "StateDictOptions")
            self.drop_import_of(original.func)
            return cst.Call(func=cst.Name("fsdp1_optim_state_dict_to_load"),
                            args=[*updated.args, _arg("options", options)])
        self.todo("FB299", original, f"FullyShardedDataParallel.{method}(...)",
                  "no automatic FSDP2 translation for this FSDP1 API")
        return updated

    def _optim_options(self) -> str:
        current = self._current_state_dict()
        if current is not None:
            return current[2]
        self.need(DCP, "StateDictOptions")
        return "StateDictOptions(full_state_dict=True)"  # FSDP1's default state-dict type is FULL

    def _dcp_call(self, original, updated, function: str, args: list[cst.Arg], options: str) -> cst.Call:
        self.site("FB104", IN_PLACE, original, code(original.func) + "(...)",
                  f"{function} from torch.distributed.checkpoint.state_dict")
        self.need(DCP, function)
        self.need(DCP, "StateDictOptions")
        self.drop_import_of(original.func)
        last = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))) if args else None
        return cst.Call(func=cst.Name(function), args=[*args[:-1], last, _arg("options", options)] if last else
                        [_arg("options", options)])

    # -- model.<method>(...) -------------------------------------------------------------

    def _method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        method = original.func.attr.value
        receiver = dotted(original.func.value)
        known = receiver in self._wrapped
        if method == "no_sync" and not original.args:
            if id(original) in self._expand_no_sync:
                return updated
            self.site("FB102", RUNTIME, original, f"{code(original.func)}()",
                      "fsdp1_no_sync() toggles set_requires_gradient_sync on FSDP2 modules and "
                      "calls no_sync() on anything else")
            self.need(RUNTIME_MODULE, "fsdp1_no_sync")
            return cst.Call(func=cst.Name("fsdp1_no_sync"), args=[cst.Arg(updated.func.value)])
        if method == "clip_grad_norm_":
            if known:
                self.site("FB103", IN_PLACE, original, f"{receiver}.clip_grad_norm_(...)",
                          "torch.nn.utils.clip_grad_norm_ over the parameters (returns a DTensor)")
                self.need("torch")
                params = cst.Arg(parse_expr(f"{receiver}.parameters()"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                return updated.with_changes(func=parse_expr("torch.nn.utils.clip_grad_norm_"),
                                            args=[params, *updated.args])
            self.site("FB103", RUNTIME, original, f"{code(original.func)}(...)",
                      f"{code(original.func.value)} is not assigned from FSDP(...) in this file; "
                      "fsdp1_clip_grad_norm_ dispatches at run time")
            self.need(RUNTIME_MODULE, "fsdp1_clip_grad_norm_")
            return updated.with_changes(func=cst.Name("fsdp1_clip_grad_norm_"),
                                        args=[cst.Arg(updated.func.value, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *updated.args])
        if method == "summon_full_params" and known:
            rule, reason = UNTRANSLATED_STATICS[method]
            self.todo(rule, original, f"{receiver}.summon_full_params(...)", reason)
            return updated
        if known and method in ("state_dict", "load_state_dict"):
            return self._model_state_dict(original, updated, receiver, method)
        current = self._current_state_dict()
        if current is not None and receiver == current[0] and method in ("state_dict", "load_state_dict"):
            return self._model_state_dict(original, updated, receiver, method)
        return updated

    def _model_state_dict(self, original, updated, receiver: str, method: str) -> cst.BaseExpression:
        current = self._current_state_dict()
        in_block = current is not None and receiver == current[0]
        # Outside a state_dict_type block FSDP1 gives a full state dict; FSDP2 would give DTensors.
        options = current[1] if in_block else "StateDictOptions(full_state_dict=True)"
        model_arg = cst.Arg(parse_expr(receiver), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        if method == "state_dict" and not original.args:
            return self._dcp_call(original, updated, "get_model_state_dict", [model_arg], options)
        if method == "load_state_dict" and len(original.args) == 1 and not original.args[0].keyword:
            return self._dcp_call(original, updated, "set_model_state_dict", [model_arg, updated.args[0]], options)
        return updated

    # -- with blocks ---------------------------------------------------------------------

    def _current_state_dict(self):
        """The innermost enclosing state_dict_type block: (model, model opts, optim opts)."""
        return next((ctx for ctx in reversed(self._state_dict) if ctx is not None), None)

    def visit_With(self, node: cst.With) -> None:
        self._state_dict.append(None)
        for item in node.items:
            call = item.item
            if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
                continue
            if (self.fsdp(call.func) or "") == f"{FSDP1}.state_dict_type":
                self._state_dict[-1] = self._state_dict_context(call)
            elif (call.func.attr.value == "no_sync" and not call.args and len(node.items) == 1
                  and dotted(call.func.value) in self._wrapped and node.asynchronous is None):
                self._expand_no_sync.add(id(call))

    def _state_dict_context(self, call: cst.Call):
        """(model name, model options code, optimizer options code) for a state_dict_type call."""
        args = call_arguments(call, STATE_DICT_TYPE_PARAMS)
        if args is None or "state_dict_type" not in args or "module" not in args:
            return None
        kind = self.fsdp(args["state_dict_type"].value) or ""
        if kind == "StateDictType.LOCAL_STATE_DICT":
            return None
        model = dotted(args["module"].value)
        if kind in ("StateDictType.FULL_STATE_DICT", "StateDictType.SHARDED_STATE_DICT"):
            full = kind == "StateDictType.FULL_STATE_DICT"
            model_cfg = _fsdp1.state_dict_config(args.get("state_dict_config") and args["state_dict_config"].value, self.fsdp, False)
            optim_cfg = _fsdp1.state_dict_config(args.get("optim_state_dict_config") and args["optim_state_dict_config"].value, self.fsdp, True)
            if model_cfg is not None and optim_cfg is not None:
                return model, _options(full, *model_cfg), _options(full, *optim_cfg)
        # Non-literal type or configs: translate when the script runs.
        passed = ", ".join(code(a.value) for a in call.args[1:])
        return (model, f"fsdp1_state_dict_options({passed})",
                f"fsdp1_state_dict_options({passed}, for_optimizer=True)")

    def leave_With(self, original: cst.With, updated: cst.With):
        context = self._state_dict.pop()
        for item in original.items:
            call = item.item
            if isinstance(call, cst.Call) and id(call) in self._expand_no_sync:
                return self._no_sync_block(original, updated, call)
        index = next((i for i, item in enumerate(original.items) if isinstance(item.item, cst.Call)
                      and (self.fsdp(item.item.func) or "") == f"{FSDP1}.state_dict_type"), None)
        if index is None:
            return updated
        call = original.items[index].item
        if context is None or original.items[index].asname is not None:
            kind = self.fsdp(call.args[1].value) if len(call.args) > 1 else None
            if kind == "StateDictType.LOCAL_STATE_DICT":
                self.todo("FB204", original, "state_dict_type(LOCAL_STATE_DICT)", "FSDP2 has no local "
                          "(flat-parameter) state dict; use the sharded DTensor state dict")
            else:
                self.todo("FB299", original, "FSDP.state_dict_type(...)", "could not read its arguments")
            return updated
        status = RUNTIME if "fsdp1_state_dict_options" in context[1] else IN_PLACE
        self.site("FB104", status, original, "with FSDP.state_dict_type(...)",
                  "the block's state-dict calls take StateDictOptions instead")
        if status == RUNTIME:
            self.need(RUNTIME_MODULE, "fsdp1_state_dict_options")
        self.drop_import_of(call.func)
        for arg in call.args[1:]:
            self.drop_import_of(arg.value)
        if len(original.items) > 1:
            items = [it for i, it in enumerate(updated.items) if i != index]
            items[-1] = items[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
            return updated.with_changes(items=items)
        return self._unwrap(updated)

    def _unwrap(self, with_node: cst.With) -> cst.FlattenSentinel:
        """The block's statements at the with's level; header and footer comments kept."""
        suite = with_node.body
        if isinstance(suite, cst.SimpleStatementSuite):  # `with x: a; b` on one line
            suite = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=suite.body)])
        body = list(suite.body)
        carried = comments_in(code(with_node.body)) if suite is not with_node.body else (
            comments_in(code(suite.header)) + [line.comment.value for line in suite.footer if line.comment]
        )
        first = body[0].with_changes(leading_lines=[
            *with_node.leading_lines,
            *[cst.EmptyLine(comment=cst.Comment(c)) for c in carried],
            *body[0].leading_lines,
        ])
        return cst.FlattenSentinel([first, *body[1:]])

    def _no_sync_block(self, original: cst.With, updated: cst.With, call: cst.Call):
        receiver = dotted(call.func.value)
        self.site("FB102", IN_PLACE, original, f"with {receiver}.no_sync():",
                  "set_requires_gradient_sync(False), restored to True in a finally block")
        disable = parse_stmt(f"{receiver}.set_requires_gradient_sync(False)\n")
        restore = parse_stmt(f"{receiver}.set_requires_gradient_sync(True)\n")
        block = cst.Try(
            body=updated.body,
            finalbody=cst.Finally(body=cst.IndentedBlock(body=[restore])),
        )
        return cst.FlattenSentinel([disable.with_changes(leading_lines=updated.leading_lines), block])


def _options(full: bool, offload_to_cpu: bool, rank0_only: bool) -> str:
    """StateDictOptions code for an FSDP1 state-dict config (torch_fsdp.md §6.7)."""
    if not full:
        return "StateDictOptions(full_state_dict=False)"
    # DCP's cpu_offload with a full state dict means "on rank 0 only, on CPU".
    if rank0_only:
        return "StateDictOptions(full_state_dict=True, cpu_offload=True)"
    return "StateDictOptions(full_state_dict=True)"
