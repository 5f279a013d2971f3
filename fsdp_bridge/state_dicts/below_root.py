"""A wrapper module of ours that is not the root of the model being saved or loaded: a module
holding it beside modules of its own, or torch's `checkpoint_wrapper` around it.

nn.Module's `state_dict()` calls each child's own `state_dict()`, so the root's state dict
already holds our wrapper's keys as its `state_dict()` gives them (without its inner attribute).
Two other paths do not reach our overrides:

- [Note: loaded through a parent module] the root's `load_state_dict` loads each submodule
  itself, and our inner modules hold 1-D pieces under names with the wrapper's inner attribute.
  A load pre-hook on the wrapper takes the keys under its prefix, loads them as the wrapper's
  `load_state_dict` does and reports their missing and unexpected keys to the root's load; a
  post-hook drops the inner modules' complaints about the keys loaded there. The root's `strict`
  decides at the end, as for every module (native FSDP1's load hooks do the same with its
  flat parameters).
- torch's state-dict helpers name optimizer state by the root's `named_parameters()`, which
  reaches the wrapper through `named_modules`: asked by those helpers, the wrapper names its
  modules without its inner attribute (native FSDP1 they recognise by its class).
"""

from __future__ import annotations

from torch import nn

from fsdp_bridge.state_dicts.parts import entries, find_parts
from fsdp_bridge.state_dicts.torch_helpers import called_by_torch_helpers

LOADED_UNDER = "_fsdp_bridge_loaded_under"


def hook_into_parent_loads(wrapper: nn.Module) -> tuple:
    """Install the load hooks of [Note: loaded through a parent module] on `wrapper`, which
    defines `_hidden_child` (its inner attribute) and `_load_overlap(state_dict)`; returns
    their handles."""
    return (wrapper.register_load_state_dict_pre_hook(_load_from_parent),
            wrapper.register_load_state_dict_post_hook(_inner_keys_loaded))


def load_overlap(wrapper: nn.Module, state_dict: dict) -> tuple[list, list]:
    """Load the keys of `state_dict` (canonical names) the wrapped model has, through the
    wrapper's `load_state_dict`; return (missing, unexpected) keys."""
    expected = [entry.key for entry in entries(wrapper, find_parts(wrapper))]
    known = set(expected)
    wrapper.load_state_dict({k: v for k, v in state_dict.items() if k in known}, strict=False)
    return ([key for key in expected if key not in state_dict],
            [key for key in state_dict if key not in known])


def _load_from_parent(wrapper, state_dict, prefix, local_metadata, strict, missing_keys,
                      unexpected_keys, error_msgs) -> None:
    ours = {key[len(prefix):]: state_dict.pop(key)
            for key in list(state_dict) if key.startswith(prefix)}
    missing, unexpected = wrapper._load_overlap(ours)
    missing_keys.extend(prefix + key for key in missing)
    unexpected_keys.extend(prefix + key for key in unexpected)
    wrapper.__dict__[LOADED_UNDER] = f"{prefix}{wrapper._hidden_child}."


def _inner_keys_loaded(wrapper, incompatible_keys) -> None:
    inner = wrapper.__dict__.pop(LOADED_UNDER, None)
    if inner is not None:
        incompatible_keys.missing_keys[:] = [
            key for key in incompatible_keys.missing_keys if not key.startswith(inner)]


def named_modules(wrapper: nn.Module, memo, prefix: str, remove_duplicate: bool):
    """`wrapper.named_modules(...)` with the modules inside named without its inner attribute
    when torch's state-dict helpers ask; None otherwise (nn.Module's answer stands)."""
    if not called_by_torch_helpers():
        return None
    return _clean_named_modules(wrapper, memo, prefix, remove_duplicate)


def _clean_named_modules(wrapper, memo, prefix, remove_duplicate):
    memo = set() if memo is None else memo
    if remove_duplicate:
        if wrapper in memo:
            return
        memo.add(wrapper)
    yield prefix, wrapper
    yield from wrapper._modules[wrapper._hidden_child].named_modules(memo, prefix,
                                                                     remove_duplicate)
