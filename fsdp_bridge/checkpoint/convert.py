"""Offline conversion between checkpoint formats, without ranks or a model.

Formats:
- `torch`: one file written by `torch.save` holding a (possibly nested) state dict of full
  tensors: a FULL_STATE_DICT, `{"model": ..., "optim": FSDP.optim_state_dict(...)}`, ...
- `dcp`: a `torch.distributed.checkpoint` directory (any world size wrote it; read whole).
- `safetensors`: a `.safetensors` file or a Hugging Face `save_pretrained` directory; flat
  tensors only, so converting to it keeps the tensors of one sub-dict (`key`, by default
  "model" when the state has one) and refuses anything else.

Every write is atomic (temporary name, fsync, rename) and is read back and compared, tensor by
tensor and bit for bit, with what was meant to be written before the command reports success.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import uuid
from typing import Any, Optional

import torch

from fsdp_bridge.checkpoint import atomic, manifest, save_checks, validate
from fsdp_bridge.checkpoint.validate import CheckpointError

FORMATS = ("torch", "dcp", "safetensors")


@dataclasses.dataclass
class Report:
    source_format: str
    target_format: str
    tensors: int  # written, and counted again in what was read back
    bytes: int
    key: Optional[str]
    dropped: list
    source_tensors: int = 0  # in the whole source

    def lines(self) -> list[str]:
        out = [f"converted {self.source_format} -> {self.target_format}: {self.tensors} "
               f"tensors ({self.source_tensors} in the source), {self.bytes / 2**20:.2f} MiB, "
               "read back: same count, identical"]
        if self.key:
            out.append(f"  kept the tensors under {self.key!r} (safetensors holds flat tensors)")
        if self.dropped:
            out.append(f"  not tensors, not written: {', '.join(self.dropped[:8])}"
                       + (" ..." if len(self.dropped) > 8 else ""))
        return out


def detect(path: str) -> str:
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, ".metadata")):
            return "dcp"
        try:
            from fsdp_bridge.checkpoint.hf import safetensors_files

            safetensors_files(path)
            return "safetensors"
        except CheckpointError:
            pass
        raise CheckpointError(f"{path!r} is a directory but neither a DCP checkpoint (no "
                              "'.metadata') nor a save_pretrained directory (no "
                              "model.safetensors).")
    if not os.path.exists(path):
        raise CheckpointError(f"{path!r} does not exist.")
    if path.endswith(".safetensors"):
        return "safetensors"
    return "torch"


# -- reading ------------------------------------------------------------------------------------


def _verify_manifest(directory: str) -> None:
    """Our checksums, when the directory has our manifest (see [Note: the manifest])."""
    data = manifest.read(directory)
    problems = manifest.verify(directory, data) if data is not None else []
    if problems:
        raise CheckpointError(f"checkpoint {directory!r} is damaged: {'; '.join(problems[:4])}.")


def read(path: str, fmt: str) -> dict:
    if fmt == "torch":
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - many types for a damaged file
            raise CheckpointError(f"{path!r} cannot be read by torch.load ({type(exc).__name__}: "
                                  f"{exc}): the file is truncated, corrupt or not a torch "
                                  "checkpoint.") from exc
        if not isinstance(state, dict):
            raise CheckpointError(f"{path!r} holds a {type(state).__name__}, not a state dict.")
        return state
    if fmt == "dcp":
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        metadata = validate.read_metadata(path)
        validate.check_files(path, metadata)
        _verify_manifest(path)
        state: dict = {}
        # What torch's own dcp_to_torch_save does: an empty state dict that the planner fills
        # with everything the checkpoint holds (dcp.load would fill a copy).
        _load_state_dict(state, storage_reader=FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return state
    if fmt == "safetensors":
        from fsdp_bridge.checkpoint.hf import read_safetensors

        if os.path.isdir(path):
            _verify_manifest(path)
        return read_safetensors(path)
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


# -- writing ------------------------------------------------------------------------------------


def _flat_tensors(state: dict, key: Optional[str]):
    """(flat {name: tensor}, sub-dict kept, non-tensors dropped) for safetensors; nested keys
    are joined with "." and two keys that become one name are refused."""
    if key is None and isinstance(state.get("model"), dict):
        key = "model"
    if key is not None:
        if not isinstance(state.get(key), dict):
            raise CheckpointError(f"the source has no sub-dict {key!r} (top-level keys: "
                                  f"{sorted(map(str, state))[:8]}).")
        state = state[key]
    flat, origin, dropped, collisions = {}, {}, [], []
    for parts, value in save_checks.leaves(state):
        name = ".".join(map(str, parts))
        if not isinstance(value, torch.Tensor):
            dropped.append(name)
        elif name in flat:
            collisions.append(f"{origin[name]} and {_show(parts)} both become {name!r}")
        else:
            flat[name], origin[name] = value.detach().contiguous().clone(), _show(parts)
    if collisions:
        raise CheckpointError(f"cannot write safetensors: keys collide: "
                              f"{'; '.join(collisions[:4])}. safetensors holds one flat name per "
                              "tensor, so one of them would be lost. Nothing was written.")
    return flat, key, dropped


def _show(parts: tuple) -> str:
    return "".join(f"[{part!r}]" for part in parts)


def write(state: dict, path: str, fmt: str) -> None:
    token = uuid.uuid4().hex[:12]
    tmp = atomic.temporary_path(path, token)
    try:
        if fmt == "torch":
            with open(tmp, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            _replace_file(tmp, path)
        elif fmt == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            os.makedirs(tmp)
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=True)
            _publish_with_manifest(tmp, path, token, "dcp")
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            if path.endswith(".safetensors"):
                save_file(state, tmp, metadata={"format": "pt"})
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
                _replace_file(tmp, path)
            else:  # a directory, as save_pretrained writes it
                os.makedirs(tmp)
                save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
                _publish_with_manifest(tmp, path, token, "safetensors")
        else:
            raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.remove(tmp)


def _replace_file(tmp: str, path: str) -> None:
    os.replace(tmp, path)
    atomic.fsync_dir(os.path.dirname(os.path.abspath(path)))
    atomic.clean_leftovers(path)


def _publish_with_manifest(tmp: str, path: str, token: str, kind: str) -> None:
    manifest.write(tmp, manifest.checksums(tmp, manifest.data_files(tmp)), kind)
    atomic.publish(tmp, path, token)


def _compare(expected: Any, actual: Any, where: str = "") -> list[str]:
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{where or '<root>'}: a dict was written, a {type(actual).__name__} read"]
        problems = []
        keys_e, keys_a = {str(k) for k in expected}, {str(k) for k in actual}
        if keys_e != keys_a:
            problems.append(f"{where or '<root>'}: keys differ: "
                            f"{sorted(keys_e ^ keys_a)[:6]}")
        by_str = {str(k): v for k, v in actual.items()}
        for k, v in expected.items():
            if str(k) in by_str:
                problems += _compare(v, by_str[str(k)], f"{where}.{k}" if where else str(k))
        return problems
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor) or expected.shape != actual.shape \
                or expected.dtype != actual.dtype or not torch.equal(expected, actual):
            return [f"{where}: tensor differs after writing"]
        return []
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(expected) != len(actual):
            return [f"{where}: list differs after writing"]
        return [p for i, (e, a) in enumerate(zip(expected, actual))
                for p in _compare(e, a, f"{where}.{i}")]
    return [] if expected == actual else [f"{where}: {expected!r} written, {actual!r} read"]


def _count(state: Any) -> tuple[int, int]:
    if isinstance(state, dict):
        parts = [_count(v) for v in state.values()]
    elif isinstance(state, (list, tuple)):
        parts = [_count(v) for v in state]
    elif isinstance(state, torch.Tensor):
        return 1, state.numel() * state.element_size()
    else:
        return 0, 0
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


DIRECTORY_OUTPUT = {"dcp": True, "torch": False}


def _writes_directory(path: str, to: str) -> bool:
    return DIRECTORY_OUTPUT.get(to, not path.endswith(".safetensors"))


def _is_checkpoint_directory(path: str) -> bool:
    try:
        return manifest.is_ours(path) or detect(path) in ("dcp", "safetensors")
    except CheckpointError:
        return False


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
        raise CheckpointError(f"{target!r} exists; pass --force to replace it (atomically).")
    directory = _writes_directory(target, to)
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
            "no safetensors, no fsdp-bridge manifest); replacing it would delete what it holds. "
            "Nothing was changed; choose a new path (or remove it yourself).")


def convert(source: str, target: str, to: str, *, key: Optional[str] = None,
            force: bool = False) -> Report:
    if to not in FORMATS:
        raise ValueError(f"--to {to!r}: one of {', '.join(FORMATS)}")
    source_format = detect(source)
    check_destination(source, target, to, force)
    state = read(source, source_format)
    source_tensors, _ = _count(state)
    dropped: list = []
    kept_key = None
    if to == "safetensors":
        state, kept_key, dropped = _flat_tensors(state, key)
        if not state:
            raise CheckpointError(f"{source!r} holds no tensors to write as safetensors.")
    elif to == "dcp":
        # DCP stores Python values too; it joins nested keys with "." (and needs str keys).
        save_checks.check_collisions(state, f"cannot write {target!r} as DCP")
        state = {str(k): v for k, v in state.items()}
    tensors, size = _count(state)
    with atomic.lock(target):
        # Again under the lock: a save of `target` that ran meanwhile may have changed it.
        check_destination(source, target, to, force)
        atomic.clean_before_save(target)
        try:
            write(state, target, to)
        except Exception as exc:  # noqa: BLE001 - disk full, permissions: said clearly
            raise save_checks.explain(exc, target) from exc
    back = read(target, to)
    read_back, _ = _count(back)
    if read_back != tensors:
        raise CheckpointError(f"{target!r} was written with {tensors} tensors but {read_back} "
                              "read back.")
    problems = _compare(state, back)
    if problems:
        raise CheckpointError(f"{target!r} was written but does not read back identical: "
                              + "; ".join(problems[:6]))
    return Report(source_format, to, tensors, size, kept_key, dropped, source_tensors)
