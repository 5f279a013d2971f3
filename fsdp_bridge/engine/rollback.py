"""Undo a wrap that failed: the user's model comes back as it was.

[Note: a failed wrap changes nothing]
Wrapping changes the model in many places before it can fail: nested wrappers are released,
meta modules get storage, parameters become 1-D views of flat shards, buffers are cast, hooks
and engine state are attached. An exception anywhere in there (a bad argument only found once
flattening has begun, ranks that disagree, a broken `param_init_fn`) must not leave a
half-sharded model behind: the user may catch it and go on with the model.

So the wrap runs inside `restored_on_failure(model)`, which records, for every module of the
tree, its class and its attribute dictionary (one level of the dictionaries in it: parameters,
buffers, children, hooks), and for every parameter its tensor, gradient, `requires_grad` and
attributes; with `buffer_values`, also a copy of every buffer (`sync_module_states` overwrites
them in place; nothing else does). On an exception all of it is put back and the exception
goes on. A wrap nested in another over the same model (a front-end's around the engine's)
shares the outer record: the outermost one puts the model back.

[Note: a failed wrap holds no second copy]
The engine shards unit by unit and frees each unit's full parameters once its shards exist, so
the wrap never holds the whole model. The record must not hold it either: when a unit is
sharded the engine hands its parameters to `WrapRecord.release_originals`, and the record lets
go of the original tensors it can give back from the shards. On a failure it gathers them
again, unit by unit (see `release_originals` for which are kept instead, and when). What a
failure leaves, by starting point:
- a model on meta: back on meta (the meta tensors cost nothing to keep);
- a real model (on the wrap's device, or moved to it): the same values, gathered from the
  shards back onto their original device, in tensors of their own (a parameter that was a view
  of a larger tensor comes back as a tensor of its own, equal in value);
- real on rank 0 and meta elsewhere (`sync_module_states`): rank 0 gets its values back, the
  others get their meta tensors back; ranks other than 0 that were real keep their own values
  until the wrap ends (the broadcast overwrote them in the shards).
Gathering is a collective: every rank runs the same rollback, which holds when the failure is
seen by every rank (the engine checks that ranks agree unit by unit, after materialising, before
any other collective of the unit). A failure on one rank alone past that point leaves the others
waiting in their next collective, as any collective program would.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from fsdp_bridge.engine.layout import HIDDEN_ORIGINALS, OWNER_ATTRIBUTE

_ACTIVE: dict[int, "WrapRecord"] = {}  # id(model) -> the record of the wrap under way


@dataclasses.dataclass
class _ModuleState:
    module: nn.Module
    cls: type
    attributes: dict[str, Any]
    nested: dict[str, dict]  # the dictionaries among the attributes, copied one level


@dataclasses.dataclass
class _ParamState:
    param: nn.Parameter
    data: Optional[torch.Tensor]  # None: released, gathered again on failure
    device: torch.device
    grad: Optional[torch.Tensor]
    requires_grad: bool
    attributes: dict[str, Any]


def _record_module(module: nn.Module) -> _ModuleState:
    attributes = dict(module.__dict__)
    nested = {k: dict(v) for k, v in attributes.items() if isinstance(v, dict)}
    return _ModuleState(module, type(module), attributes, nested)


def _restore_module(state: _ModuleState) -> None:
    module = state.module
    current = module.__dict__
    for key in [k for k in current if k not in state.attributes]:
        del current[key]
    for key, value in state.attributes.items():
        if key in state.nested:
            # The same dictionary object, refilled: hook handles hold weak references to it.
            value.clear()
            value.update(state.nested[key])
        current[key] = value
    if type(module) is not state.cls:
        module.__class__ = state.cls


def _restore_param(state: _ParamState) -> None:
    param = state.param
    assert state.data is not None, "a released parameter was not gathered back"
    with torch.no_grad():
        param.grad = None  # first: a gradient must fit the tensor it is assigned to
        param.data = state.data
        param.requires_grad_(state.requires_grad)
        param.grad = state.grad
    param.__dict__.clear()
    param.__dict__.update(state.attributes)


class WrapRecord:
    """What `restored_on_failure` keeps to put the model back (see [Note: a failed wrap changes
    nothing])."""

    def __init__(self, model: nn.Module, buffer_values: bool):
        self.modules = [_record_module(m) for m in model.modules()]
        self.params: dict[int, _ParamState] = {}
        for module in model.modules():
            for registered in module._parameters.values():
                # A flat parameter's originals too: a released nested wrapper refills them.
                for param in (registered, *getattr(registered, HIDDEN_ORIGINALS, ())):
                    if param is not None and id(param) not in self.params:
                        self.params[id(param)] = _ParamState(
                            param, param.data, param.device, param.grad,
                            param.requires_grad, dict(param.__dict__))
        self.buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rebuilds: list[tuple[Sequence[nn.Parameter], Callable[[], Sequence[torch.Tensor]]]] = []
        if buffer_values:
            self.copy_buffer_values(model)

    def copy_buffer_values(self, model: nn.Module) -> None:
        if self.buffers:
            return
        self.buffers = [(b, b.detach().clone()) for m in model.modules()
                        for b in m._buffers.values() if b is not None]

    def release_originals(self, params: Sequence[nn.Parameter],
                          rebuild: Callable[[], Sequence[torch.Tensor]], keep: bool) -> None:
        """`params` now live in shards: stop holding their original tensors (see [Note: a failed
        wrap holds no second copy]), except those that cost nothing (meta), those that were
        shards of another wrap when this one began (a released nested wrapper's, which it keeps),
        and, with `keep`, every real one (values the shards do not hold: a rank whose own
        values `sync_module_states` overwrote). On failure `rebuild()`, a collective every rank
        runs for the same parameters in the same order, gives the full values back."""
        for param in params:
            state = self.params.get(id(param))
            if state is None or state.data is None or state.data.is_meta:
                continue
            if keep or OWNER_ATTRIBUTE in state.attributes:
                continue
            state.data = None
        self.rebuilds.append((list(params), rebuild))

    def restore(self) -> None:
        with torch.no_grad():
            for params, rebuild in self.rebuilds:  # every rank gathers, needed or not
                for param, value in zip(params, rebuild()):
                    state = self.params.get(id(param))
                    if state is not None and state.data is None:
                        state.data = value.to(state.device, copy=True)
        for module_state in self.modules:
            _restore_module(module_state)
        for param_state in self.params.values():
            _restore_param(param_state)
        with torch.no_grad():
            for buffer, value in self.buffers:
                if buffer.shape == value.shape:
                    buffer.copy_(value)


@contextlib.contextmanager
def restored_on_failure(model: nn.Module, buffer_values: bool = False):
    """Run the body; if it raises, put `model` back as it was (see [Note: a failed wrap changes
    nothing]) and re-raise. `buffer_values`: the body may write into buffers. Yields the
    `WrapRecord`, shared with an enclosing `restored_on_failure` over the same model."""
    outer = _ACTIVE.get(id(model))
    if outer is not None:
        if buffer_values:
            outer.copy_buffer_values(model)
        yield outer
        return
    record = WrapRecord(model, buffer_values)
    _ACTIVE[id(model)] = record
    try:
        yield record
    except BaseException:
        record.restore()
        raise
    finally:
        _ACTIVE.pop(id(model), None)
