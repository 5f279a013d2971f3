"""Which files of a checkpoint directory a writer owns, and how a replacement keeps the others.

[Note: a writer owns only what it wrote]
A checkpoint directory is often shared: a Hugging Face directory holds the tokenizer, the
generation config and a model card beside the weights; users drop notes, configs and symlinks
into DCP checkpoints. A writer (`save`, `save_pretrained`, `convert-checkpoint`) owns, in the
directory it replaces:
- the files it writes now, and our manifest;
- the files of its format, known by name (`KNOWN`): DCP's `.metadata` and `__<rank>_<n>.distcp`;
  the safetensors weights (`model.safetensors`, its index and its shards); for
  `save_pretrained`, also the `config.json` and `generation_config.json` transformers writes;
- the files the directory's previous manifest lists, when that manifest is of the same kind
  (a `save_pretrained` that wrote a custom model's code files owns them at its next save).
Everything else is the user's, and survives every save, `overwrite=True` and `--force`.

A replacement stays one atomic rename of a new directory (see [Note: atomic checkpoints]); the
user's entries are carried into the new directory before it is published, as hard links (the
same file, not a copy: a log that is still being appended to keeps its writer), symbolic links
recreated as they were (never followed: their targets are not touched) and sub-directories
rebuilt the same way. So at every moment, `path` (or the complete previous directory, after a
crash between the renames) holds every user file. The previous directory is then taken apart
(`dismantle`), never removed wholesale: it loses only files the writer owns and entries the new
directory holds too (same inode, or the same link); anything else (a file created while the
save ran) is moved into the new directory, or, where the new one already has that name, kept
in place with a warning naming it.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from typing import Callable, Iterable, Optional

from fsdp_bridge.checkpoint import manifest
from fsdp_bridge.checkpoint.validate import CheckpointError

WEIGHTS = ("model.safetensors", "model.safetensors.index.json",
           re.compile(r"model-\d{5}-of-\d{5}\.safetensors"))
# The files each kind of writer writes, by name (a name, or a pattern matching a whole name).
KNOWN: dict[str, tuple] = {
    "dcp": (".metadata", re.compile(r"__\d+_\d+\.distcp")),
    "safetensors": WEIGHTS,
    "save_pretrained": WEIGHTS + ("config.json", "generation_config.json"),
}
DESCRIBED = {
    "dcp": "'.metadata' and '__*_*.distcp'",
    "safetensors": "'model.safetensors', its index and its shards",
    "save_pretrained": "'config.json', 'generation_config.json' and the safetensors weights",
}

Owns = Callable[[str], bool]


def known(kind: str, name: str) -> bool:
    """Whether `name` (a path relative to the checkpoint directory) is a file of `kind`'s
    format, by its name."""
    return any(name == pattern if isinstance(pattern, str) else pattern.fullmatch(name)
               for pattern in KNOWN.get(kind, ()))


def listed(directory: str, kind: Optional[str] = None) -> set[str]:
    """The files our manifest in `directory` lists (only if it is of `kind`, when given)."""
    data = manifest.read(directory) if os.path.isdir(directory) else None
    if data is None or (kind is not None and data.get("kind") != kind):
        return set()
    return set(data.get("sha256", {}))


def owner(kind: str, directories: Iterable[str] = (), written: Iterable[str] = ()) -> Owns:
    """The files a writer of `kind` owns in a directory it replaces: those it writes now
    (`written`), those of its format, our manifest, and those listed by a manifest of the same
    kind in any of `directories` (see [Note: a writer owns only what it wrote])."""
    names = set(written) | {manifest.MANIFEST}
    for directory in directories:
        names |= listed(directory, kind)
    return lambda name: name in names or known(kind, name)


def kind_of(directory: str) -> Optional[str]:
    data = manifest.read(directory) if os.path.isdir(directory) else None
    return None if data is None else data.get("kind")


# -- carrying the user's entries into a new directory -------------------------------------------


def carry(live: str, new: str, owns: Owns) -> None:
    """Give `new` (a directory not yet published, holding the writer's files) every entry of
    `live` that the writer does not own: hard links, symbolic links as they are, directories
    rebuilt with their modes. Raises CheckpointError naming the entry if one cannot be carried
    (nothing is lost: `live` is untouched, and `new` is the caller's to discard)."""
    _carry_dir(live, new, "", owns)
    shutil.copymode(live, new)


def _carry_dir(source: str, target: str, relative: str, owns: Owns) -> None:
    try:
        entries = sorted(os.scandir(source), key=lambda e: e.name)
    except OSError as exc:
        raise _cannot_carry(source, f"it cannot be listed ({exc.strerror})") from exc
    for entry in entries:
        name = os.path.join(relative, entry.name)
        there = os.path.join(target, entry.name)
        try:
            if entry.is_dir(follow_symlinks=False):
                if os.path.lexists(there) and not os.path.isdir(there):
                    raise _cannot_carry(entry.path, "the new checkpoint writes a file of that name")
                os.makedirs(there, exist_ok=True)
                _carry_dir(entry.path, there, name, owns)
                shutil.copystat(entry.path, there, follow_symlinks=False)
            elif owns(name) or os.path.lexists(there):
                continue  # the writer's own (replaced, or gone when not written again)
            elif entry.is_symlink():
                os.symlink(os.readlink(entry.path), there)
            else:
                os.link(entry.path, there, follow_symlinks=False)
        except OSError as exc:
            raise _cannot_carry(entry.path, f"{exc.strerror} (it is linked into the new "
                                "directory, which needs hard links)") from exc


def _cannot_carry(path: str, why: str) -> CheckpointError:
    return CheckpointError(
        f"cannot keep {path!r} while replacing the checkpoint around it: {why}. Nothing was "
        "changed; move it out of the checkpoint directory, or write to a new path.")


# -- taking a replaced directory apart ----------------------------------------------------------


def dismantle(old: str, live: Optional[str], owns: Owns) -> list[str]:
    """Remove from `old` (a directory no reader uses any more) the files `owns` claims and
    the entries `live` holds too; move the other entries into `live` where their names are
    free; remove `old` if that emptied it. Returns the entries kept in `old`, with a warning."""
    if live is not None and not os.path.lexists(live):
        # Nothing replaced it (a crash's recovery copy of a checkpoint since removed): what
        # is not the writer's goes back under its own name.
        if not remove_owned(old, owns):
            os.rename(old, live)
        return []
    kept: list[str] = []
    _dismantle_dir(old, live if live and os.path.isdir(live) else None, "", owns, kept)
    _remove_if_empty(old)
    if kept:
        shown = ", ".join(os.path.relpath(k, old) for k in kept[:4])
        warnings.warn(f"fsdp_bridge: kept {old} after replacing {live}: it holds {shown}"
                      + (f" and {len(kept) - 4} more" if len(kept) > 4 else "") + ", which "
                      "could not be moved into the new directory (it names them with other "
                      "contents: changed while the save ran?) or removed. Take what you need "
                      "from it, then delete it.", stacklevel=3)
    return kept


def remove_owned(directory: str, owns: Owns) -> bool:
    """Remove the files `owns` claims from `directory` (and it, if that empties it); every
    other entry stays. Whether the directory is gone."""
    _dismantle_dir(directory, None, "", owns, [], move=False)
    return _remove_if_empty(directory)


def _dismantle_dir(old: str, live: Optional[str], relative: str, owns: Owns, kept: list,
                   move: bool = True) -> None:
    try:
        entries = sorted(os.scandir(old), key=lambda e: e.name)
    except OSError:
        kept.append(old)
        return
    for entry in entries:
        name = os.path.join(relative, entry.name)
        there = os.path.join(live, entry.name) if live else None
        try:
            if entry.is_dir(follow_symlinks=False):
                if there is not None and move and not os.path.lexists(there):
                    os.rename(entry.path, there)
                    continue
                inner = there if there is not None and os.path.isdir(there) else None
                _dismantle_dir(entry.path, inner, name, owns, kept, move)
                _remove_if_empty(entry.path)
            elif owns(name) or (there is not None and _same(entry.path, there)):
                os.unlink(entry.path)
            elif move and there is not None and not os.path.lexists(there):
                os.rename(entry.path, there)
            elif move:
                kept.append(entry.path)
        except OSError:  # no permission, say: left where it is, and said
            kept.append(entry.path)


def _same(one: str, other: str) -> bool:
    """The same file (one inode) or the same symbolic link (one target text)."""
    try:
        a, b = os.lstat(one), os.lstat(other)
    except OSError:
        return False
    if os.path.islink(one) or os.path.islink(other):
        return os.path.islink(one) and os.path.islink(other) \
            and os.readlink(one) == os.readlink(other)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _remove_if_empty(directory: str) -> bool:
    try:
        os.rmdir(directory)
    except OSError:
        return False
    return True
