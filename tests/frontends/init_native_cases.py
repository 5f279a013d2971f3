"""Unit-by-unit initialisation from meta against native FSDP1 in one CPU/gloo world of two
ranks (see test_init_native.py): the same modules materialised in the same order, so the same
RNG draws land on the same tensors."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.world import run_case_table


class Block(nn.Module):
    """A container inside a container: FSDP1 visits `inner` and `out` before `inner`'s
    children, a depth-first walk the other way round."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.out = nn.Linear(4, 4)
        self.register_buffer("scale", torch.empty(4))
        self.register_buffer("counter", torch.empty(1), persistent=False)

    def reset_parameters(self):
        nn.init.uniform_(self.scale)
        self.counter.fill_(3.0)

    def forward(self, x):
        return self.out(self.inner(x)) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class NoReset(nn.Module):
    """A parameter and a buffer of its own, and no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))
        self.register_buffer("step", torch.zeros(()))

    def forward(self, x):
        return x @ self.weight


def _fsdp(which):
    module = "torch.distributed.fsdp" if which == "native" else "fsdp_bridge.fsdp"
    return importlib.import_module(module).FullyShardedDataParallel


def _initial_state(which, build, policy, param_init_fn):
    """The full state (parameters and buffers) right after wrapping a model built on meta."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build()
    fsdp = _fsdp(which)
    wrapped = fsdp(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                   use_orig_params=True, param_init_fn=param_init_fn)
    with fsdp.summon_full_params(wrapped):
        params = {_clean(n): p.detach().clone() for n, p in wrapped.named_parameters()}
    buffers = {_clean(n): b.clone() for n, b in wrapped.named_buffers()}
    return {"params": params, "buffers": buffers}


def _clean(name: str) -> str:
    """The model's own name (native FSDP1 nests its wrappers into the names)."""
    return name.replace("_fsdp_wrapped_module.", "")


def _recording_init(calls: list):
    def param_init_fn(module):
        calls.append(type(module).__name__)
        module.to_empty(device="cpu", recurse=False)
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return param_init_fn


def nested_reset(which):
    return _initial_state(which, Net, ModuleWrapPolicy({Block}), None)


def nested_param_init_fn(which):
    calls: list = []
    out = _initial_state(which, Net, ModuleWrapPolicy({Block}), _recording_init(calls))
    return {**out, "calls": calls}


def no_reset_parameters(which):
    try:
        _initial_state(which, lambda: nn.Sequential(nn.Linear(4, 4), NoReset()), None, None)
    except AttributeError as error:
        return {"raised": "AttributeError", "message": str(error)}
    return {"raised": None}


def llama_param_init_fn(which):
    """A tiny Hugging Face Llama on meta, initialised by its own `_init_weights` per module."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from tests import models as M

    holder: dict = {}

    def build():
        holder["model"] = M.tiny_llama(device="meta")
        return holder["model"]

    def param_init_fn(module):
        module.to_empty(device="cpu", recurse=False)
        if next(iter(module.parameters(recurse=False)), None) is not None:
            holder["model"]._init_weights(module)

    out = _initial_state(which, build, ModuleWrapPolicy({LlamaDecoderLayer}), param_init_fn)
    # The rotary embedding's buffer is left to the model (`_init_weights` does not fill it):
    # its bytes are whatever memory it got, natively too.
    return {"params": out["params"], "buffers": {}}


def _both(fn):
    def run(rank, world):
        out = {}
        for which in ("native", "ours"):
            out[which] = fn(which)
            dist.barrier()
        return out
    return run


def cases() -> dict:
    return {name: _both(fn) for name, fn in [
        ("nested_reset", nested_reset),
        ("nested_param_init_fn", nested_param_init_fn),
        ("no_reset_parameters", no_reset_parameters),
        ("llama_param_init_fn", llama_param_init_fn),
    ]}


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
