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
  `CheckpointError`). `save` writes over only its own checkpoints (see `manifest`) unless
  `overwrite=True`, and replaces only its own files there, keeping the user's (see
  `ownership`); one save of a path at a time, and it cleans what crashed saves left (see
  `atomic`); `save_checks` refuses values it cannot store before writing.
- `save_state` / `load_state` / `CheckpointManager`: a model and its optimizers in one call.
- `hf`: Hugging Face `save_pretrained` directories (safetensors) in and out.
- `convert`: offline conversion between torch, DCP and safetensors files
  (`fsdp-bridge convert-checkpoint`), its arguments checked first by `convert_checks`.
"""

from __future__ import annotations

import importlib

# Public names and the module each comes from, imported on first use: the package itself loads
# no torch, so that `convert-checkpoint` checks its arguments (with the torch-free `manifest`,
# `ownership` and `convert_checks`) before torch is imported.
_TORCH_HELPERS = "torch.distributed.checkpoint.state_dict"  # re-exported, unchanged
_EXPORTS = {
    "CheckpointError": "fsdp_bridge.checkpoint.validate",
    "CheckpointManager": "fsdp_bridge.checkpoint.api",
    "StateDictOptions": _TORCH_HELPERS,
    "get_model_state_dict": _TORCH_HELPERS,
    "get_optimizer_state_dict": _TORCH_HELPERS,
    "get_state_dict": _TORCH_HELPERS,
    "load": "fsdp_bridge.checkpoint.api",
    "load_state": "fsdp_bridge.checkpoint.api",
    "save": "fsdp_bridge.checkpoint.api",
    "save_state": "fsdp_bridge.checkpoint.api",
    "set_model_state_dict": _TORCH_HELPERS,
    "set_optimizer_state_dict": _TORCH_HELPERS,
    "set_state_dict": _TORCH_HELPERS,
    "training_state": "fsdp_bridge.checkpoint.api",
}
__all__ = sorted(_EXPORTS)

# Submodules reached as attributes (`from fsdp_bridge import checkpoint; checkpoint.hf...`),
# imported on first use: `hf` reads safetensors, which only the `hf` extra installs.
_SUBMODULES = ("hf", "convert")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBMODULES))
