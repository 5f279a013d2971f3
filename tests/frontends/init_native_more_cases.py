"""More initialisation from meta against native FSDP1 in one CPU/gloo world of two ranks (see
test_init_native_more.py): ignored modules and parameters inside auto-wrapped units, other wrap
policies, hand-nested wrappers, `use_orig_params=False`, modules with buffers only, and the
Zeta and YaFSDP front-ends on a meta model."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from tests.frontends import init_native_cases as C
from tests.world import run_case_table

CPU = torch.device("cpu")


class _Lazy:
    """`ignored_modules` / `ignored_states` naming modules or parameters of the model built
    inside `C._initial_state`."""

    def __init__(self, holder: dict, names: list[str], kind: str = "module"):
        self.holder, self.names, self.kind = holder, names, kind

    def __iter__(self):
        model = self.holder["model"]
        get = model.get_submodule if self.kind == "module" else model.get_parameter
        return iter([get(name) for name in self.names])


def _held(build):
    holder: dict = {}

    def build_and_hold():
        holder["model"] = build()
        return holder["model"]
    return holder, build_and_hold


def _meta_after_wrap(model) -> dict:
    return {"meta_after_wrap": C._meta_names(model)}


def _ignored_after_wrap(names: list[str]):
    """What is left on meta, and the shape each of the `names` (parameters) has on this rank
    after the wrap: whole when left alone, a 1-D piece when sharded."""
    def after_wrap(model) -> dict:
        shapes = {name: tuple(model.get_parameter(name).shape) for name in names}
        return {**_meta_after_wrap(model), "shapes": shapes}
    return after_wrap


def ignored_module_inside_unit(which):
    """An ignored module inside an auto-wrapped unit: FSDP1 gives the units its policy makes
    the ignored parameters only, so the unit materialises and initialises the module with its
    own, in breadth-first order; the new parameters are then sharded (FSDP1 knows ignored
    parameters by identity)."""
    holder, build = _held(C.Net)
    return C._initial_state(which, build, ModuleWrapPolicy({C.Block}), None,
                            after_wrap=_ignored_after_wrap(["blocks.0.out.weight"]),
                            ignored_modules=_Lazy(holder, ["blocks.0.out"]))


def ignored_states_module_inside_unit(which):
    """The same through `ignored_states`, with a `param_init_fn` (called on the ignored module
    too, natively)."""
    holder, build = _held(C.Net)
    calls: list = []
    out = C._initial_state(which, build, ModuleWrapPolicy({C.Block}), C._recording_init(calls),
                           after_wrap=_ignored_after_wrap(["blocks.0.inner.1.weight"]),
                           ignored_states=_Lazy(holder, ["blocks.0.inner"]))
    return {**out, "calls": calls}


def _meta_then_init_head(model) -> dict:
    """What is left on meta, then the user's own initialisation of the ignored head."""
    left = _meta_after_wrap(model)
    C._init_ignored_head(model)
    return left


def ignored_module_in_root_and_unit(which):
    """One ignored module in the root's own modules (left on meta) and one inside a unit
    (materialised)."""
    holder, build = _held(C.Net)
    return C._initial_state(which, build, ModuleWrapPolicy({C.Block}), None,
                            after_wrap=_meta_then_init_head,
                            ignored_modules=_Lazy(holder, ["head", "blocks.1.inner.0"]))


def ignored_parameters_on_meta(which):
    """Ignored parameters (not modules) on meta, one in the root's modules, one in a unit:
    both materialised with their module, and then sharded, as natively."""
    holder, build = _held(C.Net)
    names = ["head.weight", "blocks.1.out.weight"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = C._initial_state(which, build, ModuleWrapPolicy({C.Block}), None,
                               after_wrap=_ignored_after_wrap(names),
                               ignored_states=_Lazy(holder, names, kind="parameter"))
    return {**out, "warnings": [str(w.message) for w in caught]}


def _to_empty_whole_module(module):
    """A common `param_init_fn` mistake: `to_empty` with its default recurse=True."""
    module.to_empty(device="cpu")
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def param_init_fn_reaching_an_ignored_module(which):
    """One unit (no policy), the head ignored, and a `param_init_fn` that materialises whole
    containers: called on the root, it reaches the head too. Natively the head's parameters
    are then new, so sharded; ours keeps them ignored and says so. (Values are uninitialised
    memory on both sides: not compared.)"""
    holder, build = _held(C.Net)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = C._initial_state(which, build, None, _to_empty_whole_module,
                               after_wrap=_ignored_after_wrap(["head.weight"]),
                               ignored_modules=_Lazy(holder, ["head"]))
    return {"shapes": out["shapes"], "warnings": [str(w.message) for w in caught]}


def _real_with_meta_head_weight():
    model = C.Net()
    for block in model.blocks:
        block.reset_parameters()
    model.head.weight = nn.Parameter(torch.empty(4, 4, device="meta"))
    return model


def only_an_ignored_parameter_on_meta(which):
    """A real model whose one meta parameter is ignored: nothing to materialise (FSDP1 tests
    the parameters it manages), so it stays on meta and no reset_parameters runs."""
    holder, build = _held(_real_with_meta_head_weight)
    out = C._initial_state(which, build, ModuleWrapPolicy({C.Block}), None, on_meta=False,
                           after_wrap=_ignored_after_wrap(["head.weight"]),
                           ignored_states=_Lazy(holder, ["head.weight"], kind="parameter"))
    out["params"].pop("head.weight")  # on meta: no values to compare
    return out


def low_cpu_sync_ignored_inside_unit(which):
    """The low-CPU recipe (rank 0 real, meta elsewhere with a `param_init_fn` giving storage
    only, `sync_module_states`) with an ignored module inside a unit: on rank 0 it stays
    ignored, on the meta ranks it is materialised and so sharded (as natively, see
    `ignored_module_inside_unit`); the ranks' units differ (natively the broadcast then mixes
    up tensors), so every rank refuses. Ours alone: native FSDP1 refuses sync_module_states on
    the CPU."""
    import torch.distributed as dist

    if which == "native":
        return {}
    rank = dist.get_rank()

    def build():
        torch.manual_seed(100 + rank)
        return C.Net()

    holder, build_and_hold = _held(build)
    try:
        C._initial_state(which, build_and_hold, ModuleWrapPolicy({C.Block}),
                         None if rank == 0 else C._to_empty_on_cpu, on_meta=rank != 0,
                         ignored_modules=_Lazy(holder, ["blocks.0.out"]), sync_module_states=True)
    except ValueError as error:
        return {"raised": str(error)}
    return {"raised": None}


def nested_units_param_init_fn(which):
    """Units inside units (every Linear, and the Blocks around them): units are materialised
    in FSDP1's post-order, each breadth-first."""
    calls: list = []
    out = C._initial_state(which, C.Net, ModuleWrapPolicy({C.Block, nn.Linear}),
                           C._recording_init(calls))
    return {**out, "calls": calls}


def size_based_policy(which):
    return C._initial_state(which, C.Net, functools.partial(size_based_auto_wrap_policy,
                                                            min_num_params=30), None)


def original_params_false(which):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = C.Net()
    fsdp = C._fsdp(which)
    wrapped = fsdp(model, auto_wrap_policy=ModuleWrapPolicy({C.Block}), device_id=CPU,
                   use_orig_params=False)
    return _full_state(fsdp, wrapped)


def hand_nested(which):
    """Blocks wrapped by hand on meta, then the root: each wrapper materialises its own."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = C.Net()
    fsdp = C._fsdp(which)
    for index, block in enumerate(model.blocks):
        model.blocks[index] = fsdp(block, device_id=CPU, use_orig_params=True)
    return _full_state(fsdp, fsdp(model, device_id=CPU, use_orig_params=True))


class Stats(nn.Module):
    """Buffers only, persistent and not."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.empty(3))
        self.register_buffer("seen", torch.empty(()), persistent=False)

    def reset_parameters(self):
        nn.init.uniform_(self.mean)
        self.seen.fill_(2.0)


class WithStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.stats = Stats()


def buffers_only_module(which):
    return C._initial_state(which, WithStats, ModuleWrapPolicy({Stats}), None)


def param_init_fn_not_callable(which):
    try:
        C._initial_state(which, C.Net, None, 3)
    except Exception as error:  # noqa: BLE001 - the kind of error is the result
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None}


def _full_state(fsdp, wrapped) -> dict:
    with fsdp.summon_full_params(wrapped):
        params = {C._clean(n): p.detach().clone() for n, p in wrapped.named_parameters()}
    return {"params": params, "buffers": {C._clean(n): b.clone()
                                          for n, b in wrapped.named_buffers()}}


def _native_blocks(param_init_fn=None):
    return C._initial_state("native", C.Net, ModuleWrapPolicy({C.Block}), param_init_fn)


def zeta_on_meta(which):
    """Zeta's `fsdp()` calls FSDP1 with a transformer policy and no `param_init_fn`."""
    if which == "native":
        return _native_blocks()
    from fsdp_bridge.fsdp import FullyShardedDataParallel
    from fsdp_bridge.zeta import fsdp

    torch.manual_seed(0)
    with torch.device("meta"):
        model = C.Net()
    wrapped = fsdp(model, auto_wrap=True, TransformerBlock=C.Block, shard_strat="FULL_SHARD")
    return _full_state(FullyShardedDataParallel, wrapped)


def yafsdp_on_meta(which):
    """YaFSDP materialises each wrapped module with FSDP1's own helper, `param_init_fn` on
    every module breadth-first."""
    if which == "native":
        return _native_blocks(C._recording_init([]))
    from fsdp_bridge.fsdp import FullyShardedDataParallel
    from fsdp_bridge.ya_fsdp import YaFSDP

    torch.manual_seed(0)
    with torch.device("meta"):
        model = C.Net()
    wrapped = YaFSDP(model, zero_stage=3, device_id=CPU, param_init_fn=C._recording_init([]),
                     modules_to_wrap_with_names=[(block, f"blocks.{index}")
                                                 for index, block in enumerate(model.blocks)])
    return _full_state(FullyShardedDataParallel, wrapped)


def cases() -> dict:
    return {fn.__name__: C._both(fn) for fn in [
        ignored_module_inside_unit, ignored_states_module_inside_unit,
        ignored_module_in_root_and_unit, ignored_parameters_on_meta,
        only_an_ignored_parameter_on_meta, param_init_fn_reaching_an_ignored_module,
        low_cpu_sync_ignored_inside_unit,
        nested_units_param_init_fn, size_based_policy, original_params_false, hand_nested,
        buffers_only_module, param_init_fn_not_callable, zeta_on_meta, yafsdp_on_meta,
    ]}


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
