"""Checks of the harness's arguments, made before any process starts: a bad value is reported
at once, naming the option, not after minutes of training or as a failure per backend. Free of
torch (imported by a check only when it runs), so that the checks come before torch loads."""

from __future__ import annotations

import math
import os
import re
from typing import Optional

from fsdp_bridge.harness.names import BACKENDS
from fsdp_bridge.outputs import check_output_file, check_plot_file


def positive_int(flag: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{flag} {value!r}: expected an int >= 1.")


def positive_seconds(flag: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{flag} {value!r}: expected a number of seconds > 0 (how long one run "
                         "may take before it is stopped), e.g. 600.")


def loss_pattern(flag: str, pattern: str) -> None:
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{flag} {pattern!r} is not a valid regular expression ({exc}). Write "
                         r"one with named groups, e.g. 'step (?P<step>\d+) loss (?P<loss>\S+)'."
                         ) from None
    if "loss" not in regex.groupindex:
        raise ValueError(f"{flag} {pattern!r} has no named group 'loss': write it like "
                         r"'step (?P<step>\d+) loss (?P<loss>\S+)'.")


def script(flag: str, value: str) -> list[str]:
    """What torchrun runs for `value`: a Python file (`[path]`) or, for a dotted name that is no
    file (e.g. fsdp_bridge.examples.accelerate_llama), a module (`["-m", name]`, as `python -m`
    finds it: on sys.path and in the current directory). ValueError naming `flag` unless it is
    one that Python can compile, checked before anything starts."""
    if not os.path.exists(value) and _MODULE_NAME.fullmatch(value) and not value.endswith(".py"):
        _compiles(flag, value, _module_source(flag, value))
        return ["-m", value]
    if not os.path.isfile(value):
        state = "is a directory" if os.path.isdir(value) else "does not exist"
        raise ValueError(f"{flag} {value!r} {state}: pass the path of a Python training script "
                         "(or the name of a module, as python -m takes it).")
    _compiles(flag, value, value)
    return [value]


_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _module_source(flag: str, name: str) -> str:
    import importlib.util
    import sys

    sys.path.insert(0, os.getcwd())  # python -m looks in the current directory first
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path.pop(0)
    if spec is not None and spec.submodule_search_locations is not None:  # a package
        spec = _main_of(name)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"{flag} {name!r} is neither a file nor a Python module found on the "
                         "path: pass the path of a training script, or the module's name as "
                         "python -m takes it (e.g. fsdp_bridge.examples.accelerate_llama).")
    return spec.origin


def _main_of(package: str):
    import importlib.util

    try:
        return importlib.util.find_spec(f"{package}.__main__")
    except (ImportError, ValueError):
        return None


def _compiles(flag: str, value: str, path: str) -> None:
    """ValueError naming `flag` unless the file at `path` is Python source that compiles."""
    try:
        with open(path, "rb") as handle:
            source = handle.read()
    except OSError as exc:
        raise ValueError(f"{flag} {value!r} cannot be read ({exc.strerror}).") from None
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise ValueError(f"{flag} {value!r} is not a Python script: {exc.msg} (line "
                         f"{exc.lineno}); pass the training script itself.") from None
    except ValueError as exc:  # null bytes, on older Pythons
        raise ValueError(f"{flag} {value!r} is not a Python script ({exc}); pass the training "
                         "script itself.") from None


def scripts(baseline: str, candidates, nproc: int, pattern: str, timeout: float) -> None:
    """compare-scripts' arguments, before any script runs (ValueError naming the first bad
    one)."""
    script("A.py", baseline)
    for index, candidate in enumerate(candidates):
        script(f"{chr(ord('B') + index)}.py", candidate)
    positive_int("--nproc", nproc)
    positive_seconds("--timeout", timeout)
    loss_pattern("--loss-pattern", pattern)


def backend_names(flag: str, value: str) -> list[str]:
    """The comma-separated backend names of `value`: at least two, each a known one."""
    names = [name.strip() for name in value.split(",") if name.strip()]
    if len(names) < 2:
        raise ValueError(f"{flag} {value!r}: name at least two backends to compare (the first "
                         "is the baseline), e.g. reference,torch-fsdp2.")
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"{flag} {value!r}: backend {name!r} is unknown; use "
                             f"{', '.join(BACKENDS)}.")
    return names


def check_tolerance_value(name: str, value: Optional[float]) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}: expected a finite number >= 0 (|a-b| <= atol + "
                         "rtol*|b|; a negative tolerance would make every comparison pass or "
                         "fail meaninglessly). Omit it to use the dtype's default.")


def tolerances(rtol: Optional[float], atol: Optional[float]) -> None:
    check_tolerance_value("--rtol", rtol)
    check_tolerance_value("--atol", atol)


def outputs(json_path: Optional[str], plot_path: Optional[str]) -> None:
    check_output_file("--json", json_path, stdout=True)
    check_plot_file("--plot", plot_path)
