"""Helpers shared by the integration tests: which engine sharded a model, its full state dict,
and a nested comparison with a message naming what differs."""

from __future__ import annotations

import torch

FP32_TOL = dict(rtol=1e-5, atol=1e-6)


def engine_of(model) -> str:
    from fsdp_bridge.fsdp import FSDPModule

    return "fsdp_bridge" if isinstance(model, FSDPModule) else "torch"


def full_state(model) -> dict:
    """The model's full state dict (fp32 copies), through torch's DCP state-dict helper."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in state.items()}


def same(actual, expected, what: str, tol: dict = FP32_TOL) -> None:
    """Equal within `tol`, dicts key by key (same keys, same order), numbers and tensors."""
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"{what}: keys differ"
        for key in expected:
            same(actual[key], expected[key], f"{what} {key}", tol)
    else:
        torch.testing.assert_close(torch.as_tensor(actual), torch.as_tensor(expected), **tol,
                                   msg=lambda m: f"{what}: {m}")
