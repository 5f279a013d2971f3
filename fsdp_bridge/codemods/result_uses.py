"""How a file uses the result of an FSDP1 optimizer state-dict call, read before the rewrite.

FSDP1's optimizer statics return a state dict; torch's checkpoint helpers differ in what they
return: `set_optimizer_state_dict` loads the state itself (FSDP1 returned one for
`optim.load_state_dict`), and `get_optimizer_state_dict` may share some tensors with the optimizer
(FSDP1 returned copies). The runtime helpers hide those differences. Where the file shows that
the difference cannot matter, the call can be torch's own:

- a *load*: `state = FSDP.optim_state_dict_to_load(...)` (or `scatter_full_optim_state_dict`)
  directly followed by `optim.load_state_dict(state)`, the name used nowhere else: the pair is
  one `set_optimizer_state_dict(...)`;
- a *save*: `state = FSDP.full_optim_state_dict(...)` whose name is used only inside
  `torch.save(...)` in the next statement: the file serialises it before any optimizer step.
"""

from __future__ import annotations

import dataclasses

import libcst as cst
import libcst.matchers as m

from fsdp_bridge.codemods.helpers import dotted

LOAD, SAVE = "load", "save"


@dataclasses.dataclass(frozen=True)
class ResultUse:
    kind: str  # LOAD or SAVE
    assignment: cst.SimpleStatementLine  # `state = FSDP.<static>(...)`
    follower: cst.BaseStatement  # the statement after it
    name: cst.Name  # `state`, as assigned
    optimizer: str | None  # LOAD: the receiver of `.load_state_dict(state)`


def _assigned_call(statement: cst.BaseStatement) -> tuple[cst.Name, cst.Call] | None:
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    small = statement.body[0]
    if (isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
            and isinstance(small.value, cst.Call)):
        return small.targets[0].target, small.value
    return None


def _loads(statement: cst.BaseStatement, name: str) -> str | None:
    """The optimizer of `optim.load_state_dict(name)` when that is the whole statement, no comment on it."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    if any(line.comment for line in statement.leading_lines) or statement.trailing_whitespace.comment:
        return None
    call = statement.body[0].value if isinstance(statement.body[0], cst.Expr) else None
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and call.func.attr.value == "load_state_dict" and len(call.args) == 1):
        return None
    arg = call.args[0]
    if arg.keyword or arg.star or not (isinstance(arg.value, cst.Name) and arg.value.value == name):
        return None
    return dotted(call.func.value)


def result_uses(module: cst.Module) -> dict[int, ResultUse]:
    """By the id of each call assigned to a name: its LOAD or SAVE use (syntax only; the caller
    checks names, scopes and `torch.save` against the file's metadata)."""
    found: dict[int, ResultUse] = {}
    bodies = [module.body, *(block.body for block in m.findall(module, m.IndentedBlock()))]
    for body in bodies:
        for first, follower in zip(body, body[1:]):
            assigned = _assigned_call(first)
            if assigned is None:
                continue
            name, call = assigned
            optimizer = _loads(follower, name.value)
            found[id(call)] = ResultUse(LOAD if optimizer else SAVE, first, follower, name, optimizer)
    return found
