"""Casting the floating-point tensors inside a forward's inputs or outputs.

Forward inputs come in whatever containers a model takes: tuples, lists, dicts, namedtuples,
dataclasses (Hugging Face's `ModelOutput` is one, and an OrderedDict too). The containers FSDP
walks are walked here, each rebuilt as FSDP rebuilds it, so that a cast reaches the same tensors
and the module receives the same kinds of objects under either.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """`value` with every floating tensor inside it cast to `dtype` (others left as they are)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # Field by field, on a copy: the caller's object is left as it was.
        changes = {field.name: cast_floating(getattr(value, field.name), dtype)
                   for field in dataclasses.fields(value) if field.init}
        return dataclasses.replace(value, **changes)
    if isinstance(value, OrderedDict):
        rebuilt = type(value)()
        for key, item in value.items():
            rebuilt[key] = cast_floating(item, dtype)
        return rebuilt
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    if isinstance(value, PackedSequence):  # left as it is, as FSDP leaves it
        return value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_floating(item, dtype) for item in value))
    if isinstance(value, (list, tuple, set)):
        return type(value)(cast_floating(item, dtype) for item in value)
    return value
