"""The walk shared by the codemods that rewrite FSDP1 code (`--to fsdp2`, `--to yafsdp`).

`Fsdp1Codemod` owns every libcst `visit_`/`leave_` method: it keeps the bookkeeping (are we in
an import, in an `FSDP(...)` call, which calls are a whole statement) and hands each node to the
rule family that deals with it. The shared families are mixed in here: the first pass
(`facts.py`), diagnostics, type checks and `.module`. A command adds its own translations by
defining the hooks below (`translate_constructor`, `translate_static_method`, `translate_method`,
`translate_no_sync_reference`) and, for `with` blocks, `visit_With`/`leave_With`.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ScopeProvider

from fsdp_bridge.codemods import rules
from fsdp_bridge.codemods.base import FsdpCodemod
from fsdp_bridge.codemods.diagnostics import WRAP_FUNCTIONS, DiagnosticsRules
from fsdp_bridge.codemods.facts import FactsMixin
from fsdp_bridge.codemods.fsdp1 import current_keywords
from fsdp_bridge.codemods.helpers import code, dotted
from fsdp_bridge.codemods.module_tree import COMPREHENSIONS, PARAMETER_READS, ModuleTreeRules
from fsdp_bridge.codemods.names import (
    ATTRIBUTE_BY_NAME,
    FSDP1,
    FSDP1_STATIC_METHODS,
    FSDP2_MARKERS,
    LOAD_SHARDED_OPTIMIZER,
    RUNTIME_CONSTRUCTORS,
    TYPE_CHECKS,
)
from fsdp_bridge.codemods.type_checks import TypeCheckRules
from fsdp_bridge.codemods.unwrap import UnwrapRule


class Fsdp1Codemod(FactsMixin, DiagnosticsRules, TypeCheckRules, ModuleTreeRules, UnwrapRule, FsdpCodemod):
    """Base of the codemods that read FSDP1 code; see the module docstring for the hooks."""

    METADATA_DEPENDENCIES = (*FsdpCodemod.METADATA_DEPENDENCIES, ScopeProvider)

    def __init__(self, context) -> None:
        super().__init__(context)
        self.called: set[int] = set()  # ids of expressions that are a call's function
        self.statement_calls: set[int] = set()  # calls that are a whole statement's value
        self.in_import = 0
        self.in_constructor = 0  # inside the arguments of an FSDP(...) call (or its rewrite)
        self.constructor_calls: set[int] = set()
        self.fsdp2_functions: list[bool] = []  # per enclosing function: does it speak FSDP2?
        self.version_guards: list[bool] = []  # per enclosing `if`: does it test fsdp_version(...)?
        self.type_guards: list[set[str]] = []  # per enclosing `if`: names it tests isinstance(x, FSDP)
        self.check_fns = 0  # inside an activation-checkpointing check_fn (a function or lambda)
        self.summoned: list[bool] = []  # per enclosing `with`: does it summon FSDP1's full parameters?

    # -- hooks: what a command translates ---------------------------------------------------

    def translate_constructor(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        raise NotImplementedError(f"{type(self).__name__} must translate FullyShardedDataParallel(...)")

    def translate_static_method(self, original: cst.Call, updated: cst.Call, method: str) -> cst.BaseExpression:
        raise NotImplementedError(f"{type(self).__name__} must translate FullyShardedDataParallel.{method}(...)")

    def translate_method(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """`x.method(...)` on a local object of a file that uses FSDP1 (default: unchanged)."""
        return updated

    def check_method_elsewhere(self, original: cst.Call) -> None:
        """`x.method(...)` in a file that names no FSDP1 class (default: nothing to say)."""

    def translate_sharded_optimizer_load(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        """`load_sharded_optimizer_state_dict(...)`, FSDP1's sharded optimizer resume (default: unchanged)."""
        return updated

    def translate_no_sync_reference(self, original: cst.Attribute, updated: cst.Attribute):
        """`model.no_sync` used as a value, not called (default: unchanged)."""
        return updated

    # -- module, imports, statements ------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        self.read_file_facts(node)  # which also reads the names imports bind

    def names_bound_by_imports(self, node: cst.Module) -> set[str] | None:
        return None  # until read_file_facts has read them

    def visit_Import(self, node: cst.Import | cst.ImportFrom) -> None:
        self.in_import += 1
        self.check_import(node)

    def leave_Import(self, original, updated):
        self.in_import -= 1
        return updated

    visit_ImportFrom, leave_ImportFrom = visit_Import, leave_Import

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        for small in node.body:
            value = getattr(small, "value", None)
            if isinstance(small, (cst.Assign, cst.AnnAssign, cst.Return, cst.Expr)) and isinstance(value, cst.Call):
                self.statement_calls.add(id(value))

    # -- definitions ------------------------------------------------------------------------

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        if node.name.value in self.check_fn_names:
            self.enter_check_fn(node.params)  # left by leave_FunctionDef, also for a function left as it is
        if self.handles_both_dialects(node):
            self.fsdp2_functions.append(True)  # popped by leave_FunctionDef all the same
            return False  # such a function is left as it is
        # (FSDP2 code matters where a receiver may hold an FSDP1 model: in files that use FSDP1)
        self.fsdp2_functions.append(self.uses_fsdp1 and self.speaks_fsdp2(node))
        self.check_fns += node.name.value in self.check_fn_names
        return True

    def leave_FunctionDef(self, original: cst.FunctionDef, updated: cst.FunctionDef) -> cst.FunctionDef:
        self.fsdp2_functions.pop()
        self.check_fns -= original.name.value in self.check_fn_names and self.check_fns > 0
        if original.name.value in self.check_fn_names:
            self.leave_check_fn()
        return updated

    def visit_Lambda(self, node: cst.Lambda) -> None:
        self.check_fns += id(node) in self.check_fn_lambdas
        if id(node) in self.check_fn_lambdas:
            self.enter_check_fn(node.params)

    def leave_Lambda(self, original: cst.Lambda, updated: cst.Lambda) -> cst.Lambda:
        self.check_fns -= id(original) in self.check_fn_lambdas
        if id(original) in self.check_fn_lambdas:
            self.leave_check_fn()
        return updated

    # -- loops and comprehensions (walks over the model, see module_tree.py) ---------------------

    def visit_For(self, node: cst.For) -> None:
        self.enter_loop(node)

    def leave_For(self, original: cst.For, updated: cst.For):
        self.leave_loop()
        return updated

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self._unread(node):
            return False  # left as it is, see [Note: statements no rule reads] in facts.py
        if isinstance(node, COMPREHENSIONS):
            self.enter_comprehension(node)
        elif isinstance(node, cst.With):
            self.summoned.append(any(self._summons(item.item) for item in node.items))
        return super().on_visit(node)

    def on_leave(self, original_node, updated_node):
        if self._unread(original_node):
            return updated_node
        if isinstance(original_node, COMPREHENSIONS):
            self.leave_comprehension()
        elif isinstance(original_node, cst.With):
            self.summoned.pop()
        return super().on_leave(original_node, updated_node)

    def _unread(self, node: cst.CSTNode) -> bool:
        return (isinstance(node, cst.BaseStatement) and self.statements_to_visit is not None
                and id(node) not in self.statements_to_visit)

    def _summons(self, item: cst.BaseExpression) -> bool:
        """`FSDP.summon_full_params(model)` or `model.summon_full_params()`: FSDP1 shows the original
        parameters inside (the walks there read what they read after the migration)."""
        if not isinstance(item, cst.Call) or not isinstance(item.func, cst.Attribute):
            return False
        return item.func.attr.value == "summon_full_params" and (
            self.fsdp(item.func) is not None or self.receiver(item.func.value) is not None)

    @property
    def in_fsdp2_function(self) -> bool:
        """Inside a function that works on FSDP2 modules (see `speaks_fsdp2`)."""
        return any(self.fsdp2_functions)

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self.classes.append(node)
        self.claim_bases(node)

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self.classes.pop()
        self.flag_subclass(original)
        return updated

    def visit_Annotation(self, node: cst.Annotation) -> None:
        self.claim_annotation(node)

    def leave_Annotation(self, original: cst.Annotation, updated: cst.Annotation) -> cst.Annotation:
        return self.translate_annotation(original, updated)

    # -- names and attributes ---------------------------------------------------------------

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        self.check_reference(original)
        return self.annotation_ref(original, updated)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.note_class_reads(node)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        self.check_attribute(original)
        if id(original) in self.annotation_refs:
            return self.annotation_ref(original, updated)
        if original.attr.value == "__class__" and self.uses_fsdp1:
            return self.translate_class_read(original, updated)
        if not self.uses_fsdp1 or id(original) in self.store_targets:
            return updated
        if original.attr.value == "module":
            return self.unwrap_module_attribute(original, updated)
        if original.attr.value == "no_sync" and id(original) not in self.called:
            return self.translate_no_sync_reference(original, updated)
        return updated

    def visit_If(self, node: cst.If) -> None:
        self.version_guards.append(any(n.value in FSDP2_MARKERS for n in m.findall(node.test, m.Name())))
        self.type_guards.append(self._tested_as_fsdp(node.test) if self.uses_fsdp1 else set())

    def visit_If_orelse(self, node: cst.If) -> None:
        self.type_guards[-1] = set()  # the `else` of `isinstance(x, FSDP)`: x is not tested as FSDP there

    def leave_If(self, original: cst.If, updated: cst.If):
        self.version_guards.pop()
        self.type_guards.pop()
        return updated

    def _tested_as_fsdp(self, test: cst.BaseExpression) -> set[str]:
        """`m` for each `isinstance(m, FSDP)` (or FSDPModule, or a tuple holding one) in `test`."""
        names = set()
        for call in m.findall(test, m.Call(args=[m.Arg(), m.Arg()])):
            if not self.qualified(call.func) & TYPE_CHECKS:
                continue
            classes = call.args[1].value
            items = [e.value for e in classes.elements] if isinstance(classes, cst.Tuple) else [classes]
            if any(self.fsdp(item) in (FSDP1, "FSDPModule") for item in items):
                names.add(dotted(call.args[0].value) or "")
        return names - {""}

    def guarded_as_fsdp(self, node: cst.BaseExpression) -> bool:
        """True inside the body of `if isinstance(node, FSDP):`; the check is widened or narrowed by the
        migration, and what the block reads of FSDP1's wrapper may not exist on the new class."""
        name = dotted(node)
        return name is not None and any(name in names for names in self.type_guards)

    @property
    def in_version_guard(self) -> bool:
        """Inside `if fsdp_version(model) == 1:` (or any branch of an `if` on fsdp_version): code
        that already chooses its dialect at run time; FSDP1-only reads there need no TODO."""
        return any(self.version_guards)

    def visit_Comparison(self, node: cst.Comparison) -> None:
        if not self.check_exact_class_test(node):
            self.note_class_reads(node)

    # -- calls --------------------------------------------------------------------------------

    def visit_Call(self, node: cst.Call) -> None:
        self.called.add(id(node.func))
        name = self.fsdp(node.func) or ""
        if name == FSDP1 or self.qualified(node.func) & RUNTIME_CONSTRUCTORS:
            self.in_constructor += 1
            self.constructor_calls.add(id(node))
        qualified = self.qualified(node.func)
        self.claim_call(node, name, qualified)
        if self.is_library_config(qualified):
            self.report_library_config(node, qualified)
        self.note_walking_call(node, qualified)

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        name = self.fsdp(original.func) or ""
        qualified = self.qualified(original.func)
        if id(original) in self.constructor_calls:
            self.in_constructor -= 1
        if name == FSDP1:  # (torch 2.0's keywords under their current names: the helpers take those)
            return self.translate_constructor(original, current_keywords(updated))
        if name.startswith(FSDP1 + "."):
            return self.translate_static_method(original, updated, name.split(".", 1)[1])
        if name in WRAP_FUNCTIONS:
            self.flag_wrap_call(original, name)
            return updated
        if self.is_partial_of_fsdp1(original, qualified):
            self.flag_partial(original)
            return updated
        if qualified & TYPE_CHECKS:
            if self.flag_unit_type_check(original):
                return updated
            return self.translate_type_check(original, updated)
        if qualified & ATTRIBUTE_BY_NAME:
            self.check_attribute_by_name(original)
        if "builtins.type" in qualified and self.uses_fsdp1:
            return self.translate_class_read(original, updated)
        if qualified & LOAD_SHARDED_OPTIMIZER and self.uses_fsdp1 and not self.in_fsdp2_function:
            return self.translate_sharded_optimizer_load(original, updated)
        if isinstance(original.func, cst.Attribute) and not self.imported(original.func):
            if self.uses_fsdp1:
                if original.func.attr.value in PARAMETER_READS and not any(self.summoned):
                    self.check_parameter_read(original)
                return self._static_through_instance(original, updated) or self.translate_method(original, updated)
            self.check_method_elsewhere(original)
        return updated

    def _static_through_instance(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression | None:
        """`model.optim_state_dict_to_load(model, optim, osd)`: one of FSDP1's static methods reached
        through an object that may hold an FSDP1 model; neither target class has it, so it is
        translated as `FSDP.<method>(...)` is (None: not such a call)."""
        method = original.func.attr.value
        if method not in FSDP1_STATIC_METHODS or self.receiver(original.func.value) is None:
            return None
        if method == "state_dict_type":
            self.todo(rules.OTHER_FSDP1_USE, original, f"{code(original.func)}(...)",
                      "FSDP1's state_dict_type reached through the model: the migrated model has no such method; "
                      "write FullyShardedDataParallel.state_dict_type(...) and migrate again, or pass "
                      "StateDictOptions where the state dict is taken")
            return updated
        return self.translate_static_method(original, updated, method)

    # -- shared by the constructor translations ------------------------------------------------

    def drop_policy_imports(self, node: cst.BaseExpression) -> None:
        """Let the imports of a dropped wrap policy (`partial(transformer_auto_wrap_policy, ...)`) go."""
        if isinstance(node, cst.Call):
            self.drop_import_of(node.func)
            for arg in node.args:
                self.drop_import_of(arg.value)
