"""Shared pieces of the fsdp-bridge codemods: name resolution, report sites, TODO comments.

Every codemod in this package matches torch/YaFSDP/Zeta/TorchAcc names by *qualified name*
(libcst's QualifiedNameProvider), never by text: `FSDP`, `x.FullyShardedDataParallel` after
`import torch.distributed.fsdp as x`, and imports inside functions all resolve to the same
canonical name, while a local class that happens to be called `FullyShardedDataParallel` does not.

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
import io
import tokenize
from typing import Iterable, Sequence

import libcst as cst
from libcst.codemod import CodemodContext, VisitorBasedCodemodCommand
from libcst.codemod.visitors import AddImportsVisitor
from libcst.metadata import MetadataWrapper, PositionProvider, QualifiedNameProvider, QualifiedNameSource

# Where the runtime helpers live (the rewritten code imports them from here).
RUNTIME_MODULE = "fsdp_bridge.migrate.runtime"

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

# Tag that marks our comments; a second run finds it and adds nothing.
TODO_TAG = "TODO(fsdp-bridge"

# The modules whose public names are FSDP1's (and FSDP2's, which live next to them).
FSDP_MODULES = (
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
)

# Private FSDP1 internals: there is no translation, only a TODO.
PRIVATE_FSDP_PREFIX = "torch.distributed.fsdp._"
# torch's own FSDP2 implementation lives under a private name too; it is not FSDP1's internals.
FSDP2_PRIVATE_PREFIX = "torch.distributed.fsdp._fully_shard"
PRIVATE_ATTRIBUTES = frozenset(
    {"_fsdp_wrapped_module", "_flat_param", "_handle", "_handles", "_all_handles", "_lazy_init", "_fsdp_state"}
)

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


def is_private_fsdp1(qualified: str) -> bool:
    """`torch.distributed.fsdp._runtime_utils...` (FSDP1 internals), not `..._fully_shard` (FSDP2)."""
    name = qualified + "."
    return name.startswith(PRIVATE_FSDP_PREFIX) and not name.startswith(FSDP2_PRIVATE_PREFIX + ".")


def fsdp_module(module: str) -> bool:
    """True for an FSDP module path (`torch.distributed.fsdp`, `...fsdp.wrap`, ...)."""
    return module in FSDP_MODULES


def fsdp_name(qualified: str) -> str | None:
    """`torch.distributed.fsdp.wrap.ModuleWrapPolicy` -> `ModuleWrapPolicy` (None if not FSDP's)."""
    for module in FSDP_MODULES:
        if qualified.startswith(module + ".") and not qualified.startswith(PRIVATE_FSDP_PREFIX):
            return qualified[len(module) + 1 :]
    return None


def comments_in(code: str) -> list[str]:
    """Every `# comment` in a snippet of code (used to carry comments out of removed code)."""
    found = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(code).readline):
            if token.type == tokenize.COMMENT:
                found.append(token.string)
    except (tokenize.TokenError, IndentationError):  # a fragment: keep what was read
        pass
    return found


def _lost_comments(before: str, after: str) -> bool:
    """True if a comment of `before` is in no comment of `after` (moved into a TODO counts)."""
    from collections import Counter

    kept = comments_in(after)
    missing = Counter(comments_in(before)) - Counter(kept)
    return any(not any(comment in other for other in kept) for comment in missing)


def todo_comment(rule: str, text: str) -> str:
    """The one stable TODO line for a rule: `# TODO(fsdp-bridge FB101): text`.

    `text` may quote multi-line code (an argument spanning lines, with its own comments): a
    comment is one line, so every run of whitespace becomes one space.
    """
    return f"# {TODO_TAG} {rule}): {' '.join(text.split())}"


def has_todo(lines: Sequence[cst.EmptyLine], rule: str) -> bool:
    marker = f"{TODO_TAG} {rule})"
    return any(line.comment is not None and marker in line.comment.value for line in lines)


def with_leading_comments(
    statement: cst.BaseStatement, comments: Iterable[str]
) -> cst.BaseStatement:
    """Add comment lines just above `statement` (after its existing leading lines)."""
    new_lines = [cst.EmptyLine(comment=cst.Comment(text)) for text in comments]
    if not new_lines:
        return statement
    return statement.with_changes(leading_lines=[*statement.leading_lines, *new_lines])


def dotted(node: cst.BaseExpression) -> str | None:
    """`self.model` -> "self.model"; None for anything that is not a name or attribute chain."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def parse_expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


def parse_stmt(code: str) -> cst.BaseStatement:
    return cst.parse_statement(code)


def call_arguments(call: cst.Call, names: Sequence[str]) -> dict[str, cst.Arg] | None:
    """Map a call's arguments onto a signature's parameter names.

    Returns None when the call uses `*args` / `**kwargs` or a name outside `names` (the caller
    then falls back to the runtime helper, which receives the arguments untouched).
    """
    bound: dict[str, cst.Arg] = {}
    for index, arg in enumerate(call.args):
        if arg.star:
            return None
        if arg.keyword is None:
            if index >= len(names):
                return None
            bound[names[index]] = arg
        elif arg.keyword.value in names:
            bound[arg.keyword.value] = arg
        else:
            return None
    return bound


def is_literal(node: cst.BaseExpression, *values: str) -> bool:
    """True if `node` is one of the literal constants `None`, `True`, `False` given."""
    return isinstance(node, cst.Name) and node.value in values


BUILTINS_WE_MATCH = frozenset({"isinstance", "issubclass", "type"})


def _names_bound_by_imports(module: cst.Module) -> set[str] | None:
    """Every name an import binds anywhere in the file (None after a star import: unknown)."""
    import libcst.matchers as m

    names: set[str] = set()
    for node in m.findall(module, m.Import() | m.ImportFrom()):
        if isinstance(node.names, cst.ImportStar):
            return None
        for alias in node.names:
            if alias.asname is not None:
                names.add(alias.asname.name.value)
            elif isinstance(node, cst.Import):
                names.add(cst.Module([]).code_for_node(alias.name).split(".")[0])
            else:
                names.add(alias.name.value)
    return names


def _is_import_line(statement: cst.BaseStatement) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and any(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body
    )


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
    comments: list[str] = dataclasses.field(default_factory=list)
    before: list[cst.BaseStatement] = dataclasses.field(default_factory=list)


class FsdpCodemod(VisitorBasedCodemodCommand):
    """Base class: name resolution, site recording, and statement-level edits."""

    # Positions are resolved lazily (see line_of): only files with sites pay for them.
    METADATA_DEPENDENCIES = (QualifiedNameProvider,)

    def __init__(self, context: CodemodContext) -> None:
        super().__init__(context)
        self._pending: list[_Pending] = []
        self.context.scratch.setdefault(SITES_KEY, [])
        self.context.scratch.setdefault(FILE_FACTS_KEY, {"kept": [], "narrowed": False})

    # -- whole-module guard ----------------------------------------------------------------

    remove_unused_imports = True

    def transform_module(self, tree: cst.Module) -> cst.Module:
        """Transform; if libcst's import clean-up took a comment with it, redo without clean-up.

        RemoveImportsVisitor drops an unused import statement together with the comment lines
        above it. An unused import is harmless; a lost comment is not (DESIGN §6).
        """
        result = super().transform_module(tree)
        if not self.remove_unused_imports or not _lost_comments(tree.code, result.code):
            return result
        for key in (SITES_KEY, "AddImportsVisitor", "RemoveImportsVisitor"):
            self.context.scratch.pop(key, None)
        self.context.scratch[SITES_KEY] = []
        self.context.scratch[FILE_FACTS_KEY] = {"kept": [], "narrowed": False}
        del self.context.warnings[:]
        self.remove_unused_imports = False
        return super().transform_module(tree)

    # -- names ---------------------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        self._bound_by_import = _names_bound_by_imports(node)

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

    def qualified(self, node: cst.CSTNode) -> set[str]:
        if not self._may_be_imported(node):
            return set()
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def imported(self, node: cst.CSTNode) -> bool:
        """True if `node` names something from an import or a builtin (not a local object)."""
        return self._may_be_imported(node) and any(
            q.source in (QualifiedNameSource.IMPORT, QualifiedNameSource.BUILTIN)
            for q in self.get_metadata(QualifiedNameProvider, node, set())
        )

    def fsdp(self, node: cst.CSTNode) -> str | None:
        """The FSDP name `node` refers to (`FullyShardedDataParallel`, `ShardingStrategy.X`...).

        None also when the name is bound to FSDP's *or* something else depending on which
        branch ran (`try: from torch...fsdp import FSDP / except ImportError: FSDP = None`):
        such a name is not FSDP's for certain (see `ambiguous`).
        """
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

    # -- report --------------------------------------------------------------------------

    def line_of(self, node: cst.CSTNode) -> int:
        positions = self.context.wrapper.resolve(PositionProvider) if self.context.wrapper else {}
        position = positions.get(node)
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
        """libcst's follow-up passes (adding imports), without copying the tree when they need
        no metadata: the copy would be the most expensive part of the pass."""
        instance = transform(self.context)
        if instance.get_inherited_dependencies():
            return instance.transform_module(tree)
        instance._handle_metadata_reference = lambda module: _without_copy(instance, module)
        if transform is not AddImportsVisitor:
            return instance.transform_module(tree)
        # AddImportsVisitor reads and edits only the imports at the top of the file; running it
        # on the statements up to the last top-level import gives the same result, in a
        # fraction of the time on large files.
        last = max((i for i, statement in enumerate(tree.body) if _is_import_line(statement)), default=0)
        head = instance.transform_module(tree.with_changes(body=tree.body[: last + 1]))
        return tree.with_changes(body=[*head.body, *tree.body[last + 1 :]], header=head.header)

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
        self.site(rule, TODO, node, what, reason)
        if self._pending:
            self._pending[-1].todos.append((rule, f"{what}: {reason}"))

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
        if not (pending.todos or pending.comments or pending.before):
            return result
        first = statements[0]
        comments = list(pending.comments)
        seen = set()
        for rule, text in pending.todos:
            if rule in seen or has_todo(first.leading_lines, rule):
                continue  # one TODO per rule and statement; none added on a second run
            seen.add(rule)
            comments.append(todo_comment(rule, text))
        if pending.before:
            # The original leading lines (blank lines, comments) stay on top of the new block.
            head = pending.before[0].with_changes(leading_lines=first.leading_lines)
            statements = [head, *pending.before[1:], first.with_changes(leading_lines=[]), *statements[1:]]
            statements[0] = with_leading_comments(statements[0], comments)
        else:
            statements[0] = with_leading_comments(first, comments)
        return cst.FlattenSentinel(statements) if len(statements) > 1 else statements[0]
