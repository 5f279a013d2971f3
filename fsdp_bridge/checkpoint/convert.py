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

from fsdp_bridge.checkpoint import atomic, validate
from fsdp_bridge.checkpoint.validate import CheckpointError

FORMATS = ("torch", "dcp", "safetensors")


@dataclasses.dataclass
class Report:
    source_format: str
    target_format: str
    tensors: int
    bytes: int
    key: Optional[str]
    dropped: list

    def lines(self) -> list[str]:
        out = [f"converted {self.source_format} -> {self.target_format}: {self.tensors} "
               f"tensors, {self.bytes / 2**20:.2f} MiB, read back and identical"]
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
        state: dict = {}
        # What torch's own dcp_to_torch_save does: an empty state dict that the planner fills
        # with everything the checkpoint holds (dcp.load would fill a copy).
        _load_state_dict(state, storage_reader=FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        return state
    if fmt == "safetensors":
        from fsdp_bridge.checkpoint.hf import read_safetensors

        return read_safetensors(path)
    raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")


# -- writing ------------------------------------------------------------------------------------


def _flat_tensors(state: dict, key: Optional[str]):
    """(flat {name: tensor}, sub-dict kept, non-tensors dropped) for safetensors."""
    if key is None and isinstance(state.get("model"), dict):
        key = "model"
    if key is not None:
        if not isinstance(state.get(key), dict):
            raise CheckpointError(f"the source has no sub-dict {key!r} (top-level keys: "
                                  f"{sorted(state)[:8]}).")
        state = state[key]
    flat, dropped = {}, []

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                visit(f"{prefix}{k}." if not isinstance(v, torch.Tensor) else prefix + str(k), v)
            return
        name = prefix.rstrip(".")
        if isinstance(value, torch.Tensor):
            flat[name] = value.detach().contiguous().clone()
        else:
            dropped.append(name)

    for k, v in state.items():
        visit(str(k) if isinstance(v, torch.Tensor) else f"{k}.", v)
    return flat, key, dropped


def write(state: dict, path: str, fmt: str) -> None:
    token = uuid.uuid4().hex[:12]
    tmp = atomic.temporary_path(path, token)
    try:
        if fmt == "torch":
            with open(tmp, "wb") as handle:
                torch.save(state, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
            atomic.fsync_dir(os.path.dirname(os.path.abspath(path)))
        elif fmt == "dcp":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint import FileSystemWriter

            os.makedirs(tmp)
            dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=True)
            atomic.publish(tmp, path, token)
        elif fmt == "safetensors":
            from safetensors.torch import save_file

            if path.endswith(".safetensors"):
                save_file(state, tmp, metadata={"format": "pt"})
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
                os.replace(tmp, path)
                atomic.fsync_dir(os.path.dirname(os.path.abspath(path)))
            else:  # a directory, as save_pretrained writes it
                os.makedirs(tmp)
                save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
                atomic.publish(tmp, path, token)
        else:
            raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        elif os.path.exists(tmp):
            os.remove(tmp)


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
    if os.path.lexists(target) and not force:
        raise CheckpointError(f"{target!r} exists; pass --force to replace it (atomically).")
    if os.path.abspath(source) == os.path.abspath(target):
        raise CheckpointError("source and destination are the same path.")
    state = read(source, source_format)
    dropped: list = []
    kept_key = None
    if to == "safetensors":
        state, kept_key, dropped = _flat_tensors(state, key)
        if not state:
            raise CheckpointError(f"{source!r} holds no tensors to write as safetensors.")
    elif to == "dcp":
        # DCP stores Python values too; it needs string keys at the top level only.
        state = {str(k): v for k, v in state.items()}
    write(state, target, to)
    problems = _compare(state, read(target, to))
    if problems:
        raise CheckpointError(f"{target!r} was written but does not read back identical: "
                              + "; ".join(problems[:6]))
    tensors, size = _count(state)
    return Report(source_format, to, tensors, size, kept_key, dropped)
