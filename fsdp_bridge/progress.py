"""Progress of the long commands (`migrate`, `compare-scripts`, `bench`), drawn by tqdm on
stderr: with rate and time left, only on a terminal, and never with `--quiet`. Their results go
to stdout, so a pipe or a file receives the results alone."""

from __future__ import annotations

import sys

from tqdm import tqdm


def shown(quiet: bool) -> bool:
    """Whether progress is drawn: on a terminal, unless the user asked for quiet."""
    return not quiet and sys.stderr.isatty()


def bar(total: int, what: str, unit: str, quiet: bool = False) -> tqdm:
    """A bar counting `total` `unit`s of `what`; a no-op object when progress is not shown."""
    return tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not shown(quiet))


def note(message: str, quiet: bool = False) -> None:
    """A line about what a long step is doing, on stderr (not with --quiet)."""
    if not quiet:
        print(message, file=sys.stderr, flush=True)
