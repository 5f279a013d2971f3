"""Hugging Face `save_pretrained` directories (safetensors) in and out of a sharded model.

`load_pretrained(model, path)` reads `model.safetensors` or the shards listed in
`model.safetensors.index.json` on every rank (safetensors maps files lazily) and loads them
into the sharded model; tied parameters that `save_pretrained` stores once (GPT-2's
`lm_head.weight`) are filled from their twin. `save_pretrained(model, path)` gathers the full
fp32 state dict and has rank 0 call the unwrapped model's own `save_pretrained`, atomically,
replacing only the files that writes (the directory's tokenizer, model card... are kept).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.checkpoint import atomic, manifest, save_checks
from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.state_dicts.model_state import get_model_state_dict, set_model_state_dict
from fsdp_bridge.state_dicts.parts import entries, find_parts, world_rank

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
KIND = "save_pretrained"  # our manifest's kind for these directories


def safetensors_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    index = os.path.join(path, INDEX)
    if os.path.isfile(index):
        with open(index) as handle:
            weight_map = json.load(handle)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(path, SINGLE)
    if os.path.isfile(single):
        return [single]
    raise CheckpointError(f"{path!r} holds no {SINGLE} and no {INDEX}: not a Hugging Face "
                          "save_pretrained directory (safetensors).")


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    state = {}
    for file in safetensors_files(path):
        try:
            state.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{file!r} cannot be read as safetensors ({exc}): the file "
                                  "is truncated or corrupt.") from exc
    return state


def _unwrapped(model: nn.Module) -> nn.Module:
    parts = find_parts(model)
    if len(parts) == 1 and parts[0].prefix == "":
        return parts[0].sharded.module
    return model


def load_pretrained(model: nn.Module, path: str, *, strict: bool = True):
    """Load a `save_pretrained` directory into `model` (sharded by any front-end). A
    collective; checked before anything is written."""
    state = read_safetensors(path)
    parts = find_parts(model)
    ents = entries(model, parts)
    # Fill tied aliases that save_pretrained stored once.
    by_param: dict[int, list[str]] = {}
    for entry in ents:
        if not entry.is_buffer:
            by_param.setdefault(id(entry.tensor), []).append(entry.key)
    for names in by_param.values():
        present = next((n for n in names if n in state), None)
        if present is not None:
            for name in names:
                state.setdefault(name, state[present])
    # Non-persistent or recomputed buffers are not saved by HF either: keep the model's own.
    missing_buffers = [e.key for e in ents if e.is_buffer and e.key not in state]
    for key in missing_buffers:
        state[key] = next(e.tensor for e in ents if e.key == key).detach().clone()
    return set_model_state_dict(model, state, strict=strict)


def save_pretrained(model: nn.Module, path: str, *, overwrite: bool = False, **kwargs) -> str:
    """The full fp32 weights through the model's own `save_pretrained` (rank 0), atomically,
    with our manifest. The directory may hold a tokenizer, a model card, anything: only what
    transformers' `save_pretrained` writes is replaced (the weights, `config.json`,
    `generation_config.json`; see [Note: a writer owns only what it wrote]), and model files
    that fsdp-bridge did not write only with `overwrite=True`; a file is refused."""
    full = get_model_state_dict(model, full_state_dict=True, cpu_offload=True)
    path = os.path.abspath(path)
    token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    error = [None]
    if world_rank() == 0:
        tmp = atomic.temporary_path(path, token[0])
        try:
            with atomic.locked_target(path, overwrite, KIND):
                atomic.clean_before_save(path, KIND)
                try:
                    _unwrapped(model).save_pretrained(tmp, state_dict=full,
                                                      safe_serialization=True, **kwargs)
                    files = manifest.data_files(tmp)
                    manifest.write(tmp, manifest.checksums(tmp, files), KIND)
                    atomic.publish(tmp, path, token[0], KIND)
                finally:
                    if os.path.isdir(tmp):
                        shutil.rmtree(tmp, ignore_errors=True)
        except Exception as exc:  # noqa: BLE001 - every rank raises
            error = [str(save_checks.explain(exc, path))]
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0] is not None:
        raise CheckpointError(f"save_pretrained to {path!r} failed on rank 0: {error[0]}")
    return path
