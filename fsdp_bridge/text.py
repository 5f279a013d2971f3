"""The commands' text: tables (`compare`, `compare-scripts`, `bench`, `explain`, `demo`), drawn by
tabulate, imported only when a table is drawn so that a command's start-up (its `--help`, its
argument errors) does not pay for it; and counted nouns ("1 error", "2 errors")."""

from __future__ import annotations

from typing import Optional, Sequence


def table(rows: Sequence[Sequence], headers: Sequence[str], *, right: Sequence[int] = (),
          indent: str = "  ") -> list[str]:
    """The lines of a table of already formatted cells, columns separated by two spaces and the
    headers underlined; the columns numbered in `right` are aligned right (numbers)."""
    from tabulate import tabulate

    align: list[Optional[str]] = ["right" if index in right else "left"
                                  for index in range(len(headers))]
    text = tabulate([[str(cell) for cell in row] for row in rows], headers=list(headers),
                    tablefmt="simple", disable_numparse=True, colalign=align)
    return [(indent + line).rstrip() for line in text.splitlines()]


def plural(count: int, noun: str, plural_form: str = "") -> str:
    """"1 file", "0 files", "3 files" (`plural_form` where adding "s" is wrong)."""
    return f"{count} {noun if count == 1 else plural_form or noun + 's'}"
