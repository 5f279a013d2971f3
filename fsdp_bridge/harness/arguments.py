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


def script(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        state = "is a directory" if os.path.isdir(path) else "does not exist"
        raise ValueError(f"{flag} {path!r} {state}: pass the path of a Python training script.")


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


def tolerances(rtol: Optional[float], atol: Optional[float]) -> None:
    from fsdp_bridge.harness.compare import check_tolerance_value

    check_tolerance_value("--rtol", rtol)
    check_tolerance_value("--atol", atol)


def outputs(json_path: Optional[str], plot_path: Optional[str]) -> None:
    check_output_file("--json", json_path)
    check_plot_file("--plot", plot_path)
