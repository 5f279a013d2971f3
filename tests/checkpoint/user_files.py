"""Files a user had before a test, and a SHA-256 check that they are unchanged after it."""

from __future__ import annotations

import hashlib
import os


def make(directory) -> dict:
    """A user's `outputs/`: a log, a plot folder, a notes file; returns their digests."""
    directory = str(directory)
    os.makedirs(os.path.join(directory, "plots"), exist_ok=True)
    with open(os.path.join(directory, "train.log"), "w") as handle:
        handle.write("step 1 loss 4.2\nstep 2 loss 3.9\n")
    with open(os.path.join(directory, "plots", "loss.csv"), "w") as handle:
        handle.write("1,4.2\n2,3.9\n")
    with open(os.path.join(directory, "notes.txt"), "w") as handle:
        handle.write("do not delete\n")
    return digests(directory)


def digests(directory, only=None) -> dict:
    """{relative path: SHA-256} of every file under `directory` (or of `only` of them)."""
    out = {}
    for root, _, files in os.walk(str(directory)):
        for name in files:
            file = os.path.join(root, name)
            relative = os.path.relpath(file, str(directory))
            if only is None or relative in only:
                with open(file, "rb") as handle:
                    out[relative] = hashlib.sha256(handle.read()).hexdigest()
    return out


def unchanged(directory, before: dict) -> bool:
    return digests(directory, only=set(before)) == before
