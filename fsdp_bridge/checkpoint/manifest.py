"""Our marker file in a checkpoint directory: proof that fsdp-bridge wrote it, and the SHA-256
of every file in it.

[Note: the manifest]
`save` (and `convert-checkpoint`, `hf.save_pretrained`) write `MANIFEST` last into the
temporary directory, before it is published. It serves two purposes:
- *Ownership.* A save writes over an existing directory only when it holds a manifest (one of
  our checkpoints); anything else (a user's `outputs/`, a checkpoint another tool wrote) is
  refused unless the caller passes `overwrite=True`. Either way, what the manifest lists is
  what the writer may replace; every other file there is the user's (see [Note: a writer owns
  only what it wrote]).
- *Integrity.* DCP's `.metadata` records where each item lies, not what it holds: one flipped
  bit in a `.distcp` payload loads as a wrong value. The manifest's checksums are verified
  before anything is read. Directories without a manifest (written by torch's own `dcp.save`)
  load as before, with nothing to verify against.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterable, Optional

MANIFEST = ".fsdp-bridge-checkpoint.json"
FORMAT = "fsdp-bridge checkpoint"
VERSION = 1
_CHUNK = 1 << 20


def sha256(file: str) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def checksums(directory: str, names: Iterable[str]) -> dict[str, str]:
    return {name: sha256(os.path.join(directory, name)) for name in names}


def data_files(directory: str) -> list[str]:
    """Every regular file under `directory` (relative paths), except the manifest itself."""
    found = []
    for root, _, files in os.walk(directory):
        for name in files:
            relative = os.path.relpath(os.path.join(root, name), directory)
            if relative != MANIFEST:
                found.append(relative)
    return sorted(found)


def write(directory: str, files: dict[str, str], kind: str) -> None:
    """Write the manifest (fsync'ed) into a directory that is not published yet."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as handle:
        json.dump({"format": FORMAT, "version": VERSION, "kind": kind,
                   "sha256": dict(sorted(files.items()))}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())


def read(directory: str) -> Optional[dict]:
    """The manifest of `directory`, or None when it has none (or it is not ours)."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {"format": FORMAT, "damaged": True, "sha256": {}}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    return data


def is_ours(directory: str) -> bool:
    return os.path.isdir(directory) and read(directory) is not None


def verify(directory: str, data: dict, names: Optional[Iterable[str]] = None) -> list[str]:
    """Problems found checking `names` (default: every file the manifest lists)."""
    if data.get("damaged"):
        return [f"its manifest {MANIFEST!r} cannot be read (truncated or corrupt)"]
    recorded = data.get("sha256", {})
    problems = []
    for name in sorted(recorded if names is None else names):
        file = os.path.join(directory, name)
        if name not in recorded:
            problems.append(f"{name!r} is not listed in the manifest")
        elif not os.path.isfile(file):
            problems.append(f"{name!r} is missing")
        elif sha256(file) != recorded[name]:
            problems.append(f"{name!r} does not match its SHA-256 checksum (the file changed "
                            "after it was written: disk or copy corruption)")
    return problems
