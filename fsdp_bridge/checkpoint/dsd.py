"""Make torch's own `torch.distributed.checkpoint.state_dict` functions right for our models.

[Note: routing torch's state-dict helpers]
`get_model_state_dict`, `set_model_state_dict`, `get_optimizer_state_dict`,
`set_optimizer_state_dict`, `get_state_dict` and `set_state_dict` recognise native FSDP1 by
class and treat every other model as plain: they call `model.state_dict()` and map
`optim.state_dict()` by `named_parameters()`. For models of our flat-layout front-ends
(FSDP1, YaFSDP, Zeta, TorchAcc) that would report each rank's 1-D piece of a parameter as if it
were the whole parameter (and `dcp.save` would keep one rank's piece). Users call these
functions by their torch names, so we route them: the four private workers they all go through
(`_get_model_state_dict`, `_load_model_state_dict`, `_get_optim_state_dict`,
`_load_optim_state_dict`, which receive the parsed `StateDictOptions`) are wrapped once, and a
model that contains a flat-layout module goes to `fsdp_bridge.checkpoint.model_state` /
`optim_state`; every other model, FSDP2 models of ours included (their parameters are DTensors
torch handles as they are), goes to torch's code unchanged. Installed when a flat-layout
front-end builds a model (`fsdp_bridge.wrapper.shard_flat`) or this package is imported. Should
a torch release rename the workers, `install()` fails loudly and `fsdp_bridge.checkpoint`'s
functions still work.

This routing is the one place left where we reach into torch; it goes once the flat-layout
front-ends expose DTensor parameters too.
"""

from __future__ import annotations

import functools

from fsdp_bridge.checkpoint import model_state, optim_state
from fsdp_bridge.checkpoint.parts import has_flat_shards

_WORKERS = ("_get_model_state_dict", "_load_model_state_dict", "_get_optim_state_dict",
            "_load_optim_state_dict")
_INSTALLED = [False]


def install() -> None:
    if _INSTALLED[0]:
        return
    import torch.distributed.checkpoint.state_dict as dsd

    missing = [name for name in _WORKERS if not hasattr(dsd, name)]
    if missing:
        raise RuntimeError(
            f"fsdp_bridge: this torch's torch.distributed.checkpoint.state_dict has no "
            f"{missing}; its state-dict helpers cannot be routed to fsdp_bridge models. Use "
            "fsdp_bridge.checkpoint.get_model_state_dict & co. instead.")
    original = {name: getattr(dsd, name) for name in _WORKERS}

    @functools.wraps(original["_get_model_state_dict"])
    def _get_model_state_dict(model, info):
        if not info.handle_model or not has_flat_shards(model):
            return original["_get_model_state_dict"](model, info)
        return model_state.get_model_state_dict(
            model, full_state_dict=info.full_state_dict, cpu_offload=info.cpu_offload,
            ignore_frozen_params=info.ignore_frozen_params)

    @functools.wraps(original["_load_model_state_dict"])
    def _load_model_state_dict(model, state_dict, info):
        if not info.handle_model or not has_flat_shards(model):
            return original["_load_model_state_dict"](model, state_dict, info)
        if not state_dict and not info.broadcast_from_rank0:
            return original["_load_model_state_dict"](model, state_dict, info)
        return model_state.set_model_state_dict(
            model, state_dict, strict=info.strict, broadcast_from_rank0=info.broadcast_from_rank0)

    @functools.wraps(original["_get_optim_state_dict"])
    def _get_optim_state_dict(model, optimizers, info):
        if not info.handle_optim or not has_flat_shards(model):
            return original["_get_optim_state_dict"](model, optimizers, info)
        result = optim_state.get_optimizer_state_dict(
            model, optimizers, full_state_dict=info.full_state_dict, cpu_offload=info.cpu_offload)
        if info.flatten_optimizer_state_dict and result:
            result = dsd._flatten_optim_state_dict(result)
        return result

    @functools.wraps(original["_load_optim_state_dict"])
    def _load_optim_state_dict(model, optimizers, state_dict, info):
        if not info.handle_optim or not has_flat_shards(model):
            return original["_load_optim_state_dict"](model, optimizers, state_dict, info)
        optim_state.set_optimizer_state_dict(
            model, optimizers, state_dict, strict=info.strict,
            broadcast_from_rank0=info.broadcast_from_rank0)

    for name, fn in (("_get_model_state_dict", _get_model_state_dict),
                     ("_load_model_state_dict", _load_model_state_dict),
                     ("_get_optim_state_dict", _get_optim_state_dict),
                     ("_load_optim_state_dict", _load_optim_state_dict)):
        fn._fsdp_bridge_original = original[name]
        setattr(dsd, name, fn)
    _INSTALLED[0] = True
