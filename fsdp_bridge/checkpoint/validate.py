"""Checks of a DCP checkpoint directory before anything is read into a model: is it complete,
is any file truncated, and does it hold what the state dict being loaded asks for."""

from __future__ import annotations

import os
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message says what is wrong."""


def read_metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader

    meta_file = os.path.join(path, ".metadata")
    if not os.path.isfile(meta_file):
        raise CheckpointError(
            f"{path!r} is not a complete torch.distributed.checkpoint directory: it has no "
            "'.metadata' file (the file the coordinator writes last). Was the save "
            "interrupted, or is this another format? (convert it with fsdp-bridge "
            "convert-checkpoint)")
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - unpickling a damaged file raises many types
        raise CheckpointError(
            f"{meta_file!r} cannot be read ({type(exc).__name__}: {exc}): the file is "
            "truncated or corrupt.") from exc


def data_files(metadata) -> list[str]:
    """The data files `metadata` (read from a checkpoint's `.metadata`) places items in."""
    return sorted({info.relative_path for info in (metadata.storage_data or {}).values()})


def check_files(path: str, metadata) -> None:
    """Every data file is at least as long as the items stored in it."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"checkpoint {path!r}: data file {name!r} is missing.")
        actual = os.path.getsize(file)
        if actual < size:
            raise CheckpointError(
                f"checkpoint {path!r}: data file {name!r} is truncated: {actual} bytes, but "
                f"the metadata places data up to byte {size}. The checkpoint is damaged; load "
                "an earlier one.")


def flat_shapes(state_dict: dict) -> dict[str, Any]:
    """DCP's flat keys of `state_dict` -> global shape (None for non-tensors)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from fsdp_bridge.state_dicts.model_state import global_shape

    flat, _ = flatten_state_dict(state_dict)
    return {key: global_shape(value) for key, value in flat.items()}


def check_contents(path: str, metadata, state_dict: dict, strict: bool = True) -> None:
    """Every requested tensor is in the checkpoint with the same shape; under `strict`, the
    checkpoint has nothing more under the requested top-level keys."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = metadata.state_dict_metadata
    wanted = flat_shapes(state_dict)
    missing = [k for k in wanted if k not in stored]
    wrong = []
    for key, shape in wanted.items():
        md = stored.get(key)
        if shape is not None and isinstance(md, TensorStorageMetadata):
            if tuple(md.size) != tuple(shape):
                wrong.append(f"{key}: {tuple(md.size)} in the checkpoint, {tuple(shape)} "
                             "expected")
    tops = {k.split(".", 1)[0] for k in wanted}
    extra = [k for k in stored if k.split(".", 1)[0] in tops and k not in wanted]
    # Optimizer hyper-parameters and state of params the optimizer has not stepped are
    # legitimately optional; only keys that look like model entries count as extra.
    extra = [k for k in extra if ".param_groups." not in f".{k}" and ".state." not in f".{k}"]
    problems = []
    if missing:
        problems.append(f"missing from the checkpoint ({len(missing)}): {_show(missing)}")
    if strict and extra:
        problems.append(f"in the checkpoint but not in the model ({len(extra)}): "
                        f"{_show(extra)}")
    if wrong:
        problems.append(f"wrong shapes ({len(wrong)}): {_show(wrong)}")
    if problems:
        raise CheckpointError(
            f"checkpoint {path!r} does not match what is being loaded: " + "; ".join(problems)
            + ". Load a checkpoint of this model (same architecture and config).")


def _show(items, limit: int = 6) -> str:
    text = ", ".join(items[:limit])
    return text + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
