"""Checkpoints that cross dialects, world sizes and failures.

- torch's `torch.distributed.checkpoint.state_dict` functions (`get_model_state_dict`,
  `set_model_state_dict`, `get_optimizer_state_dict`, `set_optimizer_state_dict`,
  `get_state_dict`, `set_state_dict`) work on models sharded by any of our front-ends, full
  and sharded, with optimizer state keyed by parameter name; sharded values are DTensors laid
  out as native FSDP2's, so `dcp.save` / `dcp.load` reshard between any world sizes and
  interoperate with native FSDP2 and FSDP1. FSDP2 models of ours hold such DTensors; models of
  the flat-layout front-ends describe themselves in that form when those functions ask (see
  `fsdp_bridge.state_dicts.torch_helpers`). They are re-exported here, unchanged.
- `save` / `load`: DCP, atomic (a crash never leaves a partial checkpoint) and checked before
  reading (truncated files, checksums, missing / unexpected keys, wrong shapes:
  `CheckpointError`). `save` replaces only its own checkpoints (see `manifest`) unless
  `overwrite=True`, one save of a path at a time, and cleans what crashed saves left
  (see `atomic`); `save_checks` refuses values it cannot store before writing.
- `save_state` / `load_state` / `CheckpointManager`: a model and its optimizers in one call.
- `hf`: Hugging Face `save_pretrained` directories (safetensors) in and out.
- `convert`: offline conversion between torch, DCP and safetensors files
  (`fsdp-bridge convert-checkpoint`).
"""

from __future__ import annotations

import importlib

from torch.distributed.checkpoint.state_dict import (  # noqa: F401  (re-exported)
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from fsdp_bridge.checkpoint.api import (
    CheckpointManager,
    load,
    load_state,
    save,
    save_state,
    training_state,
)
from fsdp_bridge.checkpoint.validate import CheckpointError

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "load",
    "load_state",
    "save",
    "save_state",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
    "training_state",
]

# Submodules reached as attributes (`from fsdp_bridge import checkpoint; checkpoint.hf...`),
# imported on first use: `hf` reads safetensors, which only the `hf` extra installs.
_SUBMODULES = ("hf", "convert")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
