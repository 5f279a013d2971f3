"""Saving and loading checkpoints: `save` / `load` (torch.distributed.checkpoint, atomic and
checked), `save_state` / `load_state` (a model and its optimizers in one call), and
`CheckpointManager` (numbered checkpoints in one directory, resume from the latest)."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from typing import Iterable, Optional

import torch.distributed as dist
from torch import nn

from fsdp_bridge.checkpoint import arguments, atomic, manifest, ownership, save_checks, validate
from fsdp_bridge.state_dicts.parts import world_rank


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _agree(value):
    """Rank 0's value on every rank."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _everyone(value) -> list:
    """Every rank's `value`, in rank order, on every rank."""
    if not _distributed():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _share(names: list) -> list:
    """This rank's part of `names` (files to hash are split over the ranks)."""
    if not _distributed():
        return list(names)
    return list(names)[dist.get_rank()::dist.get_world_size()]


def _fail_together(error: Optional[BaseException], what: str, cleanup=None) -> None:
    """A collective: if any rank has an `error`, every rank raises (the failing rank its own
    error, the others one naming it), after `cleanup` (on every rank)."""
    text = None if error is None else f"{type(error).__name__}: {error}"
    failed = [(rank, t) for rank, t in enumerate(_everyone(text)) if t is not None]
    if not failed:
        return
    if cleanup is not None:
        cleanup()
    if error is not None:
        raise error
    rank, text = failed[0]
    raise validate.CheckpointError(f"{what} failed on rank {rank}: {text}")


def _check_same_path(path: str) -> None:
    paths = _everyone(path)
    if len(set(paths)) > 1:
        shown = ", ".join(f"rank {rank}: {p!r}" for rank, p in enumerate(paths))
        raise validate.CheckpointError(
            f"ranks disagree on the checkpoint path ({shown}). save is a collective that "
            "writes one checkpoint: every rank must pass the same path (a path built from the "
            "rank, or relative to different working directories, would leave each rank's shard "
            "in a different place and no complete checkpoint). Pass one absolute path on every "
            "rank.")


def _plain(state_dict: dict) -> dict:
    """Stateful values replaced by their state dicts (what dcp.save would store)."""
    from torch.distributed.checkpoint.stateful import Stateful

    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state_dict.items()}


def _checks_and_lock(state: dict, path: str, overwrite: bool, held: contextlib.ExitStack):
    """Every rank checks its values; rank 0 checks the target and takes the save lock."""
    problem = save_checks.unsaveable(state)
    if problem:
        return validate.CheckpointError(f"cannot save checkpoint {path!r}: {problem}")
    try:
        save_checks.check_collisions(state, f"cannot save checkpoint {path!r}")
        if world_rank() == 0:
            held.enter_context(atomic.locked_target(path, overwrite))
            atomic.clean_before_save(path, "dcp")
    except validate.CheckpointError as exc:
        return exc
    return None


def _saved_files(tmp: str, path: str, discard) -> list:
    """The files of the checkpoint just written to `tmp`, as its `.metadata` file lists them
    (read by rank 0, shared with every rank). Read back from the directory, not taken from what
    `dcp.save` returns: torch 2.9 to 2.11 return metadata whose `storage_data` is None (they
    fill it on a copy), while the file on disk is complete."""
    files, error = None, None
    if world_rank() == 0:
        try:
            files = sorted({*validate.data_files(validate.read_metadata(tmp)), ".metadata"})
        except BaseException as exc:  # noqa: BLE001 - reported on every rank
            error = save_checks.explain(exc, path)
    _fail_together(error, f"saving {path!r}", discard)
    return _agree(files)


def save(state_dict: dict, path: str, *, overwrite: bool = False) -> str:
    """`dcp.save(state_dict)` into `path`, atomically (see [Note: atomic checkpoints]): after
    a crash, `path` holds the previous checkpoint (or nothing), never a partial one. A
    collective when a process group exists; every rank must pass the same `path`.

    `path` may be missing, an empty directory or one of our checkpoints (it is replaced); any
    other existing directory is refused unless `overwrite=True`, and a file always is. Only
    the checkpoint's own files are replaced: every other file in `path` (notes, configs,
    symbolic links) is kept, with or without `overwrite` (see [Note: a writer owns only what
    it wrote]). The files get SHA-256 checksums in our manifest ([Note: the manifest]),
    verified by `load`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    arguments.check_state_dict("save", state_dict)
    arguments.check_path("save", path, call="save(state_dict, path)")
    arguments.check_flag("save", "overwrite", overwrite)
    path = os.path.abspath(os.fspath(path))
    _check_same_path(path)
    state = _plain(state_dict)
    with contextlib.ExitStack() as held:  # rank 0's save lock, released on every exit
        _fail_together(_checks_and_lock(state, path, overwrite, held), f"saving {path!r}")
        token = _agree(uuid.uuid4().hex[:12])
        tmp = atomic.temporary_path(path, token)

        def discard() -> None:
            if world_rank() == 0:
                atomic.remove_tree(tmp)

        error = None
        if world_rank() == 0:
            try:
                os.makedirs(tmp)
            except OSError as exc:
                error = save_checks.explain(exc, path)
        _fail_together(error, f"saving {path!r}", discard)
        try:  # a collective when a process group exists, local otherwise (torch decides)
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
        except BaseException as exc:  # noqa: BLE001 - reported after cleaning up on every rank
            error = save_checks.explain(exc, path)
        _fail_together(error, f"saving {path!r}", discard)
        files = _saved_files(tmp, path, discard)
        try:
            sums = manifest.checksums(tmp, _share(files))
        except BaseException as exc:  # noqa: BLE001
            error, sums = save_checks.explain(exc, path), {}
        _fail_together(error, f"saving {path!r}", discard)
        everyone = _everyone(sums)
        if world_rank() == 0:
            try:
                manifest.write(tmp, {k: v for part in everyone for k, v in part.items()}, "dcp")
                atomic.publish(tmp, path, token, "dcp")
            except BaseException as exc:  # noqa: BLE001
                error = save_checks.explain(exc, path)
        _fail_together(error, f"publishing {path!r}", discard)
    return path


def _verify_checksums(path: str, metadata) -> None:
    """Our manifest's checksums, each rank hashing its share of the files (a collective)."""
    data = manifest.read(path)
    problems = []
    if data is not None:
        stored = set(validate.data_files(metadata))
        listed = set(data.get("sha256", {}))
        problems += [f"{name!r} is not listed in the manifest"
                     for name in sorted(stored - listed)] if not data.get("damaged") else []
        problems += manifest.verify(path, data, _share(sorted(listed)) if listed else None)
    everyone = [p for part in _everyone(problems) for p in part]
    if everyone:
        raise validate.CheckpointError(
            f"checkpoint {path!r} is damaged: {'; '.join(everyone[:4])}"
            + (f" ({len(everyone) - 4} more)" if len(everyone) > 4 else "")
            + ". Nothing was loaded; load an earlier checkpoint.")


def load(state_dict: dict, path: str, *, strict: bool = True) -> str:
    """Check, then `dcp.load` into `state_dict` (in place; `Stateful` values get their
    `load_state_dict` called, as DCP does). Raises `CheckpointError` naming what is wrong
    (no metadata, a truncated file, a checksum that does not match, missing / unexpected keys,
    wrong shapes) before anything is read into `state_dict`; reads only, writes nothing."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.stateful import Stateful

    arguments.check_state_dict("load", state_dict)
    arguments.check_path("load", path, call="load(state_dict, path)")
    arguments.check_flag("load", "strict", strict)
    path = atomic.resolve(path)
    metadata = validate.read_metadata(path)
    validate.check_files(path, metadata)
    _verify_checksums(path, metadata)
    statefuls = {k: v for k, v in state_dict.items() if isinstance(v, Stateful)}
    plain = {k: (v.state_dict() if k in statefuls else v) for k, v in state_dict.items()}
    validate.check_contents(path, metadata, plain, strict=strict)
    dcp.load(plain, storage_reader=FileSystemReader(path))  # a collective when distributed
    for key, obj in statefuls.items():
        obj.load_state_dict(plain[key])
    for key, value in plain.items():
        if key not in statefuls:
            state_dict[key] = value
    return path


# -- a model and its optimizers -----------------------------------------------------------------


def _check_training_state(function: str, path, model, optimizers, extra) -> tuple:
    """The arguments of save_state / load_state (see arguments.py); returns the optimizers
    as a tuple."""
    arguments.check_path(function, path, call=f"{function}(path, model, optimizer)")
    arguments.check_model(function, model)
    optims = arguments.optimizers_of(function, optimizers)
    arguments.check_extra(function, extra)
    return optims


def training_state(model: nn.Module, optimizers=None, extra: Optional[dict] = None) -> dict:
    """{"model": sharded model state, "optim": name-keyed sharded optimizer state, **extra}."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    arguments.check_model("training_state", model)
    arguments.check_extra("training_state", extra)
    state = {"model": get_model_state_dict(model)}
    optims = arguments.optimizers_of("training_state", optimizers)
    if optims:
        state["optim"] = get_optimizer_state_dict(model, optims)
    state.update(extra or {})
    return state


def save_state(path: str, model: nn.Module, optimizers=None,
               extra: Optional[dict] = None, *, overwrite: bool = False) -> str:
    _check_training_state("save_state", path, model, optimizers, extra)
    arguments.check_flag("save_state", "overwrite", overwrite)
    return save(training_state(model, optimizers, extra), path, overwrite=overwrite)


def load_state(path: str, model: nn.Module, optimizers=None, extra: Optional[dict] = None,
               *, strict: bool = True) -> dict:
    """Load into `model` (and `optimizers`) from a checkpoint written at any world size by
    any of our front-ends or by native FSDP2; returns the loaded state (with `extra`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    optims = _check_training_state("load_state", path, model, optimizers, extra)
    arguments.check_flag("load_state", "strict", strict)
    state = training_state(model, optims, extra)
    load(state, path, strict=strict)
    options = StateDictOptions(strict=strict)
    set_model_state_dict(model, state["model"], options=options)
    if optims:
        set_optimizer_state_dict(model, optims, state["optim"], options=options)
    return state


def _check_keep(keep) -> None:
    if keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1):
        return
    raise ValueError(f"CheckpointManager(keep={keep!r}): expected an int >= 1 (how many of the "
                     "newest checkpoints to keep) or None (keep all). Pass e.g. keep=2.")


class CheckpointManager:
    """Numbered checkpoints `<root>/step_<n>`, each written atomically; `latest()` is the
    highest complete one (a crash during a save never leaves a partial `step_<n>`). After each
    save, the files of our checkpoints beyond the newest `keep` are removed (None: keep all),
    and their directories with them unless they hold files of the user's; directories we did
    not write are never touched."""

    PATTERN = re.compile(r"^step_(\d+)$")

    def __init__(self, root: str, keep: Optional[int] = 2):
        arguments.check_path("CheckpointManager", root, argument="root",
                             call="CheckpointManager(root, keep=2)")
        _check_keep(keep)
        self.root = os.path.abspath(root)
        self.keep = keep

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step:08d}")

    def steps(self) -> list[int]:
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            match = self.PATTERN.match(name)
            if match and os.path.isfile(os.path.join(self.root, name, ".metadata")):
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> Optional[int]:
        steps = _agree(self.steps())
        return steps[-1] if steps else None

    def save(self, step: int, model: nn.Module, optimizers=None,
             extra: Optional[dict] = None) -> str:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"CheckpointManager.save(step={step!r}): expected an int >= 0 "
                             "(the training step the checkpoint holds). Pass e.g. step=100.")
        path = save_state(self.path(step), model, optimizers, extra)
        if world_rank() == 0:
            self._tidy(step)
        _barrier()
        return path

    def _tidy(self, saved: int) -> None:
        """Remove our checkpoints beyond `keep` and the leftovers of crashed saves of other
        steps, each under its save lock (skipped while another process holds it)."""
        steps = self.steps()
        old = steps[:-self.keep] if self.keep else []
        for step in sorted(set(steps) | self._steps_with_leftovers()):
            if step == saved:
                continue
            path = self.path(step)
            try:
                with atomic.lock(path):
                    if step in old and manifest.is_ours(path):
                        ownership.remove_owned(path, ownership.owner("dcp", [path]))
                    # An .old- without its step is a crash's recovery copy: obsolete once a
                    # newer step is saved.
                    atomic.clean_leftovers(path, "dcp", keep_old=not (os.path.isdir(path)
                                                                      or step < saved))
            except validate.CheckpointError:
                continue  # another process is saving that step right now

    def _steps_with_leftovers(self) -> set:
        pattern = re.compile(r"^step_(\d+)\.(tmp|old)-[0-9a-f]{12}$")
        names = os.listdir(self.root) if os.path.isdir(self.root) else []
        return {int(m.group(1)) for m in map(pattern.match, names) if m}

    def load_latest(self, model: nn.Module, optimizers=None,
                    extra: Optional[dict] = None) -> Optional[int]:
        _check_training_state("CheckpointManager.load_latest", self.root, model, optimizers,
                              extra)
        step = self.latest()
        if step is None:
            return None
        load_state(self.path(step), model, optimizers, extra)
        return step


def iter_paths(paths: Iterable[str]):  # pragma: no cover - convenience for callers
    yield from (os.path.abspath(p) for p in paths)
