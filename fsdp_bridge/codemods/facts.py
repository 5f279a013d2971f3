"""The first pass over a file: what the codemod must know before it rewrites anything.

One plain visit (`FileFacts`) collects names, assignments, `with` blocks and calls; `FactsMixin`
reads them into the answers the rule families ask: does the file use FSDP1 (and FSDP2), which
names hold an `FSDP(...)` result, which `state_dict_type` calls are `with` items.

[Note: which receivers are FSDP modules]
`model.state_dict()` means something else on an FSDP1 module than on an FSDP2 one, so the rewrite
depends on what `model` is. A receiver is *proven* when scope analysis (libcst's ScopeProvider)
shows every assignment that can reach it is `FSDP(...)`, or one top-level `model = FSDP(...)` in
the same function follows all other assignments and precedes the use. `self.x` is proven when
every `self.x = ...` in the class assigns `FSDP(...)` (or None). A receiver whose *name* is
assigned from `FSDP(...)` somewhere else in the file, passed to one of FSDP1's static methods
(`FSDP.state_dict_type(model, ...)`), a parameter annotated with the FSDP1 class, or a parameter
that a call in this file passes one of those names to (`accumulate(model, batches)` reaching
`def accumulate(wrapped, ...)`), or one tested by an enclosing `if isinstance(x, FSDP):`, is
*maybe* one: its calls go through runtime helpers that check `isinstance` when the script runs.
Other receivers are not touched: importing FSDP does not
make every `x.state_dict()` of the file an FSDP1 model's (it may be a DDP model, a scheduler, or
a module already sharded with `fully_shard`, whose state dict the helper would make full).
"""

from __future__ import annotations

import re
from typing import Sequence

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import ScopeProvider

from fsdp_bridge.codemods.fsdp1 import STATE_DICT_TYPE_PARAMS
from fsdp_bridge.codemods.helpers import call_arguments, dotted, is_literal
from fsdp_bridge.codemods.names import (
    ACCELERATE_PLUGIN,
    DTENSOR_MARKERS,
    FSDP1,
    FSDP1_FRAMEWORKS,
    FSDP1_STATIC_METHODS,
    FSDP1_WRAPPER_ATTRIBUTES,
    FSDP2_MARKERS,
    FSDP2_NAMES,
    HF_CONFIG_CALLS,
    PRIVATE_ATTRIBUTES,
    STATE_DICT_TYPE,
)

PROVEN, MAYBE = "proven", "maybe"

# [Note: statements no rule reads]
# Rebuilding every node of a large file costs as much as parsing it, and most statements of a
# training repository have nothing to do with FSDP. Every rule acts on a node that names one of a
# few things: an FSDP name (imported from a module whose path says so, or reached through an
# attribute chain that spells `fsdp`), a library setting that enables FSDP, or, in a file that
# uses FSDP1, a method or attribute of the wrapper (`state_dict`, `no_sync`, `parameters`,
# `type(...)` for class tests...). The first pass records which names and attributes each
# statement holds; the rewrite then visits only the statements holding one of those words and the
# statements around them (whose `with`, `if`, `for`, class and function the rules read), and leaves
# every other statement as it is, unvisited. Matching stays by qualified name: the words only
# choose where to look.
RULE_MODULES = re.compile(r"fsdp|FullyShardedDataParallel|torch\.distributed\.checkpoint", re.IGNORECASE)
RULE_WORDS = frozenset({"fsdp", "FullyShardedDataParallel", "load_sharded_optimizer_state_dict", "clip_grad_norm_",
                        *(name.split(".")[-1] for name in HF_CONFIG_CALLS | ACCELERATE_PLUGIN)})
# The last part of the FSDP names the first pass resolves (with the names FSDP imports bind).
FSDP_SPELLINGS = frozenset({FSDP1, "ShardingStrategy", *FSDP2_NAMES})
# What an FSDP1 model's code is read for, in a file that uses FSDP1.
FSDP1_RULE_WORDS = frozenset({
    "state_dict", "load_state_dict", "no_sync", "module", "_orig_mod", "summon_full_params", "sharding_strategy",
    "parameters", "named_parameters", "type", "__class__", "getattr", "hasattr",
    *FSDP1_STATIC_METHODS, *PRIVATE_ATTRIBUTES, *FSDP1_WRAPPER_ATTRIBUTES})


class FileFacts(cst.CSTVisitor):
    """What the codemod needs to know about a file before rewriting it, gathered in one pass."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[cst.BaseExpression] = []  # every Name and Attribute
        self.assigns: list[tuple[cst.BaseSmallStatement, cst.ClassDef | None]] = []  # and the class it is in
        self.function_bodies: list[Sequence[cst.BaseStatement]] = []
        self.functions: list[tuple[cst.FunctionDef, bool]] = []  # and whether it is a method
        self.withs: list[cst.With] = []
        self.attribute_calls: list[cst.Call] = []
        self.name_calls: list[cst.Call] = []  # `f(...)`: calls of a plain name
        self.branch_imports = False  # an import inside an `if`/`try` (conditional or fallback)
        self.imported_modules: set[str] = set()  # `a.b` of `import a.b` and `from a.b import c`
        self._classes: list[cst.ClassDef] = []
        self.class_names: set[str] = set()  # classes defined in the file
        self.check_fn_names: set[str] = set()  # `f` of `check_fn=f` (activation checkpointing)
        self.check_fn_lambdas: set[int] = set()  # ids of `check_fn=lambda m: ...`
        self._in_class: list[bool] = []  # per enclosing class or function: is it a class?
        self._branches = 0
        # See [Note: statements no rule reads].
        self.statement_words: dict[int, set[str]] = {}  # id(statement) -> names and attributes in it
        self.parent_statement: dict[int, int] = {}  # id(statement) -> id(enclosing statement), 0 at the top
        self.child_statements: dict[int, list[int]] = {}  # the other way round
        self._statements: list[int] = []
        self.bound_names: set[str] | None = set()  # every name an import binds (None after a star import)
        self.rule_bound_names: set[str] = set()  # ... by an import of something the rules read (see RULE_MODULES)
        self.fsdp2_bound_names: set[str] = set()  # ... to an FSDP2 name (`fully_shard`, `FSDPModule`...)

    # libcst's visitor looks up `visit_<Type>` and `visit_<Type>_<field>` by name for every node and
    # every field; this pass has no field hooks and looks its methods up once per type.
    _dispatch: dict[tuple[type, type, str], object] = {}

    def _method(self, kind: str, node: cst.CSTNode):
        key = (type(self), type(node), kind)
        method = self._dispatch.get(key)
        if method is None:
            method = self._dispatch[key] = getattr(type(self), f"{kind}_{type(node).__name__}", False)
        return method

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.BaseStatement):
            parent = self._statements[-1] if self._statements else 0
            self.parent_statement[id(node)] = parent
            self.child_statements.setdefault(parent, []).append(id(node))
            self.statement_words[id(node)] = set()
            self._statements.append(id(node))
        method = self._method("visit", node)
        return not method or method(self, node) is not False

    def on_leave(self, original_node: cst.CSTNode) -> None:
        method = self._method("leave", original_node)
        if method:
            method(self, original_node)
        if isinstance(original_node, cst.BaseStatement):
            self._statements.pop()

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass

    def _word(self, word: str) -> None:
        if self._statements:
            self.statement_words[self._statements[-1]].add(word)

    def visit_Name(self, node) -> None:
        self.names.append(node)
        self._word(node.value)

    def visit_Attribute(self, node) -> None:
        self.names.append(node)
        self._word(node.attr.value)

    def visit_SimpleString(self, node) -> None:
        if node.value[1:-1] in PRIVATE_ATTRIBUTES:  # getattr(p, "_flat_param")
            self._word(node.value[1:-1])

    def visit_Assign(self, node) -> None:
        self.assigns.append((node, self._classes[-1] if self._classes else None))

    visit_AnnAssign = visit_Assign

    def visit_ClassDef(self, node) -> None:
        self._classes.append(node)
        self.class_names.add(node.name.value)
        self._in_class.append(True)

    def leave_ClassDef(self, node) -> None:
        self._classes.pop()
        self._in_class.pop()

    def visit_FunctionDef(self, node) -> None:
        self.functions.append((node, bool(self._in_class) and self._in_class[-1]))
        self._in_class.append(False)
        if isinstance(node.body, cst.IndentedBlock):
            self.function_bodies.append(node.body.body)

    def leave_FunctionDef(self, node) -> None:
        self._in_class.pop()

    def visit_With(self, node) -> None:
        self.withs.append(node)

    def visit_Call(self, node) -> None:
        for arg in node.args:
            if arg.keyword is not None and arg.keyword.value == "check_fn":
                if isinstance(arg.value, cst.Lambda):
                    self.check_fn_lambdas.add(id(arg.value))
                elif isinstance(arg.value, cst.Name):
                    self.check_fn_names.add(arg.value.value)
        if isinstance(node.func, cst.Attribute):
            self.attribute_calls.append(node)
        elif isinstance(node.func, cst.Name):
            self.name_calls.append(node)

    def _enter(self, node) -> None:
        self._branches += 1

    def _exit(self, node) -> None:
        self._branches -= 1

    visit_If = visit_Try = visit_TryStar = _enter
    leave_If = leave_Try = leave_TryStar = _exit

    def visit_Import(self, node) -> None:
        self.branch_imports = self.branch_imports or self._branches > 0
        self.imported_modules.update(get_full_name_for_node(alias.name) or "" for alias in node.names)
        for alias in node.names:
            full = get_full_name_for_node(alias.name) or ""
            self._bind(alias.asname.name.value if alias.asname else full.split(".")[0], full, alias.asname is not None)

    def visit_ImportFrom(self, node) -> None:
        self.branch_imports = self.branch_imports or self._branches > 0
        if node.module is not None and not node.relative:
            self.imported_modules.add(get_full_name_for_node(node.module) or "")
        if isinstance(node.names, cst.ImportStar):
            self.bound_names = None
            return
        module = "." * len(node.relative) + (get_full_name_for_node(node.module) or "" if node.module else "")
        for alias in node.names:
            name = get_full_name_for_node(alias.name) or ""
            self._bind(alias.asname.name.value if alias.asname else name, f"{module}.{name}", True)

    def _bind(self, name: str, full: str, whole: bool) -> None:
        """`name` is bound to `full` by an import (`whole`: to all of it, not to its first package)."""
        if self.bound_names is not None:
            self.bound_names.add(name)
        if whole and (RULE_MODULES.search(full) or full.split(".")[-1] in RULE_WORDS):
            self.rule_bound_names.add(name)
            if full.split(".")[-1] in FSDP2_NAMES:
                self.fsdp2_bound_names.add(name)

    def words_under(self, statement: int) -> set[str]:
        """The names and attributes in a statement and in every statement inside it."""
        found, pending = set(), [statement]
        while pending:
            current = pending.pop()
            found |= self.statement_words.get(current, set())
            pending += self.child_statements.get(current, [])
        return found

    def statements_to_visit(self, words: set[str]) -> set[int]:
        """The statements holding one of `words`, and every statement around one of those."""
        found: set[int] = set()
        for statement, own in self.statement_words.items():
            if own & words:
                while statement and statement not in found:
                    found.add(statement)
                    statement = self.parent_statement[statement]
        return found


class FactsMixin:
    """The file-level facts of an FSDP1 codemod, and the receivers they prove (see the Note)."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self.wrapped_names: set[str] = set()  # "model", "self.model": assigned from FSDP(...) somewhere in this file
        # "model": passed as the module to an FSDP1 static method (state_dict_type, optim_state_dict...)
        self.fsdp1_arguments: set[str] = set()
        # "wrapped": a parameter annotated with the FSDP1 class, or passed one of the names above
        # by a call in this file (`accumulate(model, ...)` after `model = FSDP(...)`)
        self.fsdp1_parameters: set[str] = set()
        self.assigned_values: dict[int, cst.BaseExpression] = {}  # id(Name target) -> value of `x = value`
        self.config_arguments: set[int] = set()  # ids of the type and config arguments of state_dict_type calls
        self.fsdp_targets: set[int] = set()  # ids of the Name targets of `x = FSDP(...)`
        self.top_level_targets: set[int] = set()  # ... of those that are a top-level statement of their scope
        self.class_attributes: dict = {}  # id(ClassDef) -> `self.x` names only ever assigned FSDP(...)
        self.classes: list[cst.ClassDef] = []  # the classes being visited, innermost last
        self.store_targets: set[int] = set()  # ids of attributes that are assigned to
        self.state_dict_type_items: set[int] = set()  # FSDP.state_dict_type calls written as a `with` item
        self.runtime_state_dict_type = False  # some state_dict_type is a value: state-dict calls ask the helper
        self.has_fsdp2 = False
        self.uses_fsdp1 = False
        self.names_in_file: set[str] = set()
        self.built_by_own_classes: set[str] = set()  # "model": assigned an instance of a class of this file
        self.framework_file = False  # the file imports a framework that builds FSDP1 wrappers itself
        self.check_fn_names: set[str] = set()  # see FileFacts
        self.check_fn_lambdas: set[int] = set()
        self.fsdp_file = False  # the file names FSDP1 or ShardingStrategy (FB213 applies)
        self.uses_no_sync = False  # the file reads or calls some `x.no_sync` (gradient accumulation)
        self.statements_to_visit: set[int] | None = None  # see [Note: statements no rule reads]; None: all
        self.file_facts: FileFacts | None = None

    def read_file_facts(self, node: cst.Module) -> None:
        facts = FileFacts()
        node.visit(facts)  # one plain pass: libcst's matchers.findall costs several times more per pass
        self._bound_by_import = facts.bound_names
        self.statements_to_visit = None
        self.file_facts = facts
        # An FSDP name spells its own last part or is a name an FSDP import binds: only those are
        # resolved (resolving every name of a large file costs more than this whole pass).
        spelled = FSDP_SPELLINGS | facts.rule_bound_names
        candidates = facts.names if facts.bound_names is None else [
            n for n in facts.names if (n.value if isinstance(n, cst.Name) else n.attr.value) in spelled]
        heads = {(self.fsdp(n) or "").split(".")[0] for n in candidates}
        self.uses_fsdp1 = FSDP1 in heads
        self.fsdp_file = self.uses_fsdp1 or "ShardingStrategy" in heads
        self.names_in_file = {n.value for n in facts.names if isinstance(n, cst.Name)}
        self.uses_no_sync = any(isinstance(n, cst.Attribute) and n.attr.value == "no_sync" for n in facts.names)
        self.built_by_own_classes = {
            name for assign, _ in facts.assigns if isinstance(assign, cst.Assign) and isinstance(assign.value, cst.Call)
            and isinstance(assign.value.func, cst.Name) and assign.value.func.value in facts.class_names
            for name in (dotted(t.target) for t in assign.targets) if name}
        self.framework_file = any(module.split(".")[0] in FSDP1_FRAMEWORKS for module in facts.imported_modules)
        self.check_fn_names, self.check_fn_lambdas = facts.check_fn_names, facts.check_fn_lambdas
        if facts.bound_names is not None:  # after a star import any name may be FSDP's: visit everything
            words = RULE_WORDS | facts.rule_bound_names | (FSDP1_RULE_WORDS if self.uses_fsdp1 else set())
            self.statements_to_visit = facts.statements_to_visit(words | ({"sharding_strategy"} if self.fsdp_file
                                                                           else set()))
        if not self.uses_fsdp1:
            return
        self.has_fsdp2 = (any(self.fsdp(n) in FSDP2_NAMES for n in candidates)
                          or bool(self.names_in_file & FSDP2_MARKERS))
        self._note_assignments(node, facts)
        self._note_state_dict_types(facts)
        self._note_parameters(facts)
        if facts.branch_imports:
            self.remove_unused_imports = False  # an import in a branch: removing it may empty the branch

    def may_name_fsdp2(self, node: cst.CSTNode) -> bool:
        """False where the first pass shows that no name or attribute in the statement `node` (a
        function) can be an FSDP2 name or marker: no need to read it again (see `speaks_fsdp2`)."""
        facts = self.file_facts
        if facts is None or facts.bound_names is None or id(node) not in facts.statement_words:
            return True
        markers = facts.fsdp2_bound_names | FSDP2_NAMES | FSDP2_MARKERS | DTENSOR_MARKERS
        return bool(facts.words_under(id(node)) & markers)

    def _note_assignments(self, node: cst.Module, facts: FileFacts) -> None:
        """Which names and `self.x` attributes hold an `FSDP(...)` result, and where."""
        for assign, cls in facts.assigns:
            targets = [t.target for t in assign.targets] if isinstance(assign, cst.Assign) else [assign.target]
            self.store_targets.update(id(t) for t in targets)
            if assign.value is not None:  # `x = value` or `x: T = value`
                self.assigned_values.update((id(t), assign.value) for t in targets if isinstance(t, cst.Name))
            is_fsdp = isinstance(assign.value, cst.Call) and self.fsdp(assign.value.func) == FSDP1
            if is_fsdp:
                self.wrapped_names.update(d for d in map(dotted, targets) if d)
                for target in targets:
                    self.constructors_by_name.setdefault(dotted(target) or "", []).append(assign.value)
                    self.constructor_of_target[id(target)] = assign.value
                self.fsdp_targets.update(id(t) for t in targets if isinstance(t, cst.Name))
            if cls is not None and isinstance(assign, cst.Assign):
                self._note_self_attributes(cls, assign, is_fsdp)
        self.class_attributes = {key: {name for name, ok in verdict.items() if ok}
                                 for key, verdict in self.class_attributes.items()}
        self.top_level_targets = {
            id(t.target) for body in [node.body, *facts.function_bodies] for line in body
            if isinstance(line, cst.SimpleStatementLine) for small in line.body if isinstance(small, cst.Assign)
            for t in small.targets if id(t.target) in self.fsdp_targets
        }

    def _note_state_dict_types(self, facts: FileFacts) -> None:
        """`state_dict_type` calls that are `with` items, and whether any is used as a value."""
        for with_node in facts.withs:
            self.state_dict_type_items.update(id(item.item) for item in with_node.items
                                              if isinstance(item.item, cst.Call)
                                              and self.fsdp(item.item.func) == STATE_DICT_TYPE)
        for call in facts.attribute_calls:
            if self.fsdp(call.func) == STATE_DICT_TYPE:
                bound = call_arguments(call, STATE_DICT_TYPE_PARAMS) or {}
                self.config_arguments.update(id(bound[name].value) for name in STATE_DICT_TYPE_PARAMS[1:]
                                             if name in bound)
            if (self.fsdp(call.func) or "").startswith(FSDP1 + ".") and call.args and not call.args[0].keyword:
                name = dotted(call.args[0].value)
                if name is not None:
                    self.fsdp1_arguments.add(name)
        self.runtime_state_dict_type = any(
            self.fsdp(call.func) == STATE_DICT_TYPE and id(call) not in self.state_dict_type_items
            for call in facts.attribute_calls)

    def _note_parameters(self, facts: FileFacts) -> None:
        """Parameters that may hold an FSDP1 model: annotated with the FSDP1 class, or passed a
        name that may hold one by a call in this file to a function of that name (`self.f(...)`
        for methods), followed through such calls until nothing new is found."""
        functions: dict[tuple[str, bool], list[cst.FunctionDef]] = {}  # by (name, is a method)
        for function, is_method in facts.functions:
            functions.setdefault((function.name.value, is_method), []).append(function)
            self.fsdp1_parameters.update(
                param.name.value for param in _parameters(function)
                if param.annotation is not None and self._names_fsdp1(param.annotation.annotation))
        calls = [(call, (call.func.value, False)) for call in facts.name_calls]
        calls += [(call, (call.func.attr.value, True)) for call in facts.attribute_calls
                  if dotted(call.func.value) == "self"]
        calls = [(call, key) for call, key in calls if key in functions]
        while True:
            known = self.wrapped_names | self.fsdp1_arguments | self.fsdp1_parameters
            found = {name for call, key in calls for function in functions[key]
                     for name in _receiving(function, call, key[1], known)}
            if found <= self.fsdp1_parameters:
                return
            self.fsdp1_parameters |= found

    def _names_fsdp1(self, annotation: cst.BaseExpression) -> bool:
        """`FSDP`, `Optional[FSDP]`, `Union[FSDP, DDP]`... (any name in it that is the FSDP1 class)."""
        if self.fsdp(annotation) == FSDP1:
            return True
        return isinstance(annotation, cst.Subscript) and any(
            isinstance(element.slice, cst.Index) and self._names_fsdp1(element.slice.value)
            for element in annotation.slice)

    def _note_self_attributes(self, cls: cst.ClassDef, assign: cst.Assign, is_fsdp: bool) -> None:
        """Track `self.x` only ever assigned `FSDP(...)` (or None) in this class."""
        verdict = self.class_attributes.setdefault(id(cls), {})
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
        if isinstance(node, cst.Attribute) and node.attr.value in ("module", "_orig_mod"):
            # FSDP1's wrapped module is the migrated model itself; torch.compile's original module
            # is the module it compiled.
            return self.receiver(node.value)
        if isinstance(node, cst.Name) and self._proven_name(node):
            return PROVEN
        if (isinstance(node, cst.Attribute) and dotted(node.value) == "self" and self.classes
                and node.attr.value in self.class_attributes.get(id(self.classes[-1]), ())):
            return PROVEN
        maybe = (name in self.wrapped_names or name in self.fsdp1_arguments or name in self.fsdp1_parameters
                 or self.guarded_as_fsdp(node))  # inside `if isinstance(model, FSDP):`
        return MAYBE if maybe else None

    def _proven_name(self, node: cst.Name) -> bool:
        if not self.fsdp_targets:
            return False
        scope = self.get_metadata(ScopeProvider, node, None)
        if scope is None:
            return False
        referents = {r for access in scope.accesses[node.value] if access.node is node for r in access.referents}
        fsdp = [r for r in referents if id(getattr(r, "node", None)) in self.fsdp_targets]
        if not fsdp:
            return False
        if len(fsdp) == len(referents):
            return True
        # One top-level `x = FSDP(...)` after every other assignment and before this use.
        if len(fsdp) != 1 or id(fsdp[0].node) not in self.top_level_targets:
            return False
        line = self.line_of(fsdp[0].node)
        others = referents - set(fsdp)
        return self.line_of(node) > line and all(
            isinstance(getattr(r, "node", None), cst.CSTNode) and 0 < self.line_of(r.node) < line for r in others
        )

    def literal_value(self, node: cst.BaseExpression, any_use: bool = False) -> cst.BaseExpression | None:
        """The value of `name = value` for a `name` passed as a state_dict_type type or config, when that
        is the only assignment of the name that can reach `node` (libcst's scopes) and every use
        of the name is such an argument, so nothing can change the object before it is read;
        None otherwise (another assignment, an attribute set, the object passed elsewhere).
        `any_use`: the value cannot change (an enum member), so other uses do not matter."""
        scope = self.get_metadata(ScopeProvider, node, None) if isinstance(node, cst.Name) else None
        if scope is None:
            return None
        referents = {r for access in scope.accesses[node.value] if access.node is node for r in access.referents}
        if len(referents) != 1:
            return None
        (assignment,) = referents
        value = self.assigned_values.get(id(getattr(assignment, "node", None)))
        if value is None or not any_use and any(id(use.node) not in self.config_arguments
                                                for use in assignment.references):
            return None
        return value

    def fresh(self, base: str) -> str:
        """A name not yet used in the file, for a loop variable the rewrite introduces."""
        name, index = base, 1
        while name in self.names_in_file:
            name, index = f"{base}_{index}", index + 1
        self.names_in_file.add(name)
        return name


def _parameters(function: cst.FunctionDef) -> list[cst.Param]:
    params = function.params
    return [*params.posonly_params, *params.params, *params.kwonly_params]


def _receiving(function: cst.FunctionDef, call: cst.Call, is_method: bool, known: set[str]) -> set[str]:
    """The parameters of `function` that `call` passes one of the `known` names to."""
    bound_first = is_method and not any(dotted(d.decorator) == "staticmethod" for d in function.decorators)
    positional = [*function.params.posonly_params, *function.params.params][1 if bound_first else 0:]
    by_keyword = {param.name.value for param in _parameters(function)}
    names = set()
    for index, arg in enumerate(call.args):
        if arg.star:
            if arg.star == "*":
                positional = []  # positions after a *args are unknown
            continue
        if dotted(arg.value) not in known:
            continue
        if arg.keyword is None and index < len(positional):
            names.add(positional[index].name.value)
        elif arg.keyword is not None and arg.keyword.value in by_keyword:
            names.add(arg.keyword.value)
    return names
