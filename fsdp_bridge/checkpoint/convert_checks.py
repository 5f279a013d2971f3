"""What `convert-checkpoint` checks before it reads anything, without torch: the source is a
checkpoint of a format it reads (told by its files and first bytes, so that a text file is
refused by what it is, at once), and the destination can and may be written. The command runs
these before it imports torch, which takes seconds; `convert.convert` runs them too."""

from __future__ import annotations

import os
import struct

from fsdp_bridge.checkpoint import manifest
from fsdp_bridge.checkpoint.validate import CheckpointError

FORMATS = ("torch", "dcp", "safetensors")
READS = ("a torch.save file, a .safetensors file, a DCP directory or a save_pretrained "
         "directory")
_ZIP = b"PK\x03\x04"  # torch.save's format since torch 1.6
_PICKLE_PROTOCOLS = range(2, 6)  # torch.save's legacy format starts with a pickle


def detect(path: str) -> str:
    """The format of checkpoint `path` ("torch", "dcp" or "safetensors"), or a CheckpointError
    saying what it is not."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            return "dcp"
        if weights_directory(path):
            return "safetensors"
        raise CheckpointError(f"SRC {path!r} is a directory but neither a DCP checkpoint (no "
                              "'.metadata') nor a save_pretrained directory (no "
                              "model.safetensors).")
    if not os.path.exists(path):
        raise CheckpointError(f"SRC {path!r} does not exist; pass {READS}.")
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError as exc:
        raise CheckpointError(f"SRC {path!r} cannot be read: {exc.strerror}.") from None
    if path.endswith(".safetensors"):
        if _is_safetensors(head):
            return "safetensors"
        raise CheckpointError(f"SRC {path!r} is not a safetensors file: it is {_what(head)}, "
                              "not a safetensors header. Pass " + READS + ".")
    if head.startswith(_ZIP) or (len(head) > 1 and head[0] == 0x80
                                 and head[1] in _PICKLE_PROTOCOLS):
        return "torch"
    raise CheckpointError(f"SRC {path!r} is not a checkpoint: it is {_what(head)}, not a "
                          f"torch.save file (a zip archive). Pass {READS}.")


def _is_safetensors(head: bytes) -> bool:
    """An 8-byte little-endian header length, then the JSON header."""
    return len(head) > 8 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 1


def _what(head: bytes) -> str:
    if not head:
        return "an empty file"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text:
        return "a text file"
    return f"a binary file starting with {head[:4].hex(' ')}"


def weights_directory(path: str) -> bool:
    """A save_pretrained directory (safetensors weights, in one file or shards)."""
    return any(os.path.isfile(os.path.join(path, name))
               for name in ("model.safetensors", "model.safetensors.index.json"))


def writes_directory(target: str, to: str) -> bool:
    return to == "dcp" or (to == "safetensors" and not target.endswith(".safetensors"))


def kind_written(target: str, to: str):
    """Our manifest's kind for what `--to` writes at `target` (None: one file, no manifest)."""
    if not writes_directory(target, to):
        return None
    return "dcp" if to == "dcp" else "safetensors"


def _is_checkpoint_directory(path: str) -> bool:
    return (manifest.is_ours(path) or os.path.exists(os.path.join(path, ".metadata"))
            or weights_directory(path))


def check_destination(source: str, target: str, to: str, force: bool) -> None:
    """Refuse, before reading anything, a destination we cannot or must not write."""
    source, target = os.path.abspath(source), os.path.abspath(target)
    if source == target:
        raise CheckpointError("source and destination are the same path.")
    if source.startswith(target + os.sep):
        raise CheckpointError(f"DST {target!r} contains SRC {source!r}; choose another DST.")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise CheckpointError(
            f"DST {target!r}: its parent directory {parent!r} "
            + ("is a file" if os.path.lexists(parent) else "does not exist")
            + ". Create the directory first (nothing was written).")
    if not os.path.lexists(target):
        return
    if not force:
        raise CheckpointError(f"{target!r} exists; pass --force to replace it (atomically; "
                              "only the checkpoint's own files are replaced, the others kept).")
    directory = writes_directory(target, to)
    if os.path.islink(target):
        raise CheckpointError(f"DST {target!r} is a symbolic link: --force does not replace "
                              "links; pass the path it points to or a new path.")
    if not directory and os.path.isdir(target):
        raise CheckpointError(
            f"--force: DST {target!r} is a directory, but --to {to} writes one file. Nothing "
            "was changed; give a file path (or remove the directory yourself).")
    if directory and not os.path.isdir(target):
        raise CheckpointError(
            f"--force: DST {target!r} is a file, but --to {to} writes a directory. Nothing was "
            "changed; give a directory path (or remove the file yourself).")
    if directory and os.listdir(target) and not _is_checkpoint_directory(target):
        raise CheckpointError(
            f"--force: DST {target!r} is a directory that is not a checkpoint (no .metadata, "
            "no safetensors, no fsdp-bridge manifest): --force replaces an earlier checkpoint, "
            "and there is none to replace. Nothing was changed; choose a new path.")
