"""How a file uses the result of an FSDP1 optimizer state-dict call, read before the rewrite.

FSDP1's optimizer statics return a state dict; torch's checkpoint helpers differ in what they
return: `set_optimizer_state_dict` loads the state itself (FSDP1 returned one for
`optim.load_state_dict`), and `get_optimizer_state_dict` may share some tensors with the optimizer
(FSDP1 returned copies). The runtime helpers hide those differences. Where the file shows that
the difference cannot matter, the call can be torch's own:

- a *load*: `state = FSDP.optim_state_dict_to_load(...)` (or `scatter_full_optim_state_dict`)
  directly followed by `optim.load_state_dict(state)`, the name used nowhere else, or the call
  written inside `optim.load_state_dict(...)`: the pair is one `set_optimizer_state_dict(...)`
  (the comments of the load move onto it);
- a *save*: `state = FSDP.full_optim_state_dict(...)` whose name is used only inside
  `torch.save(...)` in the next statement: the file serialises it before any optimizer step.

The statement after the last one of a `with FSDP.state_dict_type(...)` block is the one after
the block: the usual save takes the state inside the block and saves it after.
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
    assignment: cst.SimpleStatementLine | None  # `state = FSDP.<static>(...)`; None: loaded directly
    follower: cst.BaseStatement  # the statement after it; loaded directly: the statement of the load
    name: cst.Name | None  # `state`, as assigned
    optimizer: str | None  # LOAD: the receiver of `.load_state_dict(state)`


def _assigned_call(statement: cst.BaseStatement) -> tuple[cst.Name, cst.Call] | None:
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    small = statement.body[0]
    if (isinstance(small, cst.Assign) and len(small.targets) == 1 and isinstance(small.targets[0].target, cst.Name)
            and isinstance(small.value, cst.Call)):
        return small.targets[0].target, small.value
    return None


def _load_statement(statement: cst.BaseStatement) -> tuple[str, cst.BaseExpression] | None:
    """(the optimizer, the argument) of a statement that is only `optim.load_state_dict(argument)`."""
    if not isinstance(statement, cst.SimpleStatementLine) or len(statement.body) != 1:
        return None
    call = statement.body[0].value if isinstance(statement.body[0], cst.Expr) else None
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute)
            and call.func.attr.value == "load_state_dict" and len(call.args) == 1):
        return None
    arg, optimizer = call.args[0], dotted(call.func.value)
    if arg.keyword or arg.star or optimizer is None:
        return None
    return optimizer, arg.value


def _loads(statement: cst.BaseStatement, name: str) -> str | None:
    """The optimizer of `optim.load_state_dict(name)` when that is the whole statement."""
    load = _load_statement(statement)
    if load is None:
        return None
    optimizer, value = load
    return optimizer if isinstance(value, cst.Name) and value.value == name else None


def _loaded_directly(statement: cst.BaseStatement) -> tuple[cst.Call, str] | None:
    """(the call, the optimizer) of a statement `optim.load_state_dict(<call>)`."""
    load = _load_statement(statement)
    return (load[1], load[0]) if load is not None and isinstance(load[1], cst.Call) else None


def _is_state_dict_type_block(statement: cst.BaseStatement) -> bool:
    """`with FSDP.state_dict_type(...):` (every item): leaving it runs nothing of the file's own."""
    return isinstance(statement, cst.With) and all(
        isinstance(item.item, cst.Call) and (dotted(item.item.func) or "").split(".")[-1] == "state_dict_type"
        for item in statement.items)


def _followers(module: cst.Module) -> dict[int, cst.BaseStatement]:
    """By statement id, the statement that runs next. The last statement of a `state_dict_type`
    block is followed by the statement after the block (`optim_state = ...` inside it, then
    `torch.save(optim_state, path)` after it)."""
    followers: dict[int, cst.BaseStatement] = {}
    bodies = [module.body, *(block.body for block in m.findall(module, m.IndentedBlock()))]
    for body in bodies:
        followers.update((id(first), follower) for first, follower in zip(body, body[1:]))
    blocks = [s for body in bodies for s in body if _is_state_dict_type_block(s) and s.body.body]
    # Outer blocks first: an inner block that ends an outer one takes the outer one's follower.
    for block in sorted(blocks, key=lambda b: -len(m.findall(b, m.With()))):
        if id(block) in followers:
            followers[id(block.body.body[-1])] = followers[id(block)]
    return followers


def result_uses(module: cst.Module) -> dict[int, ResultUse]:
    """By the id of each call assigned to a name: its LOAD or SAVE use (syntax only; the caller
    checks names, scopes and `torch.save` against the file's metadata)."""
    found: dict[int, ResultUse] = {}
    bodies = [module.body, *(block.body for block in m.findall(module, m.IndentedBlock()))]
    followers = _followers(module)
    for first in (statement for body in bodies for statement in body):
        direct = _loaded_directly(first)
        if direct is not None:
            found[id(direct[0])] = ResultUse(LOAD, None, first, None, direct[1])
        assigned, follower = _assigned_call(first), followers.get(id(first))
        if assigned is None or follower is None:
            continue
        name, call = assigned
        optimizer = _loads(follower, name.value)
        found[id(call)] = ResultUse(LOAD if optimizer else SAVE, first, follower, name, optimizer)
    return found
