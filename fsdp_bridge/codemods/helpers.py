"""The libcst helpers every codemod shares: reading nodes, building arguments, keeping comments.

All of them are plain functions of nodes and code; none needs a codemod's metadata. Rule
families import them from here and nowhere else.
"""

from __future__ import annotations

import io
import tokenize
from collections import Counter
from typing import Iterable, Sequence

import libcst as cst
import libcst.matchers as m

# Tag that marks our comments; a second run finds it and adds nothing.
TODO_TAG = "TODO(fsdp-bridge"



# -- reading nodes -----------------------------------------------------------------------------

def code(node: cst.CSTNode) -> str:
    """The source text of a node, as libcst would print it."""
    return cst.Module([]).code_for_node(node)


def dotted(node: cst.BaseExpression) -> str | None:
    """`self.model` -> "self.model"; None for anything that is not a name or attribute chain."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr.value}"
    return None


def leftmost(node: cst.BaseExpression) -> cst.BaseExpression:
    """`a` for `a.b.c`."""
    while isinstance(node, cst.Attribute):
        node = node.value
    return node


def is_literal(node: cst.BaseExpression, *values: str) -> bool:
    """True if `node` is one of the literal constants `None`, `True`, `False` given."""
    return isinstance(node, cst.Name) and node.value in values


def parse_expr(source: str) -> cst.BaseExpression:
    return cst.parse_expression(source)


def parse_stmt(source: str) -> cst.BaseStatement:
    return cst.parse_statement(source)


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


def names_bound_by_imports(module: cst.Module) -> set[str] | None:
    """Every name an import binds anywhere in the file (None after a star import: unknown)."""
    names: set[str] = set()
    for node in m.findall(module, m.Import() | m.ImportFrom()):
        if isinstance(node.names, cst.ImportStar):
            return None
        for alias in node.names:
            if alias.asname is not None:
                names.add(alias.asname.name.value)
            elif isinstance(node, cst.Import):
                names.add(code(alias.name).split(".")[0])
            else:
                names.add(alias.name.value)
    return names


def is_import_line(statement: cst.BaseStatement) -> bool:
    return isinstance(statement, cst.SimpleStatementLine) and any(
        isinstance(small, (cst.Import, cst.ImportFrom)) for small in statement.body
    )


# -- building arguments ------------------------------------------------------------------------

# New nodes each time: one node object in two places of a tree would share its metadata.

def space_comma() -> cst.Comma:
    """The `, ` between two items."""
    return cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))


def tight_equal() -> cst.AssignEqual:
    """The `=` of a keyword argument, with no spaces around it."""
    return cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def keyword_arg(keyword: str, value: str) -> cst.Arg:
    """`keyword=value`, as in a call."""
    return cst.Arg(value=parse_expr(value), keyword=cst.Name(keyword), equal=tight_equal())


def rebuild_args(original: Sequence[cst.Arg], kept: list[cst.Arg]) -> list[cst.Arg]:
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


def append_args(args: Sequence[cst.Arg], extra: list[cst.Arg]) -> list[cst.Arg]:
    """Append keyword arguments, following the call's one-per-line layout if it has one."""
    args = list(args)
    if not args:
        return extra
    last = args[-1]
    comma = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) else space_comma()
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


# -- comments ----------------------------------------------------------------------------------

def comments_in(source: str) -> list[str]:
    """Every `# comment` in a snippet of code (used to carry comments out of removed code)."""
    found = []
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type == tokenize.COMMENT:
                found.append(token.string)
    except (tokenize.TokenError, IndentationError):  # a fragment: keep what was read
        pass
    return found


def drops_a_comment(before: str, after: str) -> bool:
    """True if a comment of `before` is in no comment of `after` (moved into a TODO counts)."""
    kept = comments_in(after)
    missing = Counter(comments_in(before)) - Counter(kept)
    return any(not any(comment in other for other in kept) for comment in missing)


def lost_comments(before: cst.CSTNode, after: cst.CSTNode, moved: list[str]) -> list[str]:
    """Comments of `before` that neither `after` nor the `moved` list still holds."""
    remaining = Counter(comments_in(code(before)))
    remaining.subtract(comments_in(code(after)))
    remaining.subtract(moved)
    return [comment for comment, count in remaining.items() for _ in range(count) if count > 0]


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


def unwrap_with(with_node: cst.With) -> cst.FlattenSentinel:
    """A `with` block's statements at the with's level; header and footer comments kept."""
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
