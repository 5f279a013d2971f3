"""Adding the imports a rewrite needs, where the file's own imports are and in the file's style.

libcst's AddImportsVisitor puts new imports after the first run of imports at the top of the
file: above a `sys.path.insert(...)` that later imports depend on, and on one line however
long. Here a new import goes just above the file's own import of the same module (the one the
rewrite replaces, typically; inside the `if` / `try` that guards it, if it is guarded), or else
after the last top-level import that precedes the first function or class (so every statement
the user runs before importing still runs first); one statement per module, wrapped in
parentheses one name per line when longer than the file's own lines.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import libcst as cst
from libcst.helpers import get_full_name_for_node

# The line length new imports are wrapped at, unless the file's own lines are longer.
DEFAULT_LINE_LENGTH = 88
MAX_LINE_LENGTH = 120


def _is_import(statement: cst.BaseStatement) -> bool:
    """An import line, or a top-level `try:` / `if` whose body starts with imports."""
    if isinstance(statement, cst.SimpleStatementLine):
        return any(isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body)
    if isinstance(statement, (cst.Try, cst.If)) and isinstance(statement.body, cst.IndentedBlock):
        return bool(statement.body.body) and _is_import(statement.body.body[0])
    return False


def _guarded_body(statement: cst.BaseStatement) -> list[cst.BaseStatement]:
    """The statements of a top-level `if` / `try` block (its first branch), else []."""
    if isinstance(statement, (cst.If, cst.Try)) and isinstance(statement.body, cst.IndentedBlock):
        return list(statement.body.body)
    return []


def _bound(body: Sequence[cst.BaseStatement]) -> tuple[set[str], set[tuple[str, str]]]:
    """Modules imported plainly and (module, name) pairs imported unaliased, at top level or in
    the first branch of a top-level `if` / `try`."""
    modules: set[str] = set()
    names: set[tuple[str, str]] = set()
    for statement in [s for top in body for s in (top, *_guarded_body(top))]:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if isinstance(small, cst.Import):
                modules.update(get_full_name_for_node(a.name) or "" for a in small.names if a.asname is None)
            elif isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative:
                module = get_full_name_for_node(small.module) or ""
                if not isinstance(small.names, cst.ImportStar):
                    names.update((module, a.name.value) for a in small.names
                                 if a.asname is None and isinstance(a.name, cst.Name))
    return modules, names


def _anchor(body: Sequence[cst.BaseStatement]) -> int:
    """Index after which new imports go: the last import before the first def or class."""
    anchor = -1
    for index, statement in enumerate(body):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            break
        if _is_import(statement):
            anchor = index
    if anchor >= 0:
        return anchor
    # No import: after the docstring, if any.
    first = body[0] if body else None
    is_docstring = (isinstance(first, cst.SimpleStatementLine) and len(first.body) == 1
                    and isinstance(first.body[0], cst.Expr) and isinstance(first.body[0].value, cst.SimpleString))
    return 0 if is_docstring else -1


def _line_length(module: cst.Module) -> int:
    """The file's own longest line, within [DEFAULT_LINE_LENGTH, MAX_LINE_LENGTH]."""
    longest = max((len(line) for line in module.code.splitlines()), default=0)
    return min(MAX_LINE_LENGTH, max(DEFAULT_LINE_LENGTH, longest))


def _from_import(module: str, names: list[str], limit: int, newline: str) -> cst.SimpleStatementLine:
    line = f"from {module} import {', '.join(names)}"
    if len(line) > limit and len(names) > 1:
        line = f"from {module} import ({newline}" + "".join(f"    {n},{newline}" for n in names) + ")"
    return cst.parse_statement(line + newline)  # type: ignore[return-value]


def insert_imports(module: cst.Module, needed: Sequence) -> cst.Module:
    """`module` with the imports in `needed` (libcst ImportItems) that it does not have yet."""
    body = list(module.body)
    modules, names = _bound(body)
    plain = sorted({item.module for item in needed if item.obj_name is None and item.module not in modules})
    wanted: dict[str, list[str]] = defaultdict(list)
    for item in needed:
        if item.obj_name is not None and (item.module, item.obj_name) not in names:
            if item.obj_name not in wanted[item.module]:
                wanted[item.module].append(item.obj_name)
    if not plain and not wanted:
        return module
    limit, newline = _line_length(module), module.default_newline
    new = [(name, cst.parse_statement(f"import {name}{newline}")) for name in plain]
    new += [(name, _from_import(name, sorted(wanted[name]), limit, newline)) for name in sorted(wanted)]
    # Each new import goes just above the file's first top-level import of the same module (the
    # one the rewrite usually replaces), the others after the anchor, in order.
    place = {name: index for index, name in reversed(list(_top_level_modules(body)))}
    before: dict[int, list[cst.BaseStatement]] = defaultdict(list)  # above an import of the same module
    after: list[cst.BaseStatement] = []  # after the anchor
    for name, statement in new:
        if name in place:
            before[place[name]].append(statement)
        elif not _into_guarded_block(body, name, statement):
            after.append(statement)
    anchor = _anchor(body)
    result: list[cst.BaseStatement] = []
    for index, statement in enumerate(body):
        added = before.get(index, [])
        if added:  # the import's leading lines (blank lines, comments) stay above the block
            added[0] = added[0].with_changes(leading_lines=statement.leading_lines)
            statement = statement.with_changes(leading_lines=[])
        if index == 0 and anchor < 0:
            result += _at_top(after, statement)
        else:
            result += [*added, statement]
        if index == anchor:
            result += after
    return module.with_changes(body=result or after)


def _at_top(new: list[cst.BaseStatement], first: cst.BaseStatement) -> list[cst.BaseStatement]:
    """New imports above the file's first statement (a file without imports): the header
    comments stay on top, and a blank line separates the imports from the code."""
    if not new:
        return [first]
    new = [new[0].with_changes(leading_lines=first.leading_lines), *new[1:]]
    return [*new, first.with_changes(leading_lines=[cst.EmptyLine()])]


def _into_guarded_block(body: list[cst.BaseStatement], name: str, statement: cst.BaseStatement) -> bool:
    """Put `statement` above the import of module `name` in a top-level `if` / `try` block (the
    guard the file imports that module under: `if is_torch_distributed_available():`); False
    if no such block."""
    for index, top in enumerate(body):
        if isinstance(top, (cst.FunctionDef, cst.ClassDef)):
            return False
        inner = _guarded_body(top)
        at = next((i for i, module in _top_level_modules(inner) if module == name), None)
        if at is not None:
            moved = statement.with_changes(leading_lines=inner[at].leading_lines)
            inner[at:at + 1] = [moved, inner[at].with_changes(leading_lines=[])]
            body[index] = top.with_changes(body=top.body.with_changes(body=inner))
            return True
    return False


def _top_level_modules(body: Sequence[cst.BaseStatement]):
    """(index, module) for each top-level `from module import ...` and `import module`."""
    for index, statement in enumerate(body):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)):
            return
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if isinstance(small, cst.ImportFrom) and small.module is not None and not small.relative:
                yield index, get_full_name_for_node(small.module) or ""
            elif isinstance(small, cst.Import):
                for alias in small.names:
                    yield index, get_full_name_for_node(alias.name) or ""
