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
# Tag of a note: something the migration wrote that a reader would otherwise wonder about.
NOTE_TAG = "NOTE(fsdp-bridge"



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


def _line_break(whitespace) -> bool:
    return isinstance(whitespace, cst.ParenthesizedWhitespace)


def call_like(func: cst.BaseExpression, args: Sequence[cst.Arg], like: cst.Call) -> cst.Call:
    """A call of `func` with `args`, laid out as the call `like` it replaces.

    On one line: `, ` between arguments. One argument per line: every argument on its own line
    at the original indentation, each line's own trailing comment kept, the closing parenthesis
    (and a trailing comma) where it was.
    """
    args = list(args)
    old = list(like.args)
    multiline = _line_break(like.whitespace_before_args) or any(
        isinstance(a.comma, cst.Comma) and _line_break(a.comma.whitespace_after) for a in old)
    if not multiline or not args:
        args = [a.with_changes(comma=space_comma()) for a in args[:-1]] + (
            [args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)] if args else [])
        return fit(cst.Call(func=func, args=args), like)
    if not old:  # `f(\n)`: the new arguments one step in, the parenthesis where it was
        return _one_per_line(func, args, like.whitespace_before_args)
    between = next((a.comma.whitespace_after for a in old[:-1]
                    if isinstance(a.comma, cst.Comma) and _line_break(a.comma.whitespace_after)),
                   like.whitespace_before_args)
    if not _line_break(between):  # `f(a,\n  b)`: only the last break is known; use its line
        between = old[-2].comma.whitespace_after if len(old) > 1 else like.whitespace_before_args
    end = old[-1].comma if old else cst.MaybeSentinel.DEFAULT
    laid_out = []
    for index, arg in enumerate(args):
        own = arg.comma if isinstance(arg.comma, cst.Comma) and _line_break(arg.comma.whitespace_after) else None
        first_line = own.whitespace_after.first_line if own is not None else cst.TrailingWhitespace()
        if index == len(args) - 1:
            comma = end
            if isinstance(end, cst.Comma) and _line_break(end.whitespace_after):
                comma = end.with_changes(whitespace_after=end.whitespace_after.with_changes(first_line=first_line))
        elif own is not None and arg.comma is not end:  # (the old closing comma moves to the end)
            comma = own
        elif _line_break(between):
            comma = cst.Comma(whitespace_after=between.with_changes(first_line=first_line))
        else:
            comma = space_comma()
        # Only the last argument keeps what stood before the closing parenthesis (a line break
        # when it had a line of its own); an argument moved up from there would leave a blank line.
        after = old[-1].whitespace_after_arg if index == len(args) - 1 else cst.SimpleWhitespace("")
        laid_out.append(arg.with_changes(comma=comma, whitespace_after_arg=after))
    if not _line_break(like.whitespace_before_args):
        laid_out = _realigned(laid_out, len(code(func)) - len(code(like.func)))
    return cst.Call(func=func, args=laid_out, whitespace_before_args=like.whitespace_before_args)


def _realigned(args: list[cst.Arg], shift: int) -> list[cst.Arg]:
    """Arguments aligned under the opening parenthesis (`f(a,\n  b)`), moved by `shift` columns
    as the parenthesis moved with the new function's name (the closing parenthesis stays)."""
    if shift == 0:
        return args
    out = []
    for arg in args[:-1]:
        comma = arg.comma
        if isinstance(comma, cst.Comma) and _line_break(comma.whitespace_after):
            spaces = comma.whitespace_after.last_line.value
            if len(spaces) + shift >= 0 and not spaces.strip():
                comma = comma.with_changes(whitespace_after=comma.whitespace_after.with_changes(
                    last_line=cst.SimpleWhitespace(" " * (len(spaces) + shift))))
        out.append(arg.with_changes(comma=comma))
    return [*out, args[-1]]


def _one_per_line(func: cst.BaseExpression, args: Sequence[cst.Arg], closing) -> cst.Call:
    """`func(` then each argument on its own line, one step in from `closing`, the line on which
    the closing parenthesis stands (after a trailing comma)."""
    indent = closing.last_line.value if isinstance(closing, cst.ParenthesizedWhitespace) else ""
    step = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(indent + "    "))
    end = cst.ParenthesizedWhitespace(indent=True, last_line=cst.SimpleWhitespace(indent))
    laid_out = [a.with_changes(comma=cst.Comma(whitespace_after=step), whitespace_after_arg=cst.SimpleWhitespace(""))
                for a in args[:-1]]
    laid_out.append(args[-1].with_changes(comma=cst.Comma(whitespace_after=end),
                                          whitespace_after_arg=cst.SimpleWhitespace("")))
    return cst.Call(func=func, args=laid_out, whitespace_before_args=step)


# A rewritten call on one line longer than this (and than the call it replaces) is laid out one
# argument per line.
LONG_CALL = 100


def fit(call: cst.Call, like: cst.CSTNode) -> cst.Call:
    """`call`, one argument per line if on one line it is long and longer than `like`."""
    text = code(call)
    if "\n" in text or len(text) <= max(LONG_CALL, len(code(like))) or not call.args:
        return call
    return _one_per_line(call.func, call.args, None)


class _OnOneLine(cst.CSTTransformer):
    """Every call laid out over several lines, put back on one."""

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.Call:
        if not updated.args or "\n" not in code(updated):
            return updated
        args = [a.with_changes(comma=space_comma(), whitespace_after_arg=cst.SimpleWhitespace(""))
                for a in updated.args[:-1]]
        args.append(updated.args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT,
                                                  whitespace_after_arg=cst.SimpleWhitespace("")))
        return updated.with_changes(args=args, whitespace_before_args=cst.SimpleWhitespace(""))


# A line comment that speaks to a tool about its own line: moved below a broken call, it would
# no longer apply to the line the tool reports.
LINE_PRAGMAS = ("type: ignore", "noqa", "pragma:", "pyright: ignore")


def keep_pragma_line(original: cst.SimpleStatementLine,
                     updated: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    """`updated` on one line again if `original` was one line ending in a pragma comment
    (`# type: ignore`, `# noqa`...) and a rewrite broke a call of it over several lines."""
    comment = original.trailing_whitespace.comment
    if comment is None or not any(p in comment.value for p in LINE_PRAGMAS):
        return updated
    if any("\n" in code(small) for small in original.body):
        return updated  # the user's own layout: kept as it is
    return updated.with_changes(body=[small.visit(_OnOneLine()) for small in updated.body])


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


def todo_comment(rule: str, text: str, tag: str = TODO_TAG) -> str:
    """The one stable TODO line for a rule: `# TODO(fsdp-bridge FB101): text` (or, with
    `NOTE_TAG`, a note that asks nothing of the reader).

    `text` may quote multi-line code (an argument spanning lines, with its own comments): a
    comment is one line, so every run of whitespace becomes one space.
    """
    return f"# {tag} {rule}): {' '.join(text.split())}"


def has_todo(lines: Sequence[cst.EmptyLine], rule: str, tag: str = TODO_TAG) -> bool:
    marker = f"{tag} {rule})"
    return any(line.comment is not None and marker in line.comment.value for line in lines)


def with_leading_comments(
    statement: cst.BaseStatement, comments: Iterable[str]
) -> cst.BaseStatement:
    """Add comment lines just above `statement` (after its existing leading lines)."""
    new_lines = [cst.EmptyLine(comment=cst.Comment(text)) for text in comments]
    if not new_lines:
        return statement
    return statement.with_changes(leading_lines=[*statement.leading_lines, *new_lines])


def with_comments_of(removed: cst.SimpleStatementLine, kept: cst.SimpleStatementLine) -> cst.SimpleStatementLine:
    """`kept` carrying the comments of `removed`, a statement merged into it: its comment lines
    above `kept`, its end-of-line comment at the end of `kept` (or above it where `kept` has one)."""
    above = [line for line in removed.leading_lines if line.comment is not None]
    trailing = removed.trailing_whitespace
    if trailing.comment is not None and kept.trailing_whitespace.comment is None:
        kept = kept.with_changes(trailing_whitespace=trailing)
    elif trailing.comment is not None:
        above.append(cst.EmptyLine(comment=trailing.comment))
    return kept.with_changes(leading_lines=[*kept.leading_lines, *above])


def unwrap_with(with_node: cst.With) -> cst.FlattenSentinel:
    """A `with` block's statements at the with's level; header and footer comments kept."""
    suite = with_node.body
    if isinstance(suite, cst.SimpleStatementSuite):  # `with x: a; b` on one line
        suite = cst.IndentedBlock(body=[cst.SimpleStatementLine(body=suite.body)])
    body = list(suite.body)
    carried = comments_in(code(with_node.body)) if suite is not with_node.body else (
        comments_in(code(suite.header)) + [line.comment.value for line in suite.footer if line.comment]
    )
    body = [statement.with_changes(leading_lines=_blank_lines_emptied(statement.leading_lines))
            for statement in body]
    first = body[0].with_changes(leading_lines=[
        *with_node.leading_lines,
        *[cst.EmptyLine(comment=cst.Comment(c)) for c in carried],
        *body[0].leading_lines,
    ])
    return cst.FlattenSentinel([first, *body[1:]])


def _blank_lines_emptied(lines: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    """Blank lines of a block that moves out one level, printed empty rather than as the new
    indentation alone (comment lines keep theirs)."""
    return [line if line.comment is not None else line.with_changes(indent=False, whitespace=cst.SimpleWhitespace(""))
            for line in lines]
