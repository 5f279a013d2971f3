"""The base class of every fsdp-bridge codemod: name resolution, report sites, TODO comments.

Every codemod in this package matches torch/YaFSDP/Zeta/TorchAcc names by *qualified name*
(libcst's qualified names from its scope analysis, see `names.py`), never by text: `FSDP`,
`x.FullyShardedDataParallel` after `import torch.distributed.fsdp as x`, and imports inside
functions all resolve to the same canonical name, while a local class that happens to be called
`FullyShardedDataParallel` does not.

[Note: statement-level edits]
Translations often need to touch the *statement* around an expression: put a TODO comment above
it, insert a loop of `fully_shard` calls before it, or move a comment out of a dropped argument.
`FsdpCodemod` keeps a stack of the statements being visited; an expression-level handler records
its wish on the innermost statement (`self.todo(...)`, `self.insert_before(...)`) and the wish is
applied when that statement is left. This keeps each handler a short function on one node.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Collection

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor
from libcst.codemod.visitors._remove_imports import RemovedNodeVisitor
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedName, QualifiedNameSource, ScopeProvider

from fsdp_bridge.codemods.helpers import (
    NOTE_TAG,
    TODO_TAG,
    dotted,
    drops_a_comment,
    has_todo,
    keep_pragma_line,
    names_bound_by_imports,
    todo_comment,
    with_leading_comments,
)
from fsdp_bridge.codemods.imports import insert_imports
from fsdp_bridge.codemods.names import BUILTINS_WE_MATCH, fsdp_name

# Key under which every codemod appends its `Site`s to `context.scratch`.
SITES_KEY = "fsdp_bridge.sites"

# [Note: what the tree keeps of FSDP1]
# `isinstance(x, FullyShardedDataParallel)` may only be narrowed to the new class when no code
# the check can see still builds FSDP1 modules: a constructor the codemod could not translate
# (a TODO), one in a file that was not parsed or cannot be written, a subclass, a partial, or a
# library configured to wrap (HF Trainer, accelerate). Such a module lives in one file and is
# checked in another, so the run over the tree decides, not the file:
# - each codemod notes, under FILE_FACTS_KEY, where its file keeps FSDP1 constructors
#   ("kept", lines with the rule) and whether it narrowed a type check ("narrowed");
# - the caller puts, under TREE_KEY, where the rest of the tree keeps them (a tuple of
#   descriptions, empty when nowhere) before the pass whose output is kept. With something
#   there, type checks accept both classes and the report says why. Without the key at all (a
#   runner that sees one file at a time, such as `python -m libcst.tool codemod`), the rest of
#   the tree is unknown, so type checks accept both too.
TREE_KEY = "fsdp_bridge.tree_keeps_fsdp1"
FILE_FACTS_KEY = "fsdp_bridge.file_facts"

# Report status values.
IN_PLACE = "translated in place"
RUNTIME = "translated via runtime helper"
TODO = "left with TODO"
INFO = "report only"


@dataclasses.dataclass(frozen=True)
class Site:
    """One FSDP usage found in a file, as it appears in the report."""

    rule: str  # stable rule code, e.g. "FB101"
    status: str  # IN_PLACE, RUNTIME, TODO or INFO
    line: int
    what: str  # the construct, e.g. "FullyShardedDataParallel(...)"
    reason: str  # why it was handled this way

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@contextlib.contextmanager
def _without_copy(codemod, module: cst.Module):
    """Run `codemod` on `module` itself (libcst would deep-copy it first)."""
    old = codemod.context.wrapper
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    with codemod.resolve(wrapper):
        codemod.context = dataclasses.replace(codemod.context, wrapper=wrapper)
        try:
            yield wrapper.module
        finally:
            codemod.context = dataclasses.replace(codemod.context, wrapper=old)


@dataclasses.dataclass
class _Pending:
    """Edits requested for one statement while its children were being transformed."""

    todos: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    notes: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    comments: list[str] = dataclasses.field(default_factory=list)
    before: list[cst.BaseStatement] = dataclasses.field(default_factory=list)


class FsdpCodemod(VisitorBasedCodemodCommand):
    """Base class: name resolution, site recording, and statement-level edits."""

    # Positions are resolved with the scopes, in one pass over the tree (resolved later on their
    # own, libcst walks the whole tree once more). Qualified names are computed node by node from
    # the scopes (see _qualified_names).
    METADATA_DEPENDENCIES = (ScopeProvider, PositionProvider)

    def __init__(self, context: CodemodContext) -> None:
        super().__init__(context)
        self._pending: list[_Pending] = []
        self._removed_nodes: RemovedNodeVisitor | None = None
        self.context.scratch.setdefault(SITES_KEY, [])
        self.context.scratch.setdefault(FILE_FACTS_KEY, {"kept": [], "narrowed": False})

    # -- whole-module guard ----------------------------------------------------------------

    remove_unused_imports = True

    def transform_module(self, tree: cst.Module) -> cst.Module:
        """Transform; if libcst's import clean-up took a comment with it, redo without clean-up.

        RemoveImportsVisitor drops an unused import statement together with the comment lines
        above it. An unused import is harmless; a lost comment is not: nothing a user wrote is
        ever dropped.
        """
        result = super().transform_module(tree)
        removed = self.context.scratch.get(RemoveImportsVisitor.CONTEXT_KEY)
        if not self.remove_unused_imports or not removed or not drops_a_comment(tree.code, result.code):
            return result  # (nothing removed: no import took a comment along; no need to print both)
        for key in (SITES_KEY, "AddImportsVisitor", "RemoveImportsVisitor"):
            self.context.scratch.pop(key, None)
        self.context.scratch[SITES_KEY] = []
        self.context.scratch[FILE_FACTS_KEY] = {"kept": [], "narrowed": False}
        del self.context.warnings[:]
        self.remove_unused_imports = False
        return super().transform_module(tree)

    def leave_SimpleStatementLine(self, original: cst.SimpleStatementLine,
                                  updated: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
        return keep_pragma_line(original, updated)

    # -- names ---------------------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        self._qualified_cache: dict[int, Collection[QualifiedName]] = {}  # by id of a node of this tree
        self._bound_by_import = self.names_bound_by_imports(node)
        self._removed_nodes = None  # see drop_import_of

    def names_bound_by_imports(self, node: cst.Module) -> set[str] | None:
        """Every name an import binds in the file (a codemod with a first pass of its own reads
        them there instead)."""
        return names_bound_by_imports(node)

    def _may_be_imported(self, node: cst.CSTNode) -> bool:
        """Cheap pre-check: only names bound by an import can resolve to torch's (or builtins).

        Resolving a qualified name is by far the most expensive step on large files; most
        names in a file are locals, so they skip it.
        """
        while isinstance(node, (cst.Attribute, cst.Call, cst.Subscript)):
            node = node.value if not isinstance(node, cst.Call) else node.func
        if not isinstance(node, cst.Name):
            return False
        bound = getattr(self, "_bound_by_import", None)
        return bound is None or node.value in bound or node.value in BUILTINS_WE_MATCH

    def _qualified_names(self, node: cst.CSTNode) -> Collection[QualifiedName]:
        """What libcst's QualifiedNameProvider gives for `node`, computed for this node alone from
        its scope: the provider would compute it for every node of the file, which costs a third
        of the scope analysis on a large file where only a few names are ever asked about."""
        found = self._qualified_cache.get(id(node))
        if found is None:
            scope = self.get_metadata(ScopeProvider, node, None)
            if scope is None:
                return set()  # a node this codemod built: no name of its own
            found = self._qualified_cache[id(node)] = scope.get_qualified_names_for(node)
        return found

    def qualified_names(self, node: cst.CSTNode) -> set[str]:
        """Every qualified name `node` may have (also locals), as QualifiedNameProvider gives them."""
        return {q.name for q in self._qualified_names(node)}

    def qualified(self, node: cst.CSTNode) -> set[str]:
        if not self._may_be_imported(node):
            return set()
        return self.qualified_names(node)

    def imported(self, node: cst.CSTNode) -> bool:
        """True if `node` names something from an import or a builtin (not a local object)."""
        return self._may_be_imported(node) and any(
            q.source in (QualifiedNameSource.IMPORT, QualifiedNameSource.BUILTIN) for q in self._qualified_names(node))

    def fsdp(self, node: cst.CSTNode) -> str | None:
        """The FSDP name `node` refers to (`FullyShardedDataParallel`, `ShardingStrategy.X`...).

        None also when the name is bound to FSDP's *or* something else depending on which
        branch ran (`try: from torch...fsdp import FSDP / except ImportError: FSDP = None`):
        such a name is not FSDP's for certain (see `ambiguous`).

        An attribute of a call's result is an instance's (`FSDP(model).to(device)`), never one of
        the class's static methods, though libcst names it after the call's function.
        """
        if isinstance(node, cst.Attribute) and dotted(node) is None:
            return None
        names = self.qualified(node)
        shorts = {fsdp_name(name) for name in names}
        if None in shorts:
            return None
        return next(iter(shorts), None)

    def ambiguous(self, node: cst.CSTNode) -> bool:
        """True if `node` may be FSDP's or something else (a conditional or fallback import)."""
        shorts = {fsdp_name(name) for name in self.qualified(node)}
        return None in shorts and len(shorts) > 1

    def refers_to(self, node: cst.CSTNode, *qualified: str) -> bool:
        return bool(self.qualified(node) & set(qualified))

    # -- positions, and libcst's passes without copies ------------------------------------

    def line_of(self, node: cst.CSTNode) -> int:
        position = self.get_metadata(PositionProvider, node, None)
        return position.start.line if position is not None else 0  # 0: a node we built

    @contextlib.contextmanager
    def _handle_metadata_reference(self, module: cst.Module):
        """As libcst's, without the defensive deep copy of the tree (seconds on large files).

        The tree comes straight from `parse_module` and is never shared, which is the
        condition for `unsafe_skip_copy`.
        """
        if self.context.metadata_manager is not None and self.context.filename:
            with super()._handle_metadata_reference(module) as tree:
                yield tree
            return
        with _without_copy(self, module) as tree:
            yield tree

    def _instantiate_and_run(self, transform, tree: cst.Module) -> cst.Module:
        """libcst's follow-up passes, without copying the tree when they need no metadata (the
        copy would be the most expensive part of the pass). Imports are added by our own
        `insert_imports`, which keeps the file's order of statements and its line style."""
        if transform is AddImportsVisitor:
            return insert_imports(tree, self.context.scratch.get(AddImportsVisitor.CONTEXT_KEY, []))
        instance = transform(self.context)
        if instance.get_inherited_dependencies():
            return instance.transform_module(tree)
        instance._handle_metadata_reference = lambda module: _without_copy(instance, module)
        return instance.transform_module(tree)

    # -- imports of the rewritten file ---------------------------------------------------

    def need(self, module: str, obj: str | None = None) -> None:
        AddImportsVisitor.add_needed_import(self.context, module, obj)

    def drop_import_of(self, node: cst.CSTNode) -> None:
        """Let libcst remove the import behind `node` if nothing else uses it any more."""
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

    # -- report --------------------------------------------------------------------------

    def site(self, rule: str, status: str, node: cst.CSTNode, what: str, reason: str) -> None:
        self.context.scratch[SITES_KEY].append(Site(rule, status, self.line_of(node), what, reason))
        if status == TODO:
            self.warn(f"line {self.line_of(node)}: {rule} {what}: {reason}")

    def keeps_fsdp1(self, rule: str, node: cst.CSTNode) -> None:
        """Note that this file still builds FSDP1 modules here (see [Note: what the tree keeps
        of FSDP1])."""
        self.context.scratch[FILE_FACTS_KEY]["kept"].append(f"line {self.line_of(node)} ({rule})")

    def fsdp1_kept_elsewhere(self) -> tuple[str, ...] | None:
        """Where the rest of the tree keeps FSDP1 constructors (None: the caller cannot know)."""
        kept = self.context.scratch.get(TREE_KEY)
        return None if kept is None else tuple(kept)

    def todo(self, rule: str, node: cst.CSTNode, what: str, reason: str) -> None:
        """Leave the enclosing statement as it is, under one tagged TODO comment."""
        reason += self.todo_context()
        self.site(rule, TODO, node, what, reason)
        if self._pending:
            self._pending[-1].todos.append((rule, f"{what}: {reason}"))

    def note(self, rule: str, text: str) -> None:
        """One tagged NOTE comment above the enclosing statement (none added on a second run)."""
        if self._pending:
            self._pending[-1].notes.append((rule, text))

    def todo_context(self) -> str:
        """What a TODO must add about where its statement ran (a rule family that removes an
        enclosing context says which it was)."""
        return ""

    def comment_above(self, *comments: str) -> None:
        if self._pending:
            self._pending[-1].comments.extend(comments)

    def insert_before(self, *statements: cst.BaseStatement) -> None:
        self._pending[-1].before.extend(statements)

    @property
    def at_statement(self) -> bool:
        return bool(self._pending)

    # -- statement stack -----------------------------------------------------------------

    def on_visit(self, node: cst.CSTNode) -> bool:
        if isinstance(node, cst.BaseStatement):
            self._pending.append(_Pending())
        return super().on_visit(node)

    def on_leave(self, original_node, updated_node):
        result = super().on_leave(original_node, updated_node)
        if isinstance(original_node, cst.BaseStatement):
            result = self._apply(self._pending.pop(), result)
        return result

    def _apply(self, pending: _Pending, result):
        if isinstance(result, cst.RemovalSentinel):
            return result
        statements = list(result.nodes) if isinstance(result, cst.FlattenSentinel) else [result]
        if not (pending.todos or pending.notes or pending.comments or pending.before):
            return result
        first = statements[0]
        comments = list(pending.comments)
        for tag, wishes in ((TODO_TAG, pending.todos), (NOTE_TAG, pending.notes)):
            seen = set()
            for rule, text in wishes:
                if rule in seen or has_todo(first.leading_lines, rule, tag):
                    continue  # one per rule and statement; none added on a second run
                seen.add(rule)
                comments.append(todo_comment(rule, text, tag))
        if pending.before:
            # The original leading lines (blank lines, comments) stay on top of the new block.
            head = pending.before[0].with_changes(leading_lines=first.leading_lines)
            statements = [head, *pending.before[1:], first.with_changes(leading_lines=[]), *statements[1:]]
            statements[0] = with_leading_comments(statements[0], comments)
        else:
            statements[0] = with_leading_comments(first, comments)
        return cst.FlattenSentinel(statements) if len(statements) > 1 else statements[0]
