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
FB105  `isinstance(x, FSDP)` -> `isinstance(x, FSDPModule)`, or `isinstance(x, (FSDPModule, FSDP))`
       when the tree keeps FSDP1 constructors (see [Note: what the tree keeps of FSDP1] in _common).
FB106  `model.module` on a wrapped model -> `model`.
FB107  `FSDP.fsdp_modules`, `scatter_full_optim_state_dict`, `model.no_sync` as a value -> runtime helpers.
FB208  `FSDP.state_dict_type(...)` used as a value (held in a variable, returned by a helper)
       -> `fsdp1_state_dict_type(...)`; the file's state-dict calls then ask the runtime helper.
FB110  a dropped FSDP1 argument carried a comment: the comment moves into a TODO.
FB2xx  left with a TODO: FSDP subclasses (201), `partial(FSDP, ...)` (202), private internals
       (203), `LOCAL_STATE_DICT` (204), `summon_full_params` (205), `enable_wrap`/`wrap` (206),
       `set_state_dict_type` (207), a `with FSDP.state_dict_type(...)` that configures calls
       made elsewhere (209), a name bound to FSDP1 or to something else depending on a branch
       (210), `import *` of an FSDP module (211), `type(x) is FSDP` (212), a read of
       `.sharding_strategy` (213), any other FSDP1 API use (299).
FB400  FSDP configured through Hugging Face Trainer / accelerate arguments (report only).
FB410  code that already handles FSDP1 and FSDP2 (both names in one function): left as is.

[Note: which receivers are FSDP modules]
`model.state_dict()` means something else on an FSDP1 module than on an FSDP2 one, so the rewrite
depends on what `model` is. A receiver is *proven* when scope analysis (libcst's ScopeProvider)
shows every assignment that can reach it is `FSDP(...)`, or one top-level `model = FSDP(...)` in
the same function follows all other assignments and precedes the use. `self.x` is proven when
every `self.x = ...` in the class assigns `FSDP(...)` (or None). A receiver whose *name* is
assigned from `FSDP(...)` somewhere else in the file is *maybe* one: its calls go through runtime
helpers that check `isinstance` when the script runs. Other receivers are not touched.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Sequence

import libcst as cst
import libcst.matchers as m
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.codemod.visitors._remove_imports import RemovedNodeVisitor
from libcst.metadata import ScopeProvider

from codemods import _fsdp1
from codemods._common import (
    IN_PLACE,
    FILE_FACTS_KEY,
    INFO,
    PRIVATE_ATTRIBUTES,
    RUNTIME,
    RUNTIME_MODULE,
    FsdpCodemod,
    call_arguments,
    comments_in,
    fsdp_module,
    fsdp_name,
    dotted,
    is_literal,
    is_private_fsdp1,
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
# Names that show code already speaks FSDP2 (dual-dialect detection, FB410).
FSDP2_NAMES = {"FSDPModule", "fully_shard", "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy"}
FSDP2_MARKERS = {"fsdp_version"}
STATE_DICT_TYPE = f"{FSDP1}.state_dict_type"
STATE_DICT_METHODS = ("state_dict", "load_state_dict")
# FSDP1 static signatures we translate (arguments past these make the site a TODO).
OPTIM_SIGNATURES = {
    "optim_state_dict": ("model", "optim", "optim_state_dict", "group"),
    "full_optim_state_dict": ("model", "optim", "optim_input", "rank0_only", "group"),
    "optim_state_dict_to_load": ("model", "optim", "optim_state_dict", "is_named_optimizer", "load_directly", "group"),
    "scatter_full_optim_state_dict": ("full_optim_state_dict", "model", "optim_input", "optim", "group"),
    "fsdp_modules": ("module", "root_only"),
}
PROVEN, MAYBE = "proven", "maybe"
# Receivers whose state dict is not a model's (only to keep the report short: routing them would be
# harmless, the helpers leave anything without FSDP2 units alone).
NOT_A_MODEL = re.compile(r"optim|sched|scaler|sampler|loader|tokenizer|generator|^opt$|^lr", re.IGNORECASE)
KEPT = "kept"  # a state_dict_type block left as it was (FB204/FB209)
# What FSDP(...) becomes through the runtime helpers: their arguments are FSDP1's, translated
# when the script runs (a second run must not flag them).
RUNTIME_CONSTRUCTORS = {f"{RUNTIME_MODULE}.fsdp1_fully_shard", f"{RUNTIME_MODULE}.fsdp1_to_yafsdp"}


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
    UNWRAP_REASON = "fully_shard works in place: the wrapped model is the model"
    # Type checks: always accept FSDP1 too, whatever the tree keeps?
    ACCEPT_FSDP1_TOO = False
    # Why a read of `.sharding_strategy` no longer means what it did (FB213).
    STRATEGY_READ_REASON = (
        "fully_shard modules have no sharding_strategy attribute (the read fails on the migrated "
        "model, or finds an attribute of the model itself) and FSDP2 states the strategy as "
        "reshard_after_forward plus the mesh's shape, so a test of a ShardingStrategy value may no "
        "longer describe how the model is sharded: check what this code decides with it")
    ROUTE_NO_SYNC_REFERENCES = True  # `model.no_sync` as a value -> functools.partial(fsdp1_no_sync, model)

    METADATA_DEPENDENCIES = (*FsdpCodemod.METADATA_DEPENDENCIES, ScopeProvider)

    def __init__(self, context) -> None:
        super().__init__(context)
        self._wrapped: set[str] = set()  # "model", "self.model": assigned from FSDP(...) somewhere in this file
        self._fsdp_targets: set[int] = set()  # ids of the Name targets of `x = FSDP(...)`
        self._top_level_targets: set[int] = set()  # ... of those that are a top-level statement of their scope
        self._class_attrs: dict = {}  # id(ClassDef) -> `self.x` names only ever assigned FSDP(...)
        self._classes: list[cst.ClassDef] = []
        self._called: set[int] = set()  # ids of expressions that are a call's function
        self._store_targets: set[int] = set()  # ids of attributes that are assigned to
        self._sdt_with_items: set[int] = set()  # FSDP.state_dict_type calls written as a `with` item
        self._runtime_sdt = False  # some state_dict_type is a value: state-dict calls ask the helper
        self._has_fsdp2 = False
        self._uses_fsdp1 = False
        self._claimed: set[int] = set()  # ids of FSDP1-class references a handler takes care of
        self._statement_calls: set[int] = set()  # calls that are a whole statement's value
        self._expand_no_sync: set[int] = set()
        self._state_dict: list[tuple[str | None, str, str]] = []  # (model, model opts, optim opts)
        self._in_import = 0
        self._names: set[str] = set()
        self._fsdp_file = False  # the file names FSDP1 or ShardingStrategy (FB213 applies)
        self._in_constructor = 0  # inside the arguments of an FSDP(...) call (or its rewrite)
        self._constructors: set[int] = set()

    # -- file-level facts ----------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self._removed_nodes = None
        facts = _Facts()
        node.visit(facts)  # one plain pass: libcst's matchers.findall costs several times more per pass
        heads = {(self.fsdp(n) or "").split(".")[0] for n in facts.names}
        self._uses_fsdp1 = FSDP1 in heads
        self._fsdp_file = self._uses_fsdp1 or "ShardingStrategy" in heads
        self._names = {n.value for n in facts.names if isinstance(n, cst.Name)}
        if not self._uses_fsdp1:
            return
        self._has_fsdp2 = any(self.fsdp(n) in FSDP2_NAMES for n in facts.names) or bool(self._names & FSDP2_MARKERS)
        for assign, cls in facts.assigns:
            targets = [t.target for t in assign.targets] if isinstance(assign, cst.Assign) else [assign.target]
            self._store_targets.update(id(t) for t in targets)
            is_fsdp = isinstance(assign.value, cst.Call) and self.fsdp(assign.value.func) == FSDP1
            if is_fsdp:
                self._wrapped.update(d for d in map(dotted, targets) if d)
                self._fsdp_targets.update(id(t) for t in targets if isinstance(t, cst.Name))
            if cls is not None and isinstance(assign, cst.Assign):
                self._note_self_attributes(cls, assign, is_fsdp)
        self._class_attrs = {key: {name for name, ok in verdict.items() if ok}
                             for key, verdict in self._class_attrs.items()}
        self._top_level_targets = {
            id(t.target) for body in [node.body, *facts.function_bodies] for line in body
            if isinstance(line, cst.SimpleStatementLine) for small in line.body if isinstance(small, cst.Assign)
            for t in small.targets if id(t.target) in self._fsdp_targets
        }
        for with_node in facts.withs:
            self._sdt_with_items.update(id(item.item) for item in with_node.items
                                        if isinstance(item.item, cst.Call) and self.fsdp(item.item.func) == STATE_DICT_TYPE)
        self._runtime_sdt = any(self.fsdp(call.func) == STATE_DICT_TYPE and id(call) not in self._sdt_with_items
                                for call in facts.attribute_calls)
        if facts.branch_imports:
            self.remove_unused_imports = False  # an import in a branch: removing it may empty the branch

    def _note_self_attributes(self, cls: cst.ClassDef, assign: cst.Assign, is_fsdp: bool) -> None:
        """Track `self.x` only ever assigned `FSDP(...)` (or None) in this class."""
        verdict = self._class_attrs.setdefault(id(cls), {})
        for target in assign.targets:
            if isinstance(target.target, cst.Attribute) and dotted(target.target.value) == "self":
                name = target.target.attr.value
                if is_fsdp:
                    verdict.setdefault(name, True)
                elif not is_literal(assign.value, "None"):
                    verdict[name] = False

    # -- receivers (see [Note: which receivers are FSDP modules]) --------------------------

    def receiver(self, node: cst.BaseExpression) -> str | None:
        """PROVEN, MAYBE or None for the receiver of a method call such as `model.state_dict()`."""
        name = dotted(node)
        if name is None:
            return None
        if isinstance(node, cst.Name) and self._proven_name(node):
            return PROVEN
        if (isinstance(node, cst.Attribute) and dotted(node.value) == "self" and self._classes
                and node.attr.value in self._class_attrs.get(id(self._classes[-1]), ())):
            return PROVEN
        return MAYBE if name in self._wrapped else None

    def _proven_name(self, node: cst.Name) -> bool:
        if not self._fsdp_targets:
            return False
        scope = self.get_metadata(ScopeProvider, node, None)
        if scope is None:
            return False
        referents = {r for access in scope.accesses[node.value] if access.node is node for r in access.referents}
        fsdp = [r for r in referents if id(getattr(r, "node", None)) in self._fsdp_targets]
        if not fsdp:
            return False
        if len(fsdp) == len(referents):
            return True
        # One top-level `x = FSDP(...)` after every other assignment and before this use.
        if len(fsdp) != 1 or id(fsdp[0].node) not in self._top_level_targets:
            return False
        line = self.line_of(fsdp[0].node)
        others = referents - set(fsdp)
        return self.line_of(node) > line and all(
            isinstance(getattr(r, "node", None), cst.CSTNode) and 0 < self.line_of(r.node) < line for r in others
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
        if not self.remove_unused_imports:
            return
        if isinstance(node, (cst.Import, cst.ImportFrom)):
            RemoveImportsVisitor.remove_unused_import_by_node(self.context, node)
            return
        # What remove_unused_import_by_node does, with one visitor per file: building a libcst
        # matcher visitor costs more than the visit itself.
        if self._removed_nodes is None:
            self._removed_nodes = RemovedNodeVisitor(self.context)
        node.visit(self._removed_nodes)

    # -- bookkeeping visits --------------------------------------------------------------

    def visit_Import(self, node) -> None:
        self._in_import += 1
        for alias in node.names:
            if is_private_fsdp1(code(alias.name)):
                self.todo("FB203", node, f"import {code(alias.name)}", "private FSDP1 internals have no FSDP2 form")

    def leave_Import(self, original, updated):
        self._in_import -= 1
        return updated

    def visit_ImportFrom(self, node) -> None:
        self._in_import += 1
        module = code(node.module) if node.module else ""
        if is_private_fsdp1(module) and not node.relative:
            self.todo("FB203", node, f"from {module} import ...", "private FSDP1 internals have no FSDP2 form")
        elif isinstance(node.names, cst.ImportStar) and not node.relative and fsdp_module(module):
            self.todo("FB211", node, f"from {module} import *", "names from a star import cannot be "
                      "resolved, so nothing in this file is translated: import the names you use "
                      "explicitly and run the migration again")
            self.keeps_fsdp1("FB211", node)

    def leave_ImportFrom(self, original, updated):
        self._in_import -= 1
        return updated

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        for small in node.body:
            value = getattr(small, "value", None)
            if isinstance(small, (cst.Assign, cst.AnnAssign, cst.Return, cst.Expr)) and isinstance(value, cst.Call):
                self._statement_calls.add(id(value))

    def visit_Call(self, node: cst.Call) -> None:
        self._called.add(id(node.func))
        name = self.fsdp(node.func) or ""
        if name == FSDP1 or self.qualified(node.func) & RUNTIME_CONSTRUCTORS:
            self._in_constructor += 1
            self._constructors.add(id(node))
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
        if qualified & ACCELERATE_PLUGIN or keywords & {"fsdp", "fsdp_config"}:
            self.keeps_fsdp1("FB400", node)  # the library wraps the model, with FSDP1 by default
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
        if isinstance(node, cst.Name) and self.ambiguous(node):
            self.todo("FB210", node, node.value, "this name is FSDP's or another object depending on "
                      "which import ran (conditional or fallback import): left as it was")
            if FSDP1 in {fsdp_name(q) for q in self.qualified(node)}:
                self.keeps_fsdp1("FB210", node)
            return
        if self.fsdp(node) == FSDP1:
            self.todo("FB299", node, code(node), "FullyShardedDataParallel is used in a way "
                      "the codemod does not translate; FSDP2 has no wrapper class (see FSDPModule)")
            self.keeps_fsdp1("FB299", node)  # e.g. passed on as a class to build wrappers with
            return
        for name in self.qualified(node):
            if is_private_fsdp1(name):
                self.todo("FB203", node, code(node), "private FSDP1 internals have no FSDP2 form")
                return

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        self._check_reference(original)
        if (original.attr.value == "sharding_strategy" and self._fsdp_file and not self._in_import
                and not self._in_constructor and id(original) not in self._store_targets):
            # In FSDP(..., sharding_strategy=cfg.sharding_strategy) the constructor's translation
            # takes the value; anywhere else the read may no longer mean the same.
            self.todo("FB213", original, f"{code(original)} (a read of an FSDP1 sharding strategy)",
                      self.STRATEGY_READ_REASON)
        if original.attr.value in PRIVATE_ATTRIBUTES and self._uses_fsdp1 and not self._in_import:
            self.todo("FB203", original, f".{original.attr.value}",
                      "FSDP1's wrapper internals do not exist in FSDP2 (no wrapper, no flat parameter)")
        if not self._uses_fsdp1 or id(original) in self._store_targets:
            return updated
        if original.attr.value == "module":
            return self._module_attribute(original, updated)
        if original.attr.value == "no_sync" and id(original) not in self._called and self.ROUTE_NO_SYNC_REFERENCES:
            self.site("FB107", RUNTIME, original, f"{code(original)} (not called)", "a method reference: "
                      "functools.partial(fsdp1_no_sync, ...) gives the same context manager")
            self.need(RUNTIME_MODULE, "fsdp1_no_sync")
            self.need("functools")
            return cst.Call(func=parse_expr("functools.partial"), args=[
                cst.Arg(cst.Name("fsdp1_no_sync"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))),
                cst.Arg(updated.value)])
        return updated

    def _module_attribute(self, original: cst.Attribute, updated: cst.Attribute):
        kind = self.receiver(original.value)
        if kind == PROVEN:
            self.site("FB106", IN_PLACE, original, f"{code(original.value)}.module", self.UNWRAP_REASON)
            return updated.value
        if kind == MAYBE:
            self.site("FB106", RUNTIME, original, f"{code(original.value)}.module",
                      f"{code(original.value)} is not proven to be the wrapped model here: "
                      "fsdp1_unwrap() gives the model itself for a sharded one and .module otherwise")
            self.need(RUNTIME_MODULE, "fsdp1_unwrap")
            return cst.Call(func=cst.Name("fsdp1_unwrap"), args=[cst.Arg(updated.value)])
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if not (self._has_fsdp2 and self._uses_fsdp1):
            return True
        facts = _Facts()
        node.visit(facts)
        names = facts.names
        fsdp1 = any((self.fsdp(n) or "").split(".")[0] == FSDP1 for n in names)
        fsdp2 = any(self.fsdp(n) in FSDP2_NAMES or (isinstance(n, cst.Name) and n.value in FSDP2_MARKERS)
                    for n in names)
        if fsdp1 and fsdp2:
            self.site("FB410", INFO, node, f"def {node.name.value}(...)", "already handles FSDP1 and "
                      "FSDP2 (both are named here): left as it was")
            if any(self.fsdp(call.func) == FSDP1 for call in m.findall(node, m.Call())):
                self.keeps_fsdp1("FB410", node)
            return False
        return True

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._classes.append(node)
        for base in node.bases:
            if self.fsdp(base.value) == FSDP1:
                self._claim(base.value)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self._classes.pop()
        for base in original.bases:
            if self.fsdp(base.value) == FSDP1:
                self.todo("FB201", original, f"class {original.name.value}(FullyShardedDataParallel)",
                          "FSDP2 is not a wrapper class to subclass; move the overrides onto the "
                          "model and call fully_shard on it")
                self.keeps_fsdp1("FB201", original)
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
        if id(original) in self._constructors:
            self._in_constructor -= 1
        if name == FSDP1:
            return self._constructor(original, updated)
        if name.startswith(FSDP1 + "."):
            return self._static_method(original, updated, name.split(".", 1)[1])
        if name in ("enable_wrap", "wrap"):
            self.todo("FB206", original, f"{name}(...)", "call fully_shard on each module after "
                      "construction, bottom-up, instead of wrap() inside enable_wrap()")
            self.keeps_fsdp1("FB206", original)
            return updated
        if _fsdp1.PARTIAL in qualified and original.args and self.fsdp(original.args[0].value) == FSDP1:
            self.todo("FB202", original, "partial(FullyShardedDataParallel, ...)", "FSDP2's fully_shard "
                      "works in place; call it where the partial is applied")
            self.keeps_fsdp1("FB202", original)
            return updated
        if qualified & {"builtins.isinstance", "builtins.issubclass"}:
            return self._isinstance(original, updated)
        if isinstance(original.func, cst.Attribute) and self._uses_fsdp1 and not self.imported(original.func):
            return self._method(original, updated)
        return updated

    def visit_Comparison(self, node: cst.Comparison) -> None:
        """`type(x) is FSDP`: FSDP2 gives each sharded module a class of its own, so no exact-class
        test has a translation; flag it (and do not count it as code that builds FSDP1 modules)."""
        operands = [node.left, *(target.comparator for target in node.comparisons)]
        classes = [op for op in operands if self.fsdp(op) == FSDP1]
        exact = any(isinstance(op, cst.Call) and "builtins.type" in self.qualified(op.func)
                    or isinstance(op, cst.Attribute) and op.attr.value == "__class__" for op in operands)
        if not classes or not exact:
            return
        for op in classes:
            self._claim(op)
        _, class_name, _, _ = self.WRAPPED_CLASS
        self.todo("FB212", node, f"{code(node)} (an exact-class test)", "the migrated model's class is "
                  f"not FullyShardedDataParallel: test isinstance(x, {class_name}) instead (with "
                  "FullyShardedDataParallel in the tuple while FSDP1 constructors remain)")

    def _accept_fsdp1_reason(self) -> str | None:
        """Why type checks must still accept FullyShardedDataParallel (None: they need not)."""
        elsewhere = self.fsdp1_kept_elsewhere()
        if elsewhere:
            shown = ", ".join(elsewhere[:3]) + (f" and {len(elsewhere) - 3} more" if len(elsewhere) > 3 else "")
            return f"FSDP1 constructors stay in the migrated tree ({shown}) and still build FSDP1 modules"
        if elsewhere is None:
            return ("this runner migrates one file at a time, so constructors left as FSDP1 in other "
                    "files cannot be known")
        if self.ACCEPT_FSDP1_TOO:
            return ("constructors the migration could not translate, here or in other files, still "
                    "build FSDP1 modules")
        return None

    def _isinstance(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if len(original.args) != 2:
            return updated
        classes, new_classes = original.args[1].value, updated.args[1].value
        module, class_name, rule, reason = self.WRAPPED_CLASS
        space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        keep_fsdp1 = self._accept_fsdp1_reason()

        def replacement(old: cst.BaseExpression) -> list[cst.Element]:
            if keep_fsdp1:
                return [cst.Element(cst.Name(class_name), comma=space), cst.Element(old)]
            return [cst.Element(cst.Name(class_name))]

        if self.fsdp(classes) == FSDP1:
            elements = replacement(new_classes)
            new_classes = elements[0].value if len(elements) == 1 else cst.Tuple(elements)
        elif isinstance(classes, cst.Tuple):
            if any(code(e.value) == class_name for e in classes.elements):
                return updated  # already accepts the new class (a second run)
            elements = []
            for old, new in zip(classes.elements, new_classes.elements):
                if self.fsdp(old.value) != FSDP1:
                    elements.append(new)
                    continue
                *head, last = replacement(new.value)
                elements += [*head, last.with_changes(comma=new.comma)]
            if len(elements) == len(new_classes.elements) and not any(
                    self.fsdp(e.value) == FSDP1 for e in classes.elements):
                return updated
            new_classes = new_classes.with_changes(elements=elements)
        else:
            return updated
        if keep_fsdp1:
            reason += f" (FullyShardedDataParallel is still accepted: {keep_fsdp1})"
        else:
            self.context.scratch[FILE_FACTS_KEY]["narrowed"] = True
        self.site(rule, IN_PLACE, original, "isinstance(..., FullyShardedDataParallel)", reason)
        self.need(module, class_name)
        if not keep_fsdp1:
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
            if id(original) in self._sdt_with_items:
                return updated  # handled as a `with` block, see leave_With
            return self._runtime_call(original, updated, "FB208", "fsdp1_state_dict_type", list(updated.args),
                                      "a state_dict_type context used as a value: the helper's context "
                                      "tells this file's state-dict calls (also routed) which options to use")
        args = self._static_args(original, updated, method)
        if args is None:
            self.todo("FB299", original, f"FullyShardedDataParallel.{method}(...)",
                      "no automatic FSDP2 translation for this FSDP1 API (or for these arguments)")
            return updated
        if method == "fsdp_modules":
            return self._runtime_call(original, updated, "FB107", "fsdp1_fsdp_modules", args,
                                      "the FSDP2 modules (FSDPModule instances) under the module")
        if method == "scatter_full_optim_state_dict":
            return self._runtime_call(original, updated, "FB107", "fsdp1_scatter_full_optim_state_dict", args,
                                      "set_optimizer_state_dict with broadcast_from_rank0; returns the "
                                      "loaded optimizer state")
        runtime_options = self._runtime_sdt and self._current_state_dict() is None
        if method in ("optim_state_dict", "full_optim_state_dict"):
            # get_optimizer_state_dict shares some tensors with the optimizer (Adam's step); FSDP1
            # returned copies, so the helper copies those.
            why = "get_optimizer_state_dict, with the entries it shares with the optimizer copied"
            if method == "full_optim_state_dict":
                # FSDP1's default is rank0_only=True: with cpu_offload, DCP gives the full dict on rank 0.
                options = "StateDictOptions(full_state_dict=True, cpu_offload=True)"
            elif runtime_options:
                options, why = None, why + "; options from the active fsdp1_state_dict_type context"
            else:
                options = self._optim_options()
            if options is not None:
                args = [*args, _arg("options", options)]
                self.need(DCP, "StateDictOptions")
            return self._runtime_call(original, updated, "FB104", "fsdp1_optim_state_dict", args, why)
        # optim_state_dict_to_load
        if not runtime_options:
            args = [*args, _arg("options", self._optim_options())]
            self.need(DCP, "StateDictOptions")
        return self._runtime_call(original, updated, "FB104", "fsdp1_optim_state_dict_to_load", args,
                                  "loads the state through set_optimizer_state_dict and returns the "
                                  "loaded optimizer state")

    def _static_args(self, original: cst.Call, updated: cst.Call, method: str) -> list[cst.Arg] | None:
        """The call's arguments in FSDP1's positional order, or None if it passes any we do not map."""
        signature = OPTIM_SIGNATURES.get(method)
        bound = call_arguments(original, signature) if signature else None
        if bound is None:
            return None
        required = {"fsdp_modules": 1, "scatter_full_optim_state_dict": 2}.get(method, 3 if method.endswith("_load") else 2)
        wanted = [*signature[:required]] + (["optim"] if method == "scatter_full_optim_state_dict" else [])
        defaults = {"root_only": "False", "optim_state_dict": "None", "group": "None", "optim_input": "None",
                    "is_named_optimizer": "False", "load_directly": "False", "rank0_only": "True"}
        if method == "optim_state_dict":
            defaults.pop("optim_state_dict")  # the no-argument form only
        for name, arg in bound.items():
            if name not in wanted and not (name in defaults and code(arg.value) == defaults[name]):
                return None
        if any(name not in bound for name in wanted):
            return None
        new_by_old = {id(old): new for old, new in zip(original.args, updated.args)}
        values = [new_by_old[id(bound[name])].value for name in wanted]
        space = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        return [cst.Arg(value, comma=space if i < len(values) - 1 else cst.MaybeSentinel.DEFAULT)
                for i, value in enumerate(values)]

    def _runtime_call(self, original, updated, rule: str, helper: str, args: list[cst.Arg], reason: str) -> cst.Call:
        self.site(rule, RUNTIME, original, code(original.func) + "(...)", reason)
        self.need(RUNTIME_MODULE, helper)
        if isinstance(original.func, cst.Attribute):
            self.drop_import_of(original.func)
        args = list(args)
        if args and len(args) > 1:
            args = [a.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))) for a in args[:-1]] + [
                args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
        return cst.Call(func=cst.Name(helper), args=args)

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
        if method == "no_sync" and not original.args:
            if id(original) in self._expand_no_sync:
                return updated
            self.site("FB102", RUNTIME, original, f"{code(original.func)}()",
                      "fsdp1_no_sync() toggles set_requires_gradient_sync on FSDP2 modules and "
                      "calls no_sync() on anything else")
            self.need(RUNTIME_MODULE, "fsdp1_no_sync")
            return cst.Call(func=cst.Name("fsdp1_no_sync"), args=[cst.Arg(updated.func.value)])
        if method not in ("clip_grad_norm_", "summon_full_params", *STATE_DICT_METHODS):
            return updated
        kind = self.receiver(original.func.value)
        if method == "clip_grad_norm_":
            if kind == PROVEN:
                self.site("FB103", IN_PLACE, original, f"{receiver}.clip_grad_norm_(...)",
                          "torch.nn.utils.clip_grad_norm_ over the parameters (returns a DTensor)")
                self.need("torch")
                params = cst.Arg(parse_expr(f"{receiver}.parameters()"), comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                return updated.with_changes(func=parse_expr("torch.nn.utils.clip_grad_norm_"),
                                            args=[params, *updated.args])
            self.site("FB103", RUNTIME, original, f"{code(original.func)}(...)",
                      f"{code(original.func.value)} is not proven to be assigned from FSDP(...) here; "
                      "fsdp1_clip_grad_norm_ dispatches at run time")
            self.need(RUNTIME_MODULE, "fsdp1_clip_grad_norm_")
            return updated.with_changes(func=cst.Name("fsdp1_clip_grad_norm_"),
                                        args=[cst.Arg(updated.func.value, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), *updated.args])
        if method == "summon_full_params":
            if kind is not None:
                rule, reason = UNTRANSLATED_STATICS[method]
                self.todo(rule, original, f"{receiver}.summon_full_params(...)", reason)
            return updated
        if self._in_kept_block():
            return updated  # the FSDP1 context stays, and with it the calls it configures
        current = self._current_state_dict()
        in_block = current is not None and receiver == current[0]
        if kind is None and receiver is not None and not NOT_A_MODEL.search(receiver.split(".")[-1]):
            # Any module may hold FSDP units in a file that uses FSDP1; the helper only changes
            # what a module holding FSDP2 units returns, so routing it is always safe.
            kind = MAYBE
        if not in_block and kind is None:
            return updated
        return self._model_state_dict(original, updated, receiver, method, kind, current if in_block else None)

    def _model_state_dict(self, original, updated, receiver: str, method: str, kind, block) -> cst.BaseExpression:
        if method == "state_dict" and original.args:
            return updated
        if method == "load_state_dict" and (len(original.args) != 1 or original.args[0].keyword or original.args[0].star):
            self.todo("FB299", original, f"{receiver}.load_state_dict(...)", "only the one-argument form is translated")
            return updated
        # The receiver as rewritten (`m.module` may have become `fsdp1_unwrap(m)`).
        model_arg = cst.Arg(updated.func.value, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        args = [model_arg.with_changes(comma=cst.MaybeSentinel.DEFAULT)] if method == "state_dict" else [
            model_arg, updated.args[0].with_changes(comma=cst.MaybeSentinel.DEFAULT)]
        if kind == PROVEN and (block is not None or not self._runtime_sdt):
            # Outside a state_dict_type block FSDP1 gives a full state dict; FSDP2 would give DTensors.
            options = block[1] if block is not None else "StateDictOptions(full_state_dict=True)"
            function = "get_model_state_dict" if method == "state_dict" else "set_model_state_dict"
            return self._dcp_call(original, updated, function, args, options)
        helper = "fsdp1_state_dict" if method == "state_dict" else "fsdp1_load_state_dict"
        if block is not None:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            args.append(_arg("options", block[1]))
            self.need(DCP, "StateDictOptions")
            why = "the block's options, applied if the receiver turns out to hold FSDP2 modules"
        else:
            why = "the options of an active fsdp1_state_dict_type context, FSDP1's FULL default otherwise"
        reason = (f"{receiver} is not proven to be the wrapped model here: " if kind != PROVEN else "") + \
            f"{helper}() checks for FSDP2 modules at run time ({why})"
        self.site("FB104", RUNTIME, original, f"{receiver}.{method}(...)", reason)
        self.need(RUNTIME_MODULE, helper)
        return cst.Call(func=cst.Name(helper), args=args)

    # -- with blocks ---------------------------------------------------------------------

    def _current_state_dict(self):
        """The innermost enclosing translated state_dict_type block: (model, model opts, optim opts)."""
        return next((ctx for ctx in reversed(self._state_dict) if ctx not in (None, KEPT)), None)

    def _in_kept_block(self) -> bool:
        return KEPT in self._state_dict

    def visit_With(self, node: cst.With) -> None:
        self._state_dict.append(None)
        for item in node.items:
            call = item.item
            if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
                continue
            if self.fsdp(call.func) == STATE_DICT_TYPE:
                context = self._state_dict_context(call)
                if context is None or item.asname is not None or self._configures_elsewhere(node, context[0]):
                    context = KEPT
                self._state_dict[-1] = context
            elif (call.func.attr.value == "no_sync" and not call.args and len(node.items) == 1
                  and self.receiver(call.func.value) == PROVEN and node.asynchronous is None):
                self._expand_no_sync.add(id(call))

    def _configures_elsewhere(self, node: cst.With, model: str | None) -> bool:
        """True unless the block's only business with the model is its own state-dict calls.

        `with FSDP.state_dict_type(trainer.model, ...): trainer.save_model()` configures a call
        made elsewhere (inside the library); dropping the context would change what it saves.
        So does a method called on the model or its owner, or either passed to a function.
        """
        if model is None:
            return True
        base, handled = model.split(".")[0], False
        for call in m.findall(node.body, m.Call()):
            func, name = call.func, self.fsdp(call.func) or ""
            if isinstance(func, cst.Attribute) and func.attr.value in STATE_DICT_METHODS and dotted(func.value) == model:
                handled = True
                continue
            if name.startswith(FSDP1 + ".") and name != STATE_DICT_TYPE:
                handled = True  # FSDP.optim_state_dict(model, optim) and friends
                continue
            leftmost = _leftmost(func) if isinstance(func, cst.Attribute) else None
            if isinstance(leftmost, cst.Name) and leftmost.value == base:
                return True
            for arg in call.args:
                passed = dotted(arg.value)
                if passed is not None and (passed == model or model.startswith(passed + ".")
                                           or passed.startswith(model + ".")):
                    return True
        return not handled

    def _state_dict_context(self, call: cst.Call):
        """(model name, model options code, optimizer options code) for a state_dict_type call."""
        args = call_arguments(call, STATE_DICT_TYPE_PARAMS)
        if args is None or "state_dict_type" not in args or "module" not in args:
            return None
        kind = self.fsdp(args["state_dict_type"].value) or ""
        if kind == "StateDictType.LOCAL_STATE_DICT":
            return None
        model = dotted(args["module"].value)
        if model is None:
            return None
        if kind in ("StateDictType.FULL_STATE_DICT", "StateDictType.SHARDED_STATE_DICT"):
            full = kind == "StateDictType.FULL_STATE_DICT"
            model_cfg = _fsdp1.state_dict_config(args.get("state_dict_config") and args["state_dict_config"].value, self.fsdp, False)
            optim_cfg = _fsdp1.state_dict_config(args.get("optim_state_dict_config") and args["optim_state_dict_config"].value, self.fsdp, True)
            if model_cfg is not None and optim_cfg is not None:
                return model, _options(full, *model_cfg), _options(full, *optim_cfg)
        # Non-literal type or configs: translate when the script runs.
        passed = ", ".join(f"{a.keyword.value}={code(a.value)}" if a.keyword else code(a.value)
                           for a in call.args if a is not args["module"])
        return (model, f"fsdp1_state_dict_options({passed})",
                f"fsdp1_state_dict_options({passed}, for_optimizer=True)")

    def leave_With(self, original: cst.With, updated: cst.With):
        context = self._state_dict.pop()
        for item in original.items:
            call = item.item
            if isinstance(call, cst.Call) and id(call) in self._expand_no_sync:
                return self._no_sync_block(original, updated, call)
        index = next((i for i, item in enumerate(original.items) if isinstance(item.item, cst.Call)
                      and self.fsdp(item.item.func) == STATE_DICT_TYPE), None)
        if index is None:
            return updated
        call = original.items[index].item
        if context is KEPT:
            kind = self.fsdp(call.args[1].value) if len(call.args) > 1 else None
            if kind == "StateDictType.LOCAL_STATE_DICT":
                self.todo("FB204", original, "state_dict_type(LOCAL_STATE_DICT)", "FSDP2 has no local "
                          "(flat-parameter) state dict; use the sharded DTensor state dict")
            else:
                self.todo("FB209", original, "with FSDP.state_dict_type(...)", "the block does more than "
                          "take this model's state dict (calls made elsewhere read the setting, or its "
                          "arguments cannot be read): pass StateDictOptions to get_/set_model_state_dict "
                          "where the state dict is taken, then remove the block")
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


def _leftmost(node: cst.BaseExpression) -> cst.BaseExpression:
    """`a` for `a.b.c`."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return node


class _Facts(cst.CSTVisitor):
    """What the codemod needs to know about a file before rewriting it, gathered in one pass."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[cst.BaseExpression] = []  # every Name and Attribute
        self.assigns: list[tuple[cst.BaseSmallStatement, cst.ClassDef | None]] = []  # and the class it is in
        self.function_bodies: list[Sequence[cst.BaseStatement]] = []
        self.withs: list[cst.With] = []
        self.attribute_calls: list[cst.Call] = []
        self.branch_imports = False  # an import inside an `if`/`try` (conditional or fallback)
        self._classes: list[cst.ClassDef] = []
        self._branches = 0

    def visit_Name(self, node) -> None:
        self.names.append(node)

    def visit_Attribute(self, node) -> None:
        self.names.append(node)

    def visit_Assign(self, node) -> None:
        self.assigns.append((node, self._classes[-1] if self._classes else None))

    visit_AnnAssign = visit_Assign

    def visit_ClassDef(self, node) -> None:
        self._classes.append(node)

    def leave_ClassDef(self, node) -> None:
        self._classes.pop()

    def visit_FunctionDef(self, node) -> None:
        if isinstance(node.body, cst.IndentedBlock):
            self.function_bodies.append(node.body.body)

    def visit_With(self, node) -> None:
        self.withs.append(node)

    def visit_Call(self, node) -> None:
        if isinstance(node.func, cst.Attribute):
            self.attribute_calls.append(node)

    def _enter(self, node) -> None:
        self._branches += 1

    def _exit(self, node) -> None:
        self._branches -= 1

    visit_If = visit_Try = visit_TryStar = _enter
    leave_If = leave_Try = leave_TryStar = _exit

    def visit_Import(self, node) -> None:
        self.branch_imports = self.branch_imports or self._branches > 0

    visit_ImportFrom = visit_Import


def _options(full: bool, offload_to_cpu: bool, rank0_only: bool) -> str:
    """StateDictOptions code for an FSDP1 state-dict config (torch_fsdp.md §6.7)."""
    if not full:
        return "StateDictOptions(full_state_dict=False)"
    # DCP's cpu_offload with a full state dict means "on rank 0 only, on CPU".
    if rank0_only:
        return "StateDictOptions(full_state_dict=True, cpu_offload=True)"
    return "StateDictOptions(full_state_dict=True)"
