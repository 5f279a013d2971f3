"""Shared vocabulary of the front-ends: argument tables, clear errors and named warnings.

Each front-end declares one `ArgumentTable`: for every argument of its dialect, whether it is
translated into a Plan field, ignored (with why), or rejected (with why). The table is the single
source of truth: the front-end's code asks it how to treat an argument, the docs are rendered
from it (`render_markdown`), and the codemods read it.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from typing import Any, Iterable


class FsdpBridgeWarning(UserWarning):
    """A setting we cannot honour; the message names it and says why."""


class Treatment(enum.Enum):
    TRANSLATED = "translated"
    IGNORED = "ignored"
    REJECTED = "rejected"


@dataclasses.dataclass(frozen=True)
class Argument:
    name: str
    treatment: Treatment
    detail: str  # the Plan field it becomes, or the reason it is ignored / rejected


@dataclasses.dataclass(frozen=True)
class ArgumentTable:
    frontend: str  # e.g. "YaFSDP"
    arguments: tuple[Argument, ...]

    def __getitem__(self, name: str) -> Argument:
        for argument in self.arguments:
            if argument.name == name:
                return argument
        raise KeyError(name)

    def warn_ignored(self, name: str, value: Any) -> str:
        """Warn that argument `name` was given a value we cannot honour; returns the note."""
        argument = self[name]
        assert argument.treatment is Treatment.IGNORED, name
        note = f"{self.frontend}({name}={value!r}) is ignored: {argument.detail}"
        warnings.warn(note, FsdpBridgeWarning, stacklevel=4)
        return note

    def render_markdown(self) -> str:
        lines = [
            f"### {self.frontend}",
            "",
            "| argument | treatment | detail |",
            "|---|---|---|",
        ]
        lines += [
            f"| `{a.name}` | {a.treatment.value} | {a.detail} |" for a in self.arguments
        ]
        return "\n".join(lines)


class Shown:
    """A value shown in an error as given text (e.g. a module as its class name)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def short_repr(value: Any) -> Any:
    """Modules and (module, name) pairs shown compactly, e.g. (LlamaDecoderLayer, 'model.layers.0')."""
    from torch import nn

    if isinstance(value, nn.Module):
        return Shown(type(value).__name__)
    if isinstance(value, (tuple, list)) and any(isinstance(v, nn.Module) for v in value):
        return Shown("(" + ", ".join(repr(short_repr(v)) for v in value) + ")")
    return value


def bad_argument(
    frontend: str, name: str, value: Any, accepted: str, fix: str, exc=ValueError
) -> Exception:
    """An error that names the argument, the value received, what is accepted, and the fix."""
    shown = repr(short_repr(value))
    if len(shown) > 200:
        shown = shown[:200] + "..."
    return exc(f"{frontend}: {name}={shown} is not accepted; expected {accepted}. {fix}")


def check_bool(frontend: str, name: str, value: Any) -> bool:
    """`value` if it is a real bool. Strings such as "no" or "False" are refused: `bool("no")`
    is True, so accepting them would silently turn the option on."""
    if not isinstance(value, bool):
        raise bad_argument(frontend, name, value, "True or False (a bool, not a string or a "
                           "number)", f"Pass {name}=True or {name}=False.", exc=TypeError)
    return value


def truth_of(frontend: str, name: str, value: Any) -> bool:
    """`bool(value)` for a flag torch reads by its truth value without checking its type
    (`if flag:`), as it reads it: True / False, 1 / 0, numpy bools and one-element tensors all
    work. A string is refused: torch would read any non-empty one, "False" and "no" included,
    as True."""
    problem = "a string" if isinstance(value, (str, bytes)) else None
    if problem is None:
        try:
            return bool(value)
        except (RuntimeError, TypeError, ValueError) as error:  # e.g. a tensor of many values
            problem = f"without a truth value ({error})"
    raise bad_argument(frontend, name, value, f"True or False (torch reads the flag's truth "
                       f"value, and this is {problem})", f"Pass {name}=True or {name}=False.",
                       exc=TypeError)


def check_param_init_fn(frontend: str, value: Any) -> None:
    """Refuse a `param_init_fn` that is not callable, with FSDP1's kind of error (ValueError)."""
    if value is not None and not callable(value):
        raise bad_argument(frontend, "param_init_fn", value, "None or a callable (module) -> "
                           "None", "e.g. param_init_fn=lambda m: m.to_empty(device=device, "
                           "recurse=False) followed by your init.")


def check_own_params(frontend: str, argument: str, params, model) -> None:
    """Refuse parameters that are not in `model`: ignoring them would silently do nothing."""
    owned = {id(p) for _, p in model.named_parameters(remove_duplicate=False)}
    for index, param in enumerate(params):
        if id(param) not in owned:
            shape = tuple(getattr(param, "shape", ()))
            raise bad_argument(frontend, f"{argument}[{index}]", Shown(f"<a parameter of shape "
                               f"{shape} that is not in the model>"), "parameters of the "
                               "module being sharded", "Pass parameters of the model you wrap "
                               "(e.g. model.embed.weight, not a copy's or another model's).")


def translated(name: str, detail: str) -> Argument:
    return Argument(name, Treatment.TRANSLATED, detail)


def ignored(name: str, reason: str) -> Argument:
    return Argument(name, Treatment.IGNORED, reason)


def rejected(name: str, reason: str) -> Argument:
    return Argument(name, Treatment.REJECTED, reason)


def module_paths(model) -> dict[int, str]:
    """id(module) -> its FQN in `model` (the first path, for modules registered twice)."""
    paths: dict[int, str] = {}
    for name, module in model.named_modules():
        paths.setdefault(id(module), name)
    return paths


def all_tables() -> Iterable[ArgumentTable]:
    """Every front-end's table, for the generated docs (front-ends register on import)."""
    return tuple(_REGISTRY)


_REGISTRY: list[ArgumentTable] = []


def register_table(table: ArgumentTable) -> ArgumentTable:
    _REGISTRY.append(table)
    return table
