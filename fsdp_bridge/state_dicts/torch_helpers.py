"""How models of the flat-layout front-ends answer torch's own state-dict helpers.

[Note: answering torch's state-dict helpers]
`torch.distributed.checkpoint.state_dict` (`get_model_state_dict`, `get_optimizer_state_dict`,
`get_state_dict` and their `set_` twins) knows native FSDP1 by its class and treats every other
model as plain: it takes `model.state_dict()` and `optim.state_dict()` as they come, names
optimizer state by `model.named_parameters()`, and gathers (`full_state_dict=True`) or reshards
(DCP) only what is a DTensor. The FSDP1-style front-ends (FSDP1, YaFSDP, Zeta, TorchAcc) keep
each parameter as a 1-D local piece of a flat shard, as native FSDP1 does; handed over as they
are, one rank's pieces would be reported as whole parameters, and DCP would keep one rank's.

So, when one of those helpers is the caller (found by looking at who called us, see
`called_by_torch_helpers`), our models and optimizers describe themselves as native FSDP2's
do: values as DTensors chunked by rows over the shard group (see [Note: sharded state dicts
are DTensors over the rows] in `model_state`), names without our wrappers' inner attribute.
torch's code then does the rest unchanged: it gathers DTensors for full state dicts, and DCP
reshards them across world sizes. Called directly, `state_dict()` and `optim.state_dict()` keep
FSDP1's meanings (a full state dict by default; the optimizer's local pieces).

- Models: the wrappers' `state_dict`, `load_state_dict` and `named_parameters` consult
  `called_by_torch_helpers`; their `_fqn_modifiers` tells torch which child our wrappers hide
  from state-dict names (torch's own option for modules that rename their keys).
- Optimizers: torch exposes no hook at construction, so a global step pre-hook (public API)
  gives every optimizer that steps a flat piece a `state_dict` post-hook and a
  `load_state_dict` pre-hook, which convert between the local pieces and the row DTensors.
  torch's helpers initialise optimizer state by taking a step, so an optimizer reaches the
  hooks before they read or load it.
"""

from __future__ import annotations

import sys
import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_bridge.state_dicts import flat_optim, optim_state

TORCH_HELPERS_MODULE = "torch.distributed.checkpoint.state_dict"

_WATCHING: list = []
_SEEN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def called_by_torch_helpers() -> bool:
    """Whether one of torch's state-dict helpers is on the call stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == TORCH_HELPERS_MODULE:
            return True
        frame = frame.f_back
    return False


def watch_optimizers() -> None:
    """Install (once per process) the step pre-hook that equips optimizers of flat pieces."""
    if not _WATCHING:
        _WATCHING.append(register_optimizer_step_pre_hook(_equip))


def _equip(optimizer, args, kwargs) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    seen = _SEEN.get(optimizer)
    if seen is not None and seen[0] == count:
        return
    optim_state.refuse_hidden_originals(optimizer)
    hooked = seen is not None and seen[1]
    if not hooked and (optim_state.holds_flat_pieces(optimizer)
                       or flat_optim.holds_flat_params(optimizer)):
        # State loaded before the optimizer first stepped went in unconverted: refuse it here
        # rather than let a whole-parameter value broadcast against a piece.
        optim_state.check_local_shapes(optimizer)
        optimizer.register_state_dict_post_hook(_describe)
        optimizer.register_load_state_dict_pre_hook(_take)
        hooked = True
    _SEEN[optimizer] = (count, hooked)  # looked at again only when its groups change


def _describe(optimizer, state_dict: dict):
    if not called_by_torch_helpers():
        return None
    _refuse_flat_params(optimizer, "get_optimizer_state_dict")
    return optim_state.pieces_as_rows(optimizer, state_dict)


def _take(optimizer, state_dict: dict):
    if not called_by_torch_helpers():
        return None
    _refuse_flat_params(optimizer, "set_optimizer_state_dict")
    return optim_state.rows_as_pieces(optimizer, state_dict)


def _refuse_flat_params(optimizer, helper: str) -> None:
    """[Note: torch's helpers and flat parameters] torch's state-dict helpers name optimizer
    state by the model's parameters. With `use_orig_params=False` those are FSDP1's flat
    parameters, which torch maps back to the original names only for its own FSDP1 class
    (through `FSDP.optim_state_dict`, a class ours is not). Keyed by our flat parameters, the
    state would only load back at the same world size and wrapping: refuse, naming the APIs
    that give native's per-parameter form."""
    if flat_optim.holds_flat_params(optimizer):
        raise ValueError(
            f"torch.distributed.checkpoint.state_dict.{helper}: this optimizer steps "
            "FullyShardedDataParallel's flat parameters (use_orig_params=False), which torch's "
            "helpers can only name by the flat parameters themselves, not by the model's "
            "parameter names. Use FullyShardedDataParallel.optim_state_dict(model, optim) and "
            "FullyShardedDataParallel.optim_state_dict_to_load(model, optim, state) (native "
            "FSDP1's per-parameter form, loadable at any world size), or wrap with "
            "use_orig_params=True.")
