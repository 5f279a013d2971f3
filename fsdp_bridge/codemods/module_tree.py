"""Code that reads the wrapped model's tree: its parameters (FB216) and its modules' classes (FB109).

The migration changes what a walk over the wrapped model finds, not only how the model trains:

- Parameters. FSDP1 with `use_orig_params=False` (its default) shows one flat parameter per unit
  (`..._flat_param`, a 1-D piece of the rank's shard); with `use_orig_params=True` it shows the
  original names, each a 1-D view of the rank's piece. FSDP2 shows the original parameters as
  DTensors of their full shapes; fsdp_bridge's YaFSDP shows the original names with 1-D local
  pieces. So parameter groups built by name or shape (weight decay off for norms and biases),
  filters and counts made on the wrapped model give other answers after the migration: a walk
  over a model that FSDP1 showed flat (or that the file cannot tell) is flagged, and, where
  the target shows other shapes, one that reads shapes. Handing `model.parameters()` to an
  optimizer is not a walk: an element-wise optimizer takes the same steps on either layout.
- Classes. `fully_shard` gives each module it shards a class of its own,
  `FSDP<Block>(FSDPModule, Block)`: a test of a module's class name, bases or identity
  (`type(m).__name__ == "Block"`, `"Layer" in str(type(m).__bases__)`, `type(m) is Block`) in
  an activation-checkpointing check_fn or a walk over a model's modules now answers otherwise
  for every sharded block. The class read becomes `fsdp1_module_class(m)`, the class the module
  had before fully_shard, which is what FSDP1's tree showed for it (and a module's own class
  where it is not sharded, so any walk of a file that wraps with FSDP1 may take it).
  `isinstance(m, Block)` needs nothing: the new class subclasses the block's.

A walk is a `for` loop or a comprehension over the call, or the call handed to `sum`, `len`,
`zip`, `sorted`, `enumerate`, `map`, `filter`, `min` or `max`. A read made before the wrap (a
name assigned `FSDP(...)` later in the same scope, by a top-level statement) is not flagged.
"""

from __future__ import annotations

import dataclasses

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ScopeProvider

from fsdp_bridge.codemods import fsdp1, rules
from fsdp_bridge.codemods.base import RUNTIME
from fsdp_bridge.codemods.helpers import code, dotted
from fsdp_bridge.codemods.names import RUNTIME_CONSTRUCTORS, RUNTIME_MODULE, YAFSDP_MODULE

PARAMETER_READS = ("parameters", "named_parameters")
MODULE_WALKS = ("modules", "named_modules", "children", "named_children")
SHAPE_READS = ("ndim", "shape", "dim", "size", "numel", "nelement")
CLASS_READS = ("__name__", "__qualname__", "__bases__", "__mro__")
# Builtins that walk what they are given.
WALKING_BUILTINS = frozenset(f"builtins.{name}" for name in
                             ("sum", "len", "zip", "sorted", "enumerate", "map", "filter", "min", "max"))
IDENTITY_OPERATORS = (cst.Is, cst.IsNot, cst.Equal, cst.NotEqual, cst.In, cst.NotIn)
COMPREHENSIONS = (cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)
# What the migrated file wraps with, besides torch's fully_shard.
MIGRATED_CONSTRUCTORS = frozenset({*RUNTIME_CONSTRUCTORS, f"{YAFSDP_MODULE}.YaFSDP"})


@dataclasses.dataclass(frozen=True)
class UnitWalk:
    """`for name, unit in root.named_modules():` (`name` is None for `modules()`/`children()`)."""

    unit: str
    name: str | None
    root: cst.BaseExpression


def _unit_walk(node: cst.For) -> UnitWalk | None:
    call = node.iter
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value in MODULE_WALKS
            and not call.args):
        return None
    unit = _walk_variable(node.target, call.func.attr.value)
    target = node.target
    name = (target.elements[0].value.value if call.func.attr.value.startswith("named_")
            and isinstance(target.elements[0].value, cst.Name) else None) if unit else None
    return UnitWalk(unit, name, call.func.value) if unit else None


def _walk_variable(target: cst.BaseExpression, method: str) -> str | None:
    """The name a module walk binds each module to (`m` of `for m in x.modules()` or of
    `for name, m in x.named_modules()`)."""
    if method.startswith("named_"):
        if isinstance(target, (cst.Tuple, cst.List)) and len(target.elements) == 2:
            target = target.elements[1].value
        else:
            return None
    return target.value if isinstance(target, cst.Name) else None


class ModuleTreeRules:
    """Parameter walks and class tests on the wrapped model; mixed into `Fsdp1Codemod`."""

    # Set by each command: does the target re-class the modules it shards (fully_shard)? Does it
    # show parameters in other shapes than FSDP1's use_orig_params=True views (FSDP2's DTensors)?
    RECLASSES_MODULES = False
    RESHAPES_PARAMETERS = False
    # Are the units the constructor wrapped objects of the target's class (FSDP2's FSDPModules)?
    UNITS_ARE_WRAPPERS = True
    # How the target shows parameters, for the TODO.
    PARAMETERS_SHOWN = ""

    def __init__(self, context) -> None:
        super().__init__(context)
        self.walks: dict[int, cst.CSTNode] = {}  # id of a walked expression -> its loop or comprehension
        self.class_subjects: list[set[str]] = []  # per check_fn or module walk: the names it binds to modules
        self.identity_operands: set[int] = set()  # expressions whose class identity is read
        self.constructors_by_name: dict[str, list[cst.Call]] = {}  # "model" -> the FSDP(...) calls assigned to it
        self.constructor_of_target: dict[int, cst.Call] = {}  # id(target of `x = FSDP(...)`) -> the call
        self.unit_walks: list[UnitWalk | None] = []  # per enclosing `for`: the walk over a model's modules

    # -- what the walk has entered ------------------------------------------------------------

    def enter_loop(self, node: cst.For) -> None:
        self.walks[id(node.iter)] = node
        self.class_subjects.append(self._module_walk_names(node.iter, node.target))
        self.unit_walks.append(_unit_walk(node))

    def leave_loop(self) -> None:
        self.class_subjects.pop()
        self.unit_walks.pop()

    def unit_walk_of(self, name: str | None) -> UnitWalk | None:
        """The innermost `for` over a model's modules that binds `name` to each module."""
        return next((walk for walk in reversed(self.unit_walks) if walk is not None and walk.unit == name), None)

    def enter_comprehension(self, node: cst.BaseComp | cst.DictComp) -> None:
        names, comp = set(), node.for_in
        while comp is not None:
            self.walks[id(comp.iter)] = node
            names |= self._module_walk_names(comp.iter, comp.target)
            comp = comp.inner_for_in
        self.class_subjects.append(names)

    def leave_comprehension(self) -> None:
        self.class_subjects.pop()

    def enter_check_fn(self, params: cst.Parameters) -> None:
        """An activation-checkpointing check_fn: its first parameter is the module it tests."""
        first = [*params.posonly_params, *params.params][:1]
        self.class_subjects.append({first[0].name.value} if first and self.RECLASSES_MODULES else set())

    def leave_check_fn(self) -> None:
        self.class_subjects.pop()

    def note_walking_call(self, node: cst.Call, qualified: set[str]) -> None:
        """`sum(p.numel() for p in ...)` is a comprehension; `len(model.parameters())`-like calls
        walk their arguments."""
        if qualified & WALKING_BUILTINS:
            self.walks.update((id(arg.value), node) for arg in node.args)

    def note_class_reads(self, node: cst.Attribute | cst.Comparison) -> None:
        """`X.__name__`, `X is Y`, `X == Y`, `X in Y`: X's class identity is read."""
        if isinstance(node, cst.Attribute):
            if node.attr.value in CLASS_READS:
                self.identity_operands.add(id(node.value))
            return
        if any(isinstance(target.operator, IDENTITY_OPERATORS) for target in node.comparisons):
            self.identity_operands.update(id(op) for op in [node.left, *(t.comparator for t in node.comparisons)])

    def _module_walk_names(self, iterated: cst.BaseExpression, target: cst.BaseExpression) -> set[str]:
        """The walk variable of `for m in model.modules()`, in a file that wraps with FSDP1. Any
        walk counts, whatever the model: `fsdp1_module_class` gives an unsharded module's own
        class, so the rewrite changes nothing where the model turns out not to be sharded."""
        if not (self.uses_fsdp1 and isinstance(iterated, cst.Call)
                and isinstance(iterated.func, cst.Attribute) and iterated.func.attr.value in MODULE_WALKS):
            return set()
        name = _walk_variable(target, iterated.func.attr.value)
        return {name} if name else set()

    # -- classes (FB109) --------------------------------------------------------------------------

    def translate_class_read(self, original: cst.Call | cst.Attribute, updated):
        """`type(m)` or `m.__class__` whose identity a test reads, `m` a module of the wrapped model:
        `fsdp1_module_class(m)`."""
        if not self.RECLASSES_MODULES or id(original) not in self.identity_operands or not self.class_subjects:
            return updated
        if isinstance(original, cst.Call):
            if len(original.args) != 1 or original.args[0].keyword or original.args[0].star:
                return updated
            subject, new_subject = original.args[0].value, updated.args[0].value
        else:
            subject, new_subject = original.value, updated.value
        name = dotted(subject)
        if name is None or not any(name in names for names in self.class_subjects):
            return updated
        self.site(rules.CLASS_TEST, RUNTIME, original, f"{code(original)} (a class test on a module of the model)",
                  "fully_shard gives each module it shards the class FSDP<Name>(FSDPModule, <its class>), so a "
                  "test of the class name, bases or identity would now answer otherwise for every sharded "
                  "module; fsdp1_module_class() gives the class the module had before fully_shard, as FSDP1's "
                  "module tree showed it")
        self.need(RUNTIME_MODULE, "fsdp1_module_class")
        return cst.Call(func=cst.Name("fsdp1_module_class"), args=[cst.Arg(new_subject)])

    def flag_unit_type_check(self, original: cst.Call) -> bool:
        """`isinstance(m, FSDP)` on the modules of a walk, where the target's units are no wrapper
        objects (YaFSDP wraps the model once): flagged and left as written (True)."""
        if self.UNITS_ARE_WRAPPERS or len(original.args) != 2 or not self._names_fsdp1_class(original.args[1].value):
            return False
        name = dotted(original.args[0].value)
        if name is None or not any(name in names for names in self.class_subjects):
            return False
        self.todo(rules.UNIT_TYPE_TEST, original, f"{code(original)} in a walk over the model's modules",
                  "YaFSDP wraps the model once: the units FSDP1 wrapped stay plain modules (named in "
                  "modules_to_wrap_with_names), so in this walk the test would find the YaFSDP model alone where "
                  "FSDP1 found every unit; test the units by name or class instead")
        return True

    # -- parameters (FB216) -----------------------------------------------------------------------

    def check_parameter_read(self, original: cst.Call) -> None:
        """`model.parameters()` / `model.named_parameters()` walked, on a model that may be wrapped."""
        method = original.func.attr.value
        walk = self.walks.get(id(original))
        if method == "parameters" and walk is None:
            return  # handed over whole (to an optimizer): nothing reads the layout
        receiver = original.func.value
        if not self._read_after_wrap(receiver) or self._migrated_already(receiver):
            return
        flat = self._flat_parameters(receiver)
        if flat is False:
            if not (self.RESHAPES_PARAMETERS and walk is not None and _reads_shapes(walk)):
                return
            self.todo(rules.PARAMETER_WALK, original, f"{code(original.func)}() walked",
                      "FSDP1 (use_orig_params=True) shows each parameter as a 1-D view of this rank's piece of "
                      f"it, so shape tests and counts here saw 1-D local pieces; {self.PARAMETERS_SHOWN}, so "
                      "they now see other shapes and counts: check what this code builds from them")
            return
        why = ("FSDP1 with use_orig_params=False" if flat else
               "use_orig_params is not known here (passed as a value, or the model is wrapped elsewhere); if it "
               "is False (FSDP1's default), FSDP1")
        self.todo(rules.PARAMETER_WALK, original, f"{code(original.func)}() walked",
                  f"{why} shows one flat parameter per unit (named ..._flat_param, a 1-D piece of this "
                  "rank's shard), so name and shape tests here matched none of the original parameters and "
                  f"counts were of the flat pieces; {self.PARAMETERS_SHOWN}, so parameter groups (weight decay "
                  "off for norms and biases), filters and counts built here now differ: check them")

    def _flat_parameters(self, receiver: cst.BaseExpression) -> bool | None:
        """True if some FSDP1 constructor that may have built `receiver` shows flat parameters
        (use_orig_params=False, the default), False if every one shows the originals, None if
        the file cannot tell (a value known at run time, or no constructor in this file)."""
        while isinstance(receiver, cst.Attribute) and receiver.attr.value in ("module", "_orig_mod"):
            receiver = receiver.value
        calls = [self.constructor_of_target[id(r.node)] for r in self._referents(receiver)
                 if id(getattr(r, "node", None)) in self.constructor_of_target]
        calls = calls or self.constructors_by_name.get(dotted(receiver) or "")
        if not calls:
            calls = [call for found in self.constructors_by_name.values() for call in found]
        if not calls:
            return None
        settings = set()
        for call in calls:
            args = fsdp1.constructor_arguments(call)
            value = args.get("use_orig_params") if args is not None else None
            settings.add(fsdp1.literal_bool(value.value if value is not None else None, False)
                         if args is not None else None)
        return True if False in settings else None if None in settings else False

    def _migrated_already(self, receiver: cst.BaseExpression) -> bool:
        """True where every assignment of the name that reaches here is a migrated constructor
        (`fully_shard(...)`, `YaFSDP(...)`, the runtime helpers): a second run over a rewritten
        file, whose walks were flagged the first time."""
        values = [self.assigned_values.get(id(getattr(r, "node", None))) for r in self._referents(receiver)]
        return bool(values) and all(isinstance(v, cst.Call) and (
            self.fsdp(v.func) == "fully_shard" or self.qualified(v.func) & MIGRATED_CONSTRUCTORS) for v in values)

    # -- after the wrap ---------------------------------------------------------------------------

    def _read_after_wrap(self, receiver: cst.BaseExpression) -> bool:
        """True if `receiver` may hold the wrapped model here (see [Note: which receivers are FSDP
        modules] in `facts.py`), unless it is a name read before the wrap: every `x = FSDP(...)`
        that can reach it is a top-level statement of the same scope, further down."""
        if self.receiver(receiver) is None:
            return False
        while isinstance(receiver, cst.Attribute) and receiver.attr.value in ("module", "_orig_mod"):
            receiver = receiver.value
        scope = self.get_metadata(ScopeProvider, receiver, None) if isinstance(receiver, cst.Name) else None
        wraps = [r for r in self._referents(receiver) if id(getattr(r, "node", None)) in self.fsdp_targets]
        return not wraps or not all(
            r.scope is scope and id(r.node) in self.top_level_targets and self.line_of(r.node) > self.line_of(receiver)
            for r in wraps)

    def _referents(self, node: cst.BaseExpression) -> set:
        """The assignments of a name that can reach this read of it (libcst's scopes; empty for
        anything else)."""
        scope = self.get_metadata(ScopeProvider, node, None) if isinstance(node, cst.Name) else None
        if scope is None:
            return set()
        return {r for access in scope.accesses[node.value] if access.node is node for r in access.referents}


def _reads_shapes(walk: cst.CSTNode) -> bool:
    """True if the loop or comprehension reads a shape or a size (`p.ndim`, `p.numel()`...)."""
    return any(node.attr.value in SHAPE_READS for node in m.findall(walk, m.Attribute()))
