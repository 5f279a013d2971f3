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
A directory written with `--force` over an earlier one keeps every file that is not the
format's own (see [Note: a writer owns only what it wrote]). The arguments are checked by
`convert_checks` before anything is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import shutil
import uuid
from typing import Any, Optional

import torch

from fsdp_bridge.checkpoint import atomic, convert_checks, manifest, save_checks, validate
from fsdp_bridge.checkpoint.convert_checks import FORMATS, check_destination, detect
from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.outputs import atomic_path


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
        except pickle.UnpicklingError as exc:
            raise _unsafe_objects(path, exc) from exc
        except Exception as exc:  # noqa: BLE001 - many types for a damaged file
            raise CheckpointError(f"{path!r} cannot be read by torch.load ({type(exc).__name__}: "
                                  f"{_first_line(exc)}): the file is truncated, corrupt or not a "
                                  "torch checkpoint.") from exc
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


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _unsafe_objects(path: str, exc: pickle.UnpicklingError) -> CheckpointError:
    """torch.load(weights_only=True) refused a pickled object: say so in one line (torch's own
    message runs to eight lines and suggests turning the check off, which would run whatever
    code the file names)."""
    said = str(exc)
    if "Weights only load failed" not in said:
        return CheckpointError(f"{path!r} cannot be read by torch.load (UnpicklingError: "
                               f"{_first_line(exc)}): the file is truncated, corrupt or not a "
                               "torch checkpoint.")
    named = re.search(r"GLOBAL ([\w.]+)", said)
    what = f"one is a {named.group(1)}" if named else "its pickle names code to run"
    return CheckpointError(
        f"{path!r} holds Python objects that are not tensors or plain values ({what}); "
        "convert-checkpoint reads tensors, dicts, lists, numbers and strings only, and never "
        "runs code a file names. Save the state dict with those alone (e.g. torch.from_numpy "
        "for arrays) and convert that file.")


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
            with _file_at(path, tmp) as out, open(out, "wb") as handle:
                # Through a Python file: a failed write keeps its errno (a full disk is said
                # as such), which torch's own file writer reports as "iostream error".
                torch.save(state, handle)
        elif fmt == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            os.makedirs(tmp)
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=True)
            _publish_with_manifest(tmp, path, token, "dcp")
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            if path.endswith(".safetensors"):
                with _file_at(path, tmp) as out:
                    save_file(state, out, metadata={"format": "pt"})
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


@contextlib.contextmanager
def _file_at(path: str, tmp: str):
    """Write one file durably in place of `path` (through `tmp`), then remove what crashed
    conversions to `path` left."""
    with atomic_path(path, temporary=tmp, durable=True) as out:
        yield out
    atomic.clean_leftovers(path)


def _publish_with_manifest(tmp: str, path: str, token: str, kind: str) -> None:
    manifest.write(tmp, manifest.checksums(tmp, manifest.data_files(tmp)), kind)
    atomic.publish(tmp, path, token, kind)


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
    kind = convert_checks.kind_written(target, to)
    with atomic.lock(target):
        # Again under the lock: a save of `target` that ran meanwhile may have changed it.
        check_destination(source, target, to, force)
        if kind is not None and os.path.isdir(target):
            atomic.check_replaceable(os.path.abspath(target))
        atomic.clean_before_save(target, kind)
        try:
            write(state, target, to)
        except BaseException as exc:  # noqa: BLE001 - disk full (DCP's CheckpointException too)
            error = save_checks.explain(exc, target)
            if error is exc:  # an interrupt, or already clear
                raise
            raise error from exc
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
