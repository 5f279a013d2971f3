"""The arguments of the checkpoint functions, checked before anything is read, written or
communicated: a wrong one is refused on every rank alike, with an error naming the function,
the argument, the value received, what is accepted and the fix (never an error from deep
inside torch that names none of them)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fsdp_bridge.translation import bad_argument, check_bool

PACKAGE = "fsdp_bridge.checkpoint"
# The keys `training_state` fills itself: an `extra` entry of the same name would replace them.
RESERVED_KEYS = ("model", "optim")


def check_path(function: str, value: Any, argument: str = "path",
               call: str = "save_state(path, model, optimizer)") -> None:
    """A checkpoint directory: a str or an os.PathLike. Names a swap of path and model."""
    if isinstance(value, (str, os.PathLike)):
        return
    swapped = isinstance(value, (nn.Module, Mapping))
    example = "'ckpt'" if argument == "root" else "'ckpt/step_100'"
    fix = (f"The arguments may be swapped: the directory comes first, {call}." if swapped
           else f"Pass the checkpoint directory, the same on every rank: {call} with "
           f"{argument}={example}.")
    raise bad_argument(f"{PACKAGE}.{function}", argument, value,
                       "a str or os.PathLike naming the checkpoint directory", fix,
                       exc=TypeError)


def check_model(function: str, value: Any) -> None:
    if not isinstance(value, nn.Module):
        raise bad_argument(f"{PACKAGE}.{function}", "model", value, "the nn.Module whose "
                           "state is saved or loaded (the wrapped model)", f"Pass the model: "
                           f"{function}(path, model, optimizer).", exc=TypeError)


def optimizers_of(function: str, value: Any) -> tuple:
    """`optimizers` as a tuple: None, one optimizer, or an iterable of optimizers."""
    if value is None:
        return ()
    if isinstance(value, torch.optim.Optimizer):
        return (value,)
    items = None
    if not isinstance(value, (str, bytes, Mapping, nn.Module)):
        try:
            items = tuple(value)
        except TypeError:
            items = None
    bad = items is None or any(not isinstance(item, torch.optim.Optimizer) for item in items)
    if bad:
        raise bad_argument(f"{PACKAGE}.{function}", "optimizers", value, "None, a "
                           "torch.optim.Optimizer, or a list or tuple of them", "Pass the "
                           "optimizer(s) stepping the model's parameters, e.g. "
                           f"{function}(path, model, optimizer) or [opt_a, opt_b].",
                           exc=TypeError)
    return items


def check_extra(function: str, value: Any) -> None:
    """None, or a mapping of further state whose keys leave the model's and optimizers'."""
    if value is None:
        return
    if not isinstance(value, Mapping):
        raise bad_argument(f"{PACKAGE}.{function}", "extra", value, "None or a dict of further "
                           "state (tensors, numbers, Stateful objects)", "e.g. "
                           "extra={'step': torch.tensor(step)}.", exc=TypeError)
    taken = [key for key in RESERVED_KEYS if key in value]
    if taken:
        raise bad_argument(f"{PACKAGE}.{function}", "extra", {key: "..." for key in value},
                           f"keys other than {RESERVED_KEYS} (they hold the model's and the "
                           "optimizers' state)", f"Rename {taken} in extra.")


def check_state_dict(function: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise bad_argument(f"{PACKAGE}.{function}", "state_dict", value, "a dict of what to "
                           "save or load into (tensors, DTensors, Stateful objects, nested "
                           "dicts)", f"e.g. {function}({{'model': model.state_dict()}}, path).",
                           exc=TypeError)


def check_flag(function: str, name: str, value: Any) -> None:
    """`overwrite`, `strict`: our own options, so a real bool (no native reading to match)."""
    check_bool(f"{PACKAGE}.{function}", name, value)
