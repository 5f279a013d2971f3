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


def _initial_state(which, build, policy, param_init_fn, on_meta=True, after_wrap=None,
                   **kwargs):
    """The full state (parameters and buffers) right after wrapping a model built on meta
    (`on_meta`, or on this rank's CPU), once `after_wrap(model)` (the user's own steps after
    the wrap) has run."""
    torch.manual_seed(0)
    with torch.device("meta" if on_meta else "cpu"):
        model = build()
    fsdp = _fsdp(which)
    wrapped = fsdp(model, auto_wrap_policy=policy, device_id=torch.device("cpu"),
                   use_orig_params=True, param_init_fn=param_init_fn, **kwargs)
    seen = after_wrap(model) if after_wrap is not None else {}
    with fsdp.summon_full_params(wrapped):
        params = {_clean(n): p.detach().clone() for n, p in wrapped.named_parameters()}
    buffers = {_clean(n): b.clone() for n, b in wrapped.named_buffers()}
    return {"params": params, "buffers": buffers, **seen}


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


def _hf_param_init_fn(which, build_model, layer_class):
    """A tiny Hugging Face model on meta, initialised by its own `_init_weights` per module.
    Buffers are left out: `_init_weights` does not fill them (a rotary embedding's bytes are
    whatever memory it got, natively too)."""
    holder: dict = {}

    def build():
        holder["model"] = build_model(device="meta")
        return holder["model"]

    def param_init_fn(module):
        module.to_empty(device="cpu", recurse=False)
        if next(iter(module.parameters(recurse=False)), None) is not None:
            holder["model"]._init_weights(module)

    out = _initial_state(which, build, ModuleWrapPolicy({layer_class}), param_init_fn)
    return {"params": out["params"], "buffers": {}}


def llama_param_init_fn(which):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from tests import models as M

    return _hf_param_init_fn(which, M.tiny_llama, LlamaDecoderLayer)


def _meta_names(module: nn.Module) -> list[str]:
    return [name for name, t in [*module.named_parameters(), *module.named_buffers()]
            if t.is_meta]


def _init_ignored_head(model, seed=None):
    """What a user does with an ignored module after the wrap: materialise and initialise it
    (drawing from the RNG where the wrap left it, or from `seed`)."""
    left_on_meta = _meta_names(model.head)
    if seed is not None:
        torch.manual_seed(seed)
    model.head.to_empty(device="cpu")
    model.head.reset_parameters()
    return {"head_meta_after_wrap": left_on_meta}


def ignored_module_on_meta(which):
    model_holder: dict = {}

    def build():
        model_holder["model"] = Net()
        return model_holder["model"]

    return _initial_state(which, build, ModuleWrapPolicy({Block}), None,
                          after_wrap=_init_ignored_head,
                          ignored_modules=_LazyIgnored(model_holder, "head"))


class _LazyIgnored:
    """`ignored_modules` naming a module of the model built inside `_initial_state`."""

    def __init__(self, holder: dict, name: str):
        self.holder, self.name = holder, name

    def __iter__(self):
        return iter([self.holder["model"].get_submodule(self.name)])


def _to_empty_on_cpu(module):
    module.to_empty(device="cpu", recurse=False)


def _low_cpu(which, ignore_head: bool):
    """The low-CPU recipe: rank 0 builds the real model (its own seed), the other ranks on
    meta with `param_init_fn` giving storage only; sync_module_states broadcasts rank 0's.
    Native FSDP1 refuses sync_module_states on the CPU: its side is what the broadcast gives,
    rank 0's real model wrapped on every rank."""
    rank = dist.get_rank() if which == "ours" else 0
    holder: dict = {}

    def build():
        torch.manual_seed(100 + rank)  # rank 0's values must reach every rank
        holder["model"] = Net()
        if rank == 0:  # a real Block's buffers are filled by its reset_parameters alone
            for block in holder["model"].blocks:
                block.reset_parameters()
        return holder["model"]

    extra = {"ignored_modules": _LazyIgnored(holder, "head")} if ignore_head else {}
    if which == "ours":
        extra["sync_module_states"] = True
    after_wrap = (lambda model: _init_ignored_head(model, seed=1)) if ignore_head else None
    return _initial_state(which, build, ModuleWrapPolicy({Block}),
                          None if rank == 0 else _to_empty_on_cpu, on_meta=rank != 0,
                          after_wrap=after_wrap, **extra)


def low_cpu_sync(which):
    return _low_cpu(which, ignore_head=False)


def low_cpu_sync_ignored(which):
    return _low_cpu(which, ignore_head=True)


def sync_ignored_buffer(which):
    """Real on every rank, values by rank, the head ignored and given a buffer: under
    sync_module_states FSDP1 broadcasts rank 0's buffers of ignored modules too, not their
    parameters. (Native FSDP1 refuses sync_module_states on the CPU: ours alone.)"""
    if which == "native":
        return {}
    torch.manual_seed(100 + dist.get_rank())
    model = Net()
    model.head.register_buffer("stat", torch.full((2,), float(dist.get_rank())))
    _fsdp(which)(model, auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"),
                 use_orig_params=True, sync_module_states=True, ignored_modules=[model.head])
    return {"stat": model.head.stat.clone(), "weight": model.head.weight.detach().clone()}


class TiedNet(Net):
    """`embed` (root unit) shares its weight with the second block's `out` (a unit of its
    own), tied on meta before the wrap."""

    def __init__(self):
        super().__init__()
        self.blocks[1].out.weight = self.embed.weight


def tied_across_units(which):
    return _initial_state(which, TiedNet, ModuleWrapPolicy({Block}), None)


def gpt2_param_init_fn(which):
    """GPT-2's input and output embeddings are tied: materialising unties them, natively too."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from tests import models as M

    return _hf_param_init_fn(which, M.tiny_gpt2, GPT2Block)


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
        ("ignored_module_on_meta", ignored_module_on_meta),
        ("low_cpu_sync", low_cpu_sync),
        ("low_cpu_sync_ignored", low_cpu_sync_ignored),
        ("tied_across_units", tied_across_units),
        ("sync_ignored_buffer", sync_ignored_buffer),
        ("gpt2_param_init_fn", gpt2_param_init_fn),
    ]}


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
