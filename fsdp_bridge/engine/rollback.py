"""Undo a wrap that failed: the user's model comes back exactly as it was.

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
goes on.

Otherwise only references are kept: the original parameter tensors stay alive until the wrap
has finished (they were alive before it anyway; the shards made meanwhile are the only extra
memory), then are freed as before.
Local only: nothing is communicated, so a failure on one rank alone cannot hang the others here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Optional

import torch
from torch import nn


@dataclasses.dataclass
class _ModuleState:
    module: nn.Module
    cls: type
    attributes: dict[str, Any]
    nested: dict[str, dict]  # the dictionaries among the attributes, copied one level


@dataclasses.dataclass
class _ParamState:
    param: nn.Parameter
    data: torch.Tensor
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
    with torch.no_grad():
        param.grad = None  # first: a gradient must fit the tensor it is assigned to
        param.data = state.data
        param.requires_grad_(state.requires_grad)
        param.grad = state.grad
    param.__dict__.clear()
    param.__dict__.update(state.attributes)


@contextlib.contextmanager
def restored_on_failure(model: nn.Module, buffer_values: bool = False):
    """Run the body; if it raises, put `model` back exactly as it was (see [Note: a failed
    wrap changes nothing]) and re-raise. `buffer_values`: the body may write into buffers."""
    modules = [_record_module(m) for m in model.modules()]
    params = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None and id(param) not in params:
                params[id(param)] = _ParamState(param, param.data, param.grad,
                                                param.requires_grad, dict(param.__dict__))
    buffers = [(b, b.detach().clone()) for m in model.modules()
               for b in m._buffers.values() if b is not None] if buffer_values else []
    try:
        yield
    except BaseException:
        for module_state in modules:
            _restore_module(module_state)
        for param_state in params.values():
            _restore_param(param_state)
        with torch.no_grad():
            for buffer, value in buffers:
                if buffer.shape == value.shape:
                    buffer.copy_(value)
        raise
