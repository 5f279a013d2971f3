"""`--to bridge`: point FSDP/YaFSDP/Zeta/TorchAcc imports at the mirrored fsdp_bridge modules.

The drop-in contract is that our module paths mirror the originals name for name, so
this target only rewrites module paths, in imports and in dotted uses such as
`torch.distributed.fsdp.FullyShardedDataParallel(...)` after a plain `import torch.distributed.fsdp`.
Nothing else changes. Private modules and names of torch's FSDP (`torch.distributed.fsdp._runtime_utils`,
`from torch.distributed.fsdp import _x`) are not mirrored: those imports stay as they were, flagged
(FB002), and so do reads of FSDP1's private wrapper attributes (`_handle`, `_lazy_init`, FB003).

    python -m libcst.tool codemod to_bridge.ToBridgeCommand PATH
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections import defaultdict

import libcst as cst
import libcst.matchers as m
from libcst.codemod.visitors import AddImportsVisitor
from libcst.helpers import get_full_name_for_node

from fsdp_bridge.codemods import frameworks, rules
from fsdp_bridge.codemods.base import IN_PLACE, FsdpCodemod
from fsdp_bridge.codemods.helpers import code, parse_expr
from fsdp_bridge.codemods.names import FSDP1, PRIVATE_ATTRIBUTES, TYPE_CHECKS, fsdp_name, is_private_fsdp1

# original module -> ours. Longest match wins (`torch.distributed.fsdp.wrap` before `...fsdp`).
MODULE_MAP = {
    "torch.distributed.fsdp.wrap": "fsdp_bridge.fsdp.wrap",
    "torch.distributed.fsdp.fully_sharded_data_parallel": "fsdp_bridge.fsdp",
    "torch.distributed.fsdp.api": "fsdp_bridge.fsdp",
    "torch.distributed.fsdp": "fsdp_bridge.fsdp",
    "torch.distributed._composable.fsdp": "fsdp_bridge.fsdp",
    "ya_fsdp.ya_fsdp": "fsdp_bridge.ya_fsdp",
    "ya_fsdp": "fsdp_bridge.ya_fsdp",
    "zeta.training": "fsdp_bridge.zeta",
    "torchacc": "fsdp_bridge.torchacc",
}

# `from torch.distributed import fsdp` names a mirrored module through its parent package.
PARENT_MAP = {
    ("torch.distributed", "fsdp"): ("fsdp_bridge", "fsdp"),
    ("torch.distributed._composable", "fsdp"): ("fsdp_bridge", "fsdp"),
    ("zeta", "training"): ("fsdp_bridge", "zeta"),
}


def mirrored(module: str) -> str | None:
    """Our module for an original module path, exact match only."""
    return MODULE_MAP.get(module)


@functools.lru_cache(maxsize=None)
def _mirror_names(module: str) -> frozenset[str]:
    """The names our mirror module `module` offers: its `__all__`, private names it defines
    (`_or_policy`), and its subpackages. Importing it loads torch (seconds); see
    `_names_in_source` for what is known without."""
    mirror = importlib.import_module(module)
    names = set(getattr(mirror, "__all__", ()))
    names.update(n for n in vars(mirror) if n.startswith("_") and not n.startswith("__"))
    if hasattr(mirror, "__path__"):
        names.update(info.name for info in pkgutil.iter_modules(mirror.__path__))
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def _names_in_source(module: str) -> frozenset[str]:
    """The names the mirror's source shows it offers without running it: the string items of
    a literal `__all__`, the private names bound at its top level, its subpackages. A subset of
    `_mirror_names` (names added at run time, e.g. for a newer torch, are not seen), so that a
    file importing only these needs no import of the mirror, hence none of torch."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)  # imports the parent packages only
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return frozenset()
    with open(spec.origin, "rb") as handle:
        tree = ast.parse(handle.read(), spec.origin)
    names: set[str] = set()
    for node in tree.body:
        bound = []
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound = [(alias.asname or alias.name).split(".")[0] for alias in node.names]
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound = [node.name]
        elif isinstance(node, ast.Assign):
            bound = [target.id for target in node.targets if isinstance(target, ast.Name)]
            if "__all__" in bound and isinstance(node.value, (ast.List, ast.Tuple)):
                names.update(item.value for item in node.value.elts
                             if isinstance(item, ast.Constant) and isinstance(item.value, str))
        names.update(n for n in bound if n.startswith("_") and not n.startswith("__"))
    if spec.submodule_search_locations:
        names.update(info.name for info in pkgutil.iter_modules(spec.submodule_search_locations))
    return frozenset(names)


def missing_in_mirror(module: str, names) -> list[str]:
    """Which of `names` our mirror `module` lacks (sorted). The mirror is imported only when its
    source does not show them all."""
    unseen = set(names) - _names_in_source(module)
    if not unseen:
        return []
    offered = _mirror_names(module)
    return sorted(n for n in unseen if n not in offered)


# Frameworks that wrap the model in torch's own FSDP1 themselves (HF Trainer, accelerate, Lightning).
FRAMEWORKS = ("transformers", "accelerate", "trl", "lightning", "pytorch_lightning")
# transformers wraps a model only through its Trainer: a file that imports its model classes
# alone (LlamaForCausalLM, AutoConfig) builds and wraps the model itself.
TRANSFORMERS_WRAPPERS = ("Trainer", "TrainingArguments")


def _uses_framework_wrapper(imported: dict[str, set[str]]) -> bool:
    """Whether a file's imports (module -> names it takes from it, or reads through it) reach a
    framework that wraps the model itself."""
    for module, names in imported.items():
        top = module.split(".")[0]
        if top == "transformers":
            if "*" in names or any(w in name for name in names for w in TRANSFORMERS_WRAPPERS):
                return True
        elif top in FRAMEWORKS:
            return True
    return False


def _module_node(dotted_name: str) -> cst.Attribute | cst.Name:
    return parse_expr(dotted_name)  # type: ignore[return-value]


class ToBridgeCommand(FsdpCodemod):
    DESCRIPTION = "Rewrite FSDP/YaFSDP/Zeta/TorchAcc imports to the mirrored fsdp_bridge modules."

    def __init__(self, context) -> None:
        super().__init__(context)
        # Dotted module names bound by a plain `import a.b.c` that we rewrote: their uses
        # (`a.b.c.X`) must be rewritten too.
        self._plain_dotted: set[str] = set()
        self._in_import = 0
        self._keep: set[int] = set()  # ids of dotted module paths followed by a private name
        self._imports_fsdp1 = False

    def visit_Module(self, node: cst.Module) -> None:
        super().visit_Module(node)
        # `ta.sync`: the attributes read through each dotted name, to check a module import's
        # uses against our mirror before rewriting it.
        self._attributes_of: dict[str, set[str]] = defaultdict(set)
        for attribute in m.findall(node, m.Attribute()):
            base = get_full_name_for_node(attribute.value)
            if base is not None:
                self._attributes_of[base].add(attribute.attr.value)
        imported: dict[str, set[str]] = defaultdict(set)
        for imp in m.findall(node, m.ImportFrom()):
            if imp.module is not None and not imp.relative:
                names = ({"*"} if isinstance(imp.names, cst.ImportStar)
                         else {get_full_name_for_node(a.name) or "" for a in imp.names})
                imported[get_full_name_for_node(imp.module) or ""] |= names
        for imp in m.findall(node, m.Import()):
            for alias in imp.names:
                name = get_full_name_for_node(alias.name) or ""
                bound = get_full_name_for_node(alias.asname.name) if alias.asname else name
                imported[name] |= self._attributes_of.get(bound or "", set())
        self._framework = _uses_framework_wrapper(imported) or any(
            name.startswith(frameworks.INTEGRATIONS + ".") for name in imported)
        # Who builds the wrappers of a framework file (None: no framework, the file's own).
        self._owner = frameworks.read_owner(node, self.qualified) if self._framework else None
        self._imports_fsdp1 = any(
            (get_full_name_for_node(imp.module) or "").startswith("torch.distributed.fsdp")
            for imp in m.findall(node, m.ImportFrom(module=m.DoNotCare()))
            if imp.module is not None
        ) or any(
            (get_full_name_for_node(alias.name) or "").startswith("torch.distributed.fsdp")
            for imp in m.findall(node, m.Import()) for alias in imp.names
        )

    def _private(self, node: cst.CSTNode, what: str) -> None:
        self.todo(rules.PRIVATE_MODULE, node, what, "a private module or name of torch's FSDP: fsdp_bridge does not "
                  "mirror it, so it is left pointing at torch's (which knows nothing of our modules)")

    def _not_mirrored(self, node: cst.CSTNode, what: str, mirror: str, missing: list[str]) -> None:
        self.todo(rules.NOT_MIRRORED, node, what, f"{mirror} does not have {', '.join(missing)}: the import is "
                  "left pointing at the original; rewrite it once those uses are replaced")

    # -- models built by a framework ---------------------------------------------------------

    def _rewrites_entry_points(self) -> bool:
        return self._owner is not None and not self._owner.builds_itself and not self._owner.keeps_torch

    def _keeps_torch(self, module: str) -> bool:
        """Whether this torch FSDP module's import stays torch's (see frameworks.Owner)."""
        return (self._owner is not None and self._owner.keeps_torch
                and module.split(".")[:2] == ["torch", "distributed"])

    @staticmethod
    def _names_fsdp_package(module: str, imp: cst.ImportFrom) -> bool:
        """`from torch.distributed import fsdp`."""
        return not isinstance(imp.names, cst.ImportStar) and any(
            (module, get_full_name_for_node(alias.name)) in PARENT_MAP for alias in imp.names)

    def _keep_torch_import(self, node: cst.CSTNode, what: str) -> None:
        """One TODO, on the file's first kept import, says why all of them are kept."""
        if not self._owner.noted:
            self._owner.noted = True
            self.todo(rules.FRAMEWORK_MODEL, node, what, self._owner.why_torch())

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if self._rewrites_entry_points():
            updated = self._our_strategy_name(updated)
        if not (self._rewrites_entry_points() and frameworks.FSDP2_ROUTE in self._owner.routes):
            return updated
        names = {fsdp_name(q) or "" for q in self.qualified(original.func)}
        if any(name.startswith(FSDP1 + ".") for name in names):
            method = next(n for n in names if n.startswith(FSDP1 + "."))
            self.todo(rules.FRAMEWORK_MODEL, original, f"{method}(...)", self._FRAMEWORK_REASON)
        elif (self.qualified(original.func) & TYPE_CHECKS and len(original.args) == 2
              and FSDP1 in self._class_names(original.args[1].value)):
            self.todo(rules.FRAMEWORK_MODEL, original, f"{code(original.func)}(..., FullyShardedDataParallel)",
                      self._FRAMEWORK_REASON)
        return updated

    _FRAMEWORK_REASON = ("the framework's entry point in this file now shards with fsdp_bridge's fully_shard "
                         "(accelerate's FSDP2 path; an FSDP1 config is refused when it starts), so its model "
                         "holds no FullyShardedDataParallel wrapper: this FSDP1 call finds none and raises (an "
                         "isinstance check is never true); use torch.distributed.checkpoint's "
                         "get_model_state_dict / set_model_state_dict or the framework's own save")

    def _our_strategy_name(self, call: cst.Call) -> cst.Call:
        """Lightning's `strategy="fsdp"` -> `strategy="fsdp_bridge"` (see frameworks)."""
        args = list(call.args)
        for index, arg in enumerate(args):
            if (arg.keyword is not None and arg.keyword.value == "strategy" and isinstance(arg.value, cst.SimpleString)
                    and arg.value.evaluated_value == frameworks.LIGHTNING_FSDP):
                args[index] = arg.with_changes(value=frameworks.our_strategy(arg.value))
                self.need(frameworks.LIGHTNING_ROUTE)
                self.site(rules.FRAMEWORK_ENTRY_POINT, IN_PLACE, call, f'strategy="{frameworks.LIGHTNING_FSDP}"',
                          f'now strategy="{frameworks.OUR_STRATEGY}" '
                          f'(registered by import {frameworks.LIGHTNING_ROUTE})')
        return call.with_changes(args=args)

    def _class_names(self, node: cst.BaseExpression) -> set[str]:
        elements = [e.value for e in node.elements] if isinstance(node, cst.Tuple) else [node]
        return {fsdp_name(q) or "" for e in elements for q in self.qualified(e)}

    # -- imports -------------------------------------------------------------------------

    def visit_Import(self, node: cst.Import) -> None:
        self._in_import += 1

    def leave_Import(self, original: cst.Import, updated: cst.Import) -> cst.Import:
        self._in_import -= 1
        names = []
        for alias in updated.names:
            old = get_full_name_for_node(alias.name)
            new = mirrored(old or "")
            if new is not None and self._keeps_torch(old or ""):
                self._keep_torch_import(original, f"import {old}")
                names.append(alias)
                continue
            if new is None:
                if is_private_fsdp1(old or ""):
                    self._private(original, f"import {old}")
                names.append(alias)
                continue
            # A plain `import a.b.c` is checked use by use (private uses are kept, see visit_Attribute).
            bound = get_full_name_for_node(alias.asname.name) if alias.asname is not None else old
            plain_dotted = alias.asname is None and "." in (old or "")
            missing = [] if plain_dotted else missing_in_mirror(new, self._attributes_of.get(bound or "", ()))
            if missing:
                self._not_mirrored(original, f"import {old}", new, [f"{bound}.{n}" for n in missing])
                names.append(alias)
                continue
            self.site(rules.IMPORT_MIRRORED, IN_PLACE, original, f"import {old}", f"now imports {new}")
            if alias.asname is not None:  # `import ya_fsdp as y` -> `import fsdp_bridge.ya_fsdp as y`
                names.append(alias.with_changes(name=_module_node(new)))
            elif "." not in old:  # `import torchacc` -> `import fsdp_bridge.torchacc as torchacc`
                names.append(
                    alias.with_changes(
                        name=_module_node(new),
                        asname=cst.AsName(name=cst.Name(old)),
                    )
                )
            else:  # `import torch.distributed.fsdp`: uses are dotted, rewrite them below
                self._plain_dotted.add(old)
                names.append(alias.with_changes(name=_module_node(new)))
        return updated.with_changes(names=names)

    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        self._in_import += 1

    def leave_ImportFrom(self, original: cst.ImportFrom, updated: cst.ImportFrom) -> cst.ImportFrom:
        self._in_import -= 1
        if updated.relative or updated.module is None:
            return updated
        old = get_full_name_for_node(updated.module) or ""
        new = mirrored(old)
        if self._rewrites_entry_points():
            updated, added, rewritten = frameworks.entry_point_import(updated)
            if rewritten:
                self.insert_before(*added)
                self.site(rules.FRAMEWORK_ENTRY_POINT, IN_PLACE, original, f"from {old} import ...",
                          f"now fsdp_bridge's route: {'; '.join(rewritten)}")
                return updated
        if (new is not None or self._names_fsdp_package(old, updated)) and self._keeps_torch(old):
            self._keep_torch_import(original, f"from {old} import ...")
            return updated
        if is_private_fsdp1(old):
            self._private(original, f"from {old} import ...")
            return updated
        imported = [] if isinstance(updated.names, cst.ImportStar) else [
            get_full_name_for_node(a.name) or "" for a in updated.names]
        missing = missing_in_mirror(new, imported) if new is not None else []
        if missing and any(name.startswith("_") for name in missing):
            self._private(original, f"from {old} import {', '.join(code(a.name) for a in updated.names)}")
            return updated
        if missing:
            self._not_mirrored(original, f"from {old} import {', '.join(imported)}", new, missing)
            return updated
        if new is not None:
            self.site(rules.IMPORT_MIRRORED, IN_PLACE, original, f"from {old} import ...", f"now from {new}")
            return updated.with_changes(module=_module_node(new))
        if isinstance(updated.names, cst.ImportStar):
            return updated
        # `from torch.distributed import fsdp`: only when every imported name is mirrored.
        targets = {PARENT_MAP.get((old, get_full_name_for_node(a.name) or "")) for a in updated.names}
        if len(targets) == 1 and None not in targets:
            parent, child = targets.pop()
            self.site(rules.IMPORT_MIRRORED, IN_PLACE, original, f"from {old} import ...", f"now from {parent}")
            names = [
                a.with_changes(
                    name=cst.Name(child),
                    asname=a.asname
                    or (cst.AsName(name=cst.Name(a.name.value)) if a.name.value != child else None),
                )
                for a in updated.names
            ]
            return updated.with_changes(module=_module_node(parent), names=names)
        return updated

    # -- dotted uses of a plain `import a.b.c` ----------------------------------------------

    def visit_Attribute(self, node: cst.Attribute) -> None:
        inner = get_full_name_for_node(node.value)
        if not self._in_import and inner in self._plain_dotted and node.attr.value.startswith("_"):
            self._keep.add(id(node.value))
            self._private(node, f"{inner}.{node.attr.value}")

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute):
        if (self._imports_fsdp1 and not self._in_import and original.attr.value in PRIVATE_ATTRIBUTES
                and not self._keeps_torch("torch.distributed.fsdp")
                and not (get_full_name_for_node(original.value) or "").startswith(("torch.", "fsdp_bridge."))):
            self.todo(rules.PRIVATE_WRAPPER_ATTRIBUTE, original, f".{original.attr.value}",
                      "a private attribute of torch's FSDP1 wrapper: fsdp_bridge's FullyShardedDataParallel "
                      "has its own internals, not these")
        if self._in_import or not self._plain_dotted or id(original) in self._keep:
            return updated
        for name in self.qualified(original):
            if name in self._plain_dotted and get_full_name_for_node(original) == name:
                return _module_node(MODULE_MAP[name])
        return updated

    def leave_Module(self, original: cst.Module, updated: cst.Module) -> cst.Module:
        # `import torch.distributed.fsdp` also bound `torch`; keep it bound if still used.
        if any(n.startswith("torch.") for n in self._plain_dotted):
            if m.findall(updated, m.Attribute(value=m.Name("torch"))):
                AddImportsVisitor.add_needed_import(self.context, "torch")
        return updated
