"""FSDP2's `fully_shard` arguments -> Plan. `check_call` validates one call without processes;
`build_plan` turns the recorded calls of one model (post-order, root last) into a Plan and the
engine's groups (resolved from the mesh by `fsdp_bridge.topology`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from fsdp_bridge.plan import MixedPrecision, ParamLayout, Plan, ShardingMode, UnitSpec
from fsdp_bridge.topology import resolve_topology
from fsdp_bridge.translation import (
    ArgumentTable,
    bad_argument,
    ignored,
    register_table,
    rejected,
    translated,
    truth_of,
)

FRONTEND = "fully_shard"

SCHEDULING_HINTS = ("set_reshard_after_forward / set_reshard_after_backward / "
                    "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch / "
                    "set_is_last_backward / set_unshard_in_backward")
COMM_TUNING = ("set_reduce_scatter_max_input_buffers / set_separate_reduce_scatter_group / "
               "set_allocate_memory_from_process_group_for_comm / set_symm_mem_for_comm")

TABLE = register_table(
    ArgumentTable(
        FRONTEND,
        (
            translated("module", "one module -> one unit (the first module used is the root); a "
                       "list -> one group: its modules' parameters join the enclosing unit "
                       "(tied weights stay together)"),
            translated("mesh", "None -> all ranks (mode shard); 1-D -> the shard group; 2-D -> "
                       "mode hybrid (dim 0 replicate, dim 1 shard; named dimensions, as FSDP2 "
                       "requires)"),
            translated("reshard_after_forward", "None -> True except the root (FSDP1 "
                       "FULL_SHARD); True / False -> UnitSpec.reshard_after_forward (a root "
                       "given True or an int reshards too, as FSDP2); int: 1 -> False, the "
                       "shard size -> True"),
            ignored("reshard_after_forward=<int>", "hpZ (resharding to a smaller group after "
                    "forward) is a memory / communication trade-off; units reshard fully, "
                    "numerics are identical"),
            translated("mp_policy", "each call's unit gathers in its param_dtype, reduces in "
                       "its reduce_dtype (None -> param_dtype, as FSDP2), casts its floating "
                       "inputs (cast_forward_inputs; inside tuples, lists, dicts, namedtuples and "
                       "dataclasses) and its outputs (output_dtype); calls may differ"),
            rejected("mp_policy of a list call differing from its enclosing unit's",
                     "a list call's modules are gathered with the unit that encloses them, in "
                     "its param_dtype and reduce_dtype: refused at the first forward"),
            translated("offload_policy", "CPUOffloadPolicy -> Plan.cpu_offload (on a CPU "
                       "device nothing moves; on an accelerator offload is not implemented yet "
                       "for fully_shard's DTensor parameters and the engine warns by name); "
                       "OffloadPolicy() / None -> no offload"),
            translated("ignored_params", "Plan.ignored_params: neither sharded nor reduced "
                       "(parameters outside the call's modules are accepted and change nothing, "
                       "as in FSDP2)"),
            translated("shard_placement_fn", "None, or a function returning None (Shard(0)) or "
                       "Shard(d) per parameter: its DTensor is split on dim d; a unit's "
                       "parameters are still gathered as one buffer"),
            translated("shard_placement_fn -> ShardPlacementResult", "(torch >= 2.12) a "
                       "parameter whose result names another mesh (FSDPMeshInfo over a 1-D "
                       "mesh, HSDPMeshInfo over a 2-D one: expert parallelism's "
                       "expert-data-parallel mesh) joins a flat group of its unit sharded over "
                       "that mesh: gathered, reduced and averaged over its own groups, a "
                       "DTensor on that mesh (with the expert-parallel mesh for DTensor "
                       "parameters), as FSDP2's parameter groups"),
            translated("shard_placement_fn -> ShardPlacementResult over an SPMD mesh info",
                       "(dp_mesh_dims set on the mesh info) the parameter, a DTensor on the "
                       "info's SPMD mesh, is split over the info's data-parallel mesh as "
                       "dp_mesh_dims splits it, in a flat group of its own (torchtitan's SPMD "
                       "MoE: experts on a sparse mesh)"),
            rejected("shard_placement_fn=<other placements>", "refused at fully_shard time: "
                     "only Shard(d) placements split a parameter over the shard group; a "
                     "ShardPlacementResult over a mesh of another shape than 1-D or 2-D "
                     "(replicate, shard) is refused with NotImplementedError; with "
                     "dp_mesh_dims naming no shard dimension any shard_placement_fn is "
                     "refused with FSDP2's ValueError"),
            translated("tensor-parallel (DTensor) parameters", "a parameter parallelize_module "
                       "made a DTensor on a 1-D tensor-parallel mesh is split further over the "
                       "data-parallel mesh's shard dimension (1-D: FSDP; 2-D: HSDP, all-reduced "
                       "over the replicas): a DTensor on all of them (FSDP2's placements, "
                       "_StridedShard included), gathered back into the tensor-parallel DTensor "
                       "for compute (an all-gather extension's pre-hook handed the shard "
                       "dimension's 1-D mesh, as FSDP2); Partial placements and a "
                       "tensor-parallel mesh of several dimensions are refused by name"),
            translated("dp_mesh_dims", "(torch >= 2.12) the SPMD mesh's named shard dimensions "
                       "(flattened into one when several, as FSDP2) and replicate ones (HSDP; "
                       "alone: DDP, mode replicate, gradients all-reduced) are the "
                       "data-parallel mesh; each parameter, a DTensor on the SPMD mesh "
                       "(Replicate on those dimensions), is split on the shard dimension with "
                       "FSDP2's placements (on FSDP2's mesh with the flattened dimension when "
                       "several are named) and computes as the DTensor it was; other "
                       "dimensions (tensor parallelism) stay as they are"),
            translated("set_requires_gradient_sync", "the gradient sync flag of this module's "
                       "unit (and of the units below it, with recurse)"),
            translated("set_requires_all_reduce", "HSDP: False sums this module's unit's "
                       "reduce-scattered gradients aside, in the reduce dtype, without the "
                       "replicas' all-reduce, until a backward with True (and below it, with "
                       "recurse)"),
            translated("set_gradient_divide_factor", "the divisor of this module's unit (per "
                       "module, as FSDP2; a module of a list call shares its enclosing unit's)"),
            translated("set_force_sum_reduction_for_comms", "accepted: the engine always "
                       "reduces with SUM and divides once afterwards (FSDP2's numbers with the "
                       "flag set)"),
            translated("unshard / reshard", "gather a unit now (async_op returns a handle); "
                       "its modules then hold the unsharded parameters (compute dtype) until "
                       "reshard(), the next forward or the end of backward / drop the "
                       "gathered copy"),
            translated("set_reshard_after_forward (before the first forward)", "as "
                       "reshard_after_forward given to fully_shard for the module (and those "
                       "below it, with recurse)"),
            ignored(SCHEDULING_HINTS, "memory and scheduling hints: the engine's buffers, "
                    "reshards and prefetch order are fixed when it is built (at the first "
                    "forward); numerics are identical. A call that asks for something else "
                    "warns by name"),
            ignored(COMM_TUNING, "tuning of FSDP2's own communication buffers, streams and "
                    "allocators: the engine runs its own collectives; numerics are identical"),
            translated("set_reduce_scatter_unused_params", "True: parameters no backward reached "
                       "get a zero gradient in the units of this module (and below, with "
                       "recurse); False (the default): their .grad stays None"),
            translated("set_post_optim_event", "accepted: the engine's gathers are issued "
                       "after the optimizer's work on its stream, which is what the event "
                       "orders"),
            translated("fully_shard.state(module)", "the call's record (modules, mesh, "
                       "policies) or None; FSDP2's private FSDPState members do not exist, so "
                       "code reading them (torch.distributed.pipelining's FSDP path) fails"),
            translated("torch's register_fsdp_forward_method(module, name)", "works on our "
                       "modules (HF Trainer calls it for generate): `_get_fsdp_state()` gives "
                       "the _pre_forward/_post_forward it calls, which gather and release the "
                       "module's unit; any other FSDPState member is refused by name"),
            translated("fully_shard(wrapper) around a module already fully_shard-ed",
                       "accepted as FSDP2 (accelerate shards a layer, then the "
                       "CheckpointWrapper around it): the wrapper's unit holds no parameters "
                       "of its own"),
            translated("a CPU-built model on an accelerator mesh", "its shards move to the "
                       "mesh's current device at fully_shard time, as FSDP2 (not under "
                       "CPUOffloadPolicy)"),
            translated("set_all_reduce_hook", "the hook runs on each reduced gradient shard of "
                       "the module's unit (FSDP2's layout: each parameter's chunk, padded), "
                       "averaged as FSDP2 averages it, before it joins the gradient"),
            translated("set_all_reduce_hook(stream=...)", "the hook runs inside that stream "
                       "(which first waits for the reduction; the current stream then waits "
                       "for the hook), as FSDP2; refused with FSDP2's ValueError under HSDP"),
            translated("set_custom_all_gather / set_custom_reduce_scatter", "the module's "
                       "unit gathers / reduces through the given object (allocate and call, "
                       "synchronously, over the shard group); the reduce-scatter is asked for "
                       "a SUM and the engine divides afterwards"),
        ),
    )
)


class AssertedByFsdp2(ValueError, AssertionError):
    """A refusal FSDP2 makes with an AssertionError (a `shard_placement_fn` placement on a dim
    the parameter does not have, a 2-D mesh without dimension names): a ValueError like our
    other refusals, and the AssertionError FSDP2 raises there, so code catching either finds
    it."""


def bad(name, value, accepted, fix, exc=ValueError):
    return bad_argument(FRONTEND, name, value, accepted, fix, exc)


def check_comm(method: str, comm) -> None:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise bad_argument(f"FSDPModule.{method}", "comm", comm, "a torch.distributed.fsdp "
                           "AllGather / ReduceScatter (an object with allocate(size, dtype=, "
                           "device=) and a call)", "Subclass torch.distributed.fsdp."
                           "_fully_shard._fsdp_api.AllGather or ReduceScatter.", exc=TypeError)


def check_bool(method: str, name: str, value) -> None:
    """A flag FSDP2 checks is a bool (`set_reshard_after_forward`): anything else is refused
    with FSDP2's exception type."""
    if not isinstance(value, bool):
        raise bad_argument(f"FSDPModule.{method}", name, value, "True or False (a bool)",
                           f"Pass {name}=True or {name}=False.")


def flag(method: str, name: str, value) -> bool:
    """A flag FSDP2 reads by its truth value (`set_requires_gradient_sync(1)` works there):
    its truth value, a string refused (see translation.truth_of)."""
    return truth_of(f"FSDPModule.{method}", name, value)


def ignored_hint(method: str, value, when: str = "") -> None:
    """Warn that a scheduling hint (SCHEDULING_HINTS) is not followed: the engine's gathers,
    reshards and prefetches are fixed when it is built, with the same numbers."""
    TABLE.warn_ignored(SCHEDULING_HINTS, f"{method}({value!r}){' ' + when if when else ''}")


def accepted_no_op(method: str, value, default) -> None:
    if value != default:
        key = COMM_TUNING if method in COMM_TUNING.split(" / ") else SCHEDULING_HINTS
        TABLE.warn_ignored(key, f"{method}({value!r})")


def check_fsdp_modules(method: str, modules, fsdp_module_cls) -> None:
    if not isinstance(modules, (list, tuple)) or not all(
        isinstance(m, fsdp_module_cls) for m in modules
    ):
        raise bad_argument(f"FSDPModule.{method}", "modules", modules, "a list of FSDPModule "
                           "(modules passed to fully_shard)", "Pass the fully_shard-ed "
                           "modules.", exc=TypeError)


def check_factor(factor) -> None:
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise bad_argument("FSDPModule.set_gradient_divide_factor", "factor", factor,
                           "a positive number", "e.g. set_gradient_divide_factor(world_size).")


def check_call(module, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
               offload_policy, ignored_params, dp_mesh_dims) -> list[nn.Module]:
    """Validate one fully_shard call; returns its modules."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise bad("module", module, "an nn.Module or a non-empty list of them", "Pass the "
                  "module(s) to shard.", exc=TypeError)
    for index, m in enumerate(modules):
        name = "module" if len(modules) == 1 and not isinstance(module, (list, tuple)) \
            else f"module[{index}]"
        if not isinstance(m, nn.Module):
            raise bad(name, m, "an nn.Module", "Pass the module itself.", exc=TypeError)
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)):
            raise bad(name, m, "a module that implements forward (fully_shard does not "
                      "support containers that do not implement forward, FSDP2's words: "
                      "a ModuleList or ModuleDict)", "Call fully_shard on each layer in the "
                      "container instead.")
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise bad("mesh", mesh, "None or a DeviceMesh", "Build one with "
                      "torch.distributed.device_mesh.init_device_mesh.", exc=TypeError)
        if mesh.ndim not in (1, 2) and dp_mesh_dims is None:
            raise bad("mesh", mesh, "a 1-D mesh (FSDP) or a 2-D mesh (HSDP: replicate, shard)",
                      f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} (FSDP2's "
                      "words): slice the data-parallel dimensions out of the mesh first, or "
                      "name them with dp_mesh_dims.")
        if mesh.ndim == 2 and mesh.mesh_dim_names is None and dp_mesh_dims is None:
            raise bad("mesh", mesh, "a 2-D mesh (HSDP: replicate, shard) with named "
                      "dimensions", "Please init the 2D mesh for HSDP with mesh_dim_names "
                      "specified (FSDP2's words): init_device_mesh(..., mesh_dim_names="
                      "('replicate', 'shard')).", exc=AssertedByFsdp2)
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise bad("reshard_after_forward", reshard_after_forward, "None, True, False or an int "
                  "dividing the shard-group size", "e.g. reshard_after_forward=True.",
                  exc=TypeError)
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        _check_reshard_int(reshard_after_forward, mesh, dp_mesh_dims)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise bad("mp_policy", mp_policy, "a torch.distributed.fsdp.MixedPrecisionPolicy",
                  "e.g. mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16).",
                  exc=TypeError)
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        value = getattr(mp_policy, field)
        if value is not None and (not isinstance(value, torch.dtype)
                                  or not value.is_floating_point):
            raise bad(f"mp_policy.{field}", value, "None or a floating torch.dtype",
                      f"e.g. {field}=torch.bfloat16.")
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        raise bad("offload_policy", offload_policy, "OffloadPolicy(), CPUOffloadPolicy(...) "
                  "or None", "e.g. offload_policy=CPUOffloadPolicy(pin_memory=False).",
                  exc=TypeError)
    if ignored_params is not None:
        if not isinstance(ignored_params, (set, frozenset, list, tuple)) or not all(
            isinstance(p, nn.Parameter) for p in ignored_params
        ):
            raise bad("ignored_params", ignored_params, "None or a set of nn.Parameter",
                      "e.g. ignored_params={model.embed.weight}.", exc=TypeError)
    if dp_mesh_dims is not None:
        check_dp_mesh_dims(mesh, dp_mesh_dims)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise bad("shard_placement_fn", shard_placement_fn, "None or a callable",
                  "Drop it to shard on dim 0.", exc=TypeError)
    if shard_placement_fn is not None and dp_mesh_dims is not None \
            and not dp_mesh_dims.shard_names:
        raise bad("shard_placement_fn", shard_placement_fn, "None when dp_mesh_dims names no "
                  "shard dimension (replication alone: nothing is sharded)", "Per-param mesh "
                  "via shard_placement_fn is not supported with DDPMeshInfo; it requires "
                  "FSDPMeshInfo (or subclass) (FSDP2's words): drop shard_placement_fn, or "
                  "name a shard dimension in dp_mesh_dims.")
    return modules


def _check_reshard_int(reshard_after_forward: int, mesh, dp_mesh_dims) -> None:
    """An int `reshard_after_forward` (hpZ) as FSDP2 takes it: refused with an SPMD mesh that
    names a shard dimension, else a divisor of the shard-group size."""
    if getattr(dp_mesh_dims, "shard_names", None):
        raise bad("reshard_after_forward", reshard_after_forward, "None, True or False when "
                  "dp_mesh_dims names a shard dimension", "reshard_after_forward as int is not "
                  "yet supported with SPMD mesh (dp_mesh_dims) (FSDP2's words): pass True or "
                  "False.", exc=NotImplementedError)
    if dp_mesh_dims is not None:
        return
    shard_size = mesh.size(mesh.ndim - 1) if mesh is not None else _world()
    if reshard_after_forward < 1 or shard_size % reshard_after_forward:
        raise bad("reshard_after_forward", reshard_after_forward, f"an int >= 1 dividing "
                  f"the shard-group size {shard_size}", "e.g. reshard_after_forward=True, "
                  "or a divisor of the shard-group size.")


def check_dp_mesh_dims(mesh, dp_mesh_dims) -> None:
    """FSDP2's checks of `dp_mesh_dims` (torch >= 2.12): names of the mesh's dimensions,
    several shard names being consecutive dimensions in the mesh's order (FSDP2 puts their
    flattening in their place)."""
    shard = getattr(dp_mesh_dims, "shard_names", None)
    replicate = getattr(dp_mesh_dims, "replicate_names", None)
    if shard is None or replicate is None:
        raise bad("dp_mesh_dims", dp_mesh_dims, "None or a torch.distributed.fsdp."
                  "DataParallelMeshDims", "e.g. dp_mesh_dims=DataParallelMeshDims(shard='dp').",
                  exc=TypeError)
    if mesh is None or mesh.mesh_dim_names is None:
        raise bad("mesh", mesh, "a DeviceMesh with mesh_dim_names when dp_mesh_dims is given "
                  "(FSDP2: mesh must have mesh_dim_names when dp_mesh_dims is provided)",
                  "Build it with init_device_mesh(..., mesh_dim_names=(...)).")
    names = mesh.mesh_dim_names
    for name in (*shard, *replicate):
        if name not in names:
            raise bad("dp_mesh_dims", dp_mesh_dims, f"names of the mesh's dimensions "
                      f"{names}", f"Mesh dim name '{name}' not found in "
                      f"mesh.mesh_dim_names {names} (FSDP2's words).")
    indices = [names.index(name) for name in shard]
    if len(indices) > 1 and indices != list(range(indices[0], indices[0] + len(indices))):
        raise bad("dp_mesh_dims", dp_mesh_dims, f"shard names of consecutive dimensions of "
                  f"the mesh {names}, in its order (FSDP2 flattens them into one dimension "
                  "in their place)", "Order the mesh's dimensions so that the shard "
                  "dimensions are neighbours, e.g. ('dp_shard', 'cp', 'tp').")


def dp_mesh_of(mesh, dp_mesh_dims):
    """The data-parallel mesh `dp_mesh_dims` names in the SPMD `mesh` (checked by
    check_dp_mesh_dims), as FSDP2 builds it: the shard dimensions (flattened into one when
    several), after the replicate ones (flattened likewise) under HSDP; the replicate
    dimensions alone without a shard name (DDP)."""

    def joined(names: tuple):
        return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))

    shard, replicate = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    if not replicate:
        return joined(shard)
    if not shard:
        return joined(replicate)
    return DeviceMesh._concatenate([joined(replicate), joined(shard)])


def resolve_placement(shard_placement_fn, param: nn.Parameter):
    """(placement, mesh info) of `param`: what `shard_placement_fn` returns for it. None or a
    Shard places it on the call's mesh (mesh info None); a `ShardPlacementResult` (torch >=
    2.12) also names the mesh (an FSDPMeshInfo) it is sharded over."""
    result = shard_placement_fn(param) if shard_placement_fn is not None else None
    if type(result).__name__ == "ShardPlacementResult":
        return result.placement, result.mesh_info
    return result, None


def mesh_of_info(mesh_info, shard_placement_fn, name: str):
    """The data-parallel DeviceMesh of a `ShardPlacementResult`'s mesh info, as the engine
    shards over it: a 1-D mesh (FSDPMeshInfo, shard_mesh_dim=0) or a 2-D one (HSDPMeshInfo,
    replicate_mesh_dim=0, shard_mesh_dim=1)."""
    mesh = getattr(mesh_info, "mesh", None)
    shard, replicate = (getattr(mesh_info, "shard_mesh_dim", None),
                        getattr(mesh_info, "replicate_mesh_dim", None))
    if not isinstance(mesh, DeviceMesh) or shard is None:
        raise bad("shard_placement_fn", shard_placement_fn, "a function returning None, "
                  "Shard(d), or a ShardPlacementResult whose mesh_info is an FSDPMeshInfo or "
                  f"HSDPMeshInfo (it returned mesh_info={mesh_info!r} for {name!r})",
                  "Build it as FSDPMeshInfo(mesh=..., shard_mesh_dim=0).")
    if (mesh.ndim, replicate, shard) not in ((1, None, 0), (2, 0, 1)):
        raise bad("shard_placement_fn", shard_placement_fn, "a ShardPlacementResult whose "
                  "mesh_info is FSDPMeshInfo(1-D mesh, shard_mesh_dim=0) or HSDPMeshInfo(2-D "
                  "mesh, replicate_mesh_dim=0, shard_mesh_dim=1) (it returned a "
                  f"{mesh.ndim}-D mesh with shard_mesh_dim={shard}, replicate_mesh_dim="
                  f"{replicate} for {name!r})", "fsdp_bridge shards over a 1-D mesh, or a 2-D "
                  "(replicate, shard) one: slice the data-parallel dimensions out of the mesh "
                  "first.", exc=NotImplementedError)
    return mesh


def spmd_of_info(mesh_info, param: nn.Parameter):
    """(SPMD mesh, dp_mesh_dims) of a parameter whose `ShardPlacementResult` names an SPMD
    mesh info (one built with dp_mesh_dims, torch >= 2.12), None for another mesh info. As
    FSDP2, the SPMD mesh is the parameter's own DTensor mesh, which must be the info's
    `spmd_mesh` when that is set (a parameter that is no DTensor is refused where it is
    sharded)."""
    if not getattr(mesh_info, "is_spmd_mesh", False):
        return None
    spmd_mesh = getattr(mesh_info, "spmd_mesh", None)
    if spmd_mesh is None:
        spmd_mesh = getattr(param, "device_mesh", None)
    if isinstance(spmd_mesh, DeviceMesh):
        check_dp_mesh_dims(spmd_mesh, mesh_info.dp_mesh_dims)
    return spmd_mesh, mesh_info.dp_mesh_dims


def groups_of(mesh: DeviceMesh) -> tuple:
    """(shard group, replicate group or None) of a 1-D or 2-D (replicate, shard) mesh: what
    FSDP2 tells parameter groups apart by."""
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    return mesh.get_group(mesh.ndim - 1), mesh.get_group(0)


def shard_dim(shard_placement_fn, placement, param: nn.Parameter, name: str, shape: tuple,
              ranks: int) -> int:
    """The dim `param` is split on over a shard group of `ranks`: `placement` (what
    `shard_placement_fn` returned for it: a Shard, or None for dim 0), checked against `shape`,
    the shape the group splits (under tensor parallelism: this rank's local part)."""
    from torch.distributed.tensor import Shard

    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise bad("shard_placement_fn", shard_placement_fn, f"a function returning None or "
                  f"Shard(d) with d a dim of the parameter (it returned {placement!r} for "
                  f"{name!r}, of shape {tuple(param.shape)})", "Return Shard(d) for a dim d "
                  "of each parameter, or None for Shard(0).")
    if not -len(shape) <= placement.dim < len(shape):
        # FSDP2 asserts here: the error is both, so code catching either kind finds it.
        raise bad("shard_placement_fn", shard_placement_fn, f"a function returning None or "
                  f"Shard(d) with d a dim of the parameter (it returned {placement!r} for "
                  f"{name!r}, of shape {tuple(param.shape)})", f"Shard dim {placement.dim} is "
                  f"invalid for {len(shape)}D tensor (FSDP2's words): return Shard(d) for a "
                  "dim d of each parameter, or None for Shard(0).", exc=AssertedByFsdp2)
    dim = placement.dim % len(shape)
    if dim > 0 and shape[dim] % ranks:
        raise bad("shard_placement_fn", shard_placement_fn, f"Shard(d) on a dim whose size "
                  f"divides the shard-group size {ranks} when d > 0, as FSDP2 requires (it "
                  f"returned {placement!r} for {name!r}, of shape {tuple(shape)})",
                  f"FSDP does not support uneven sharding on dim {dim} (FSDP2's words): split "
                  "that parameter on dim 0, or on a dim whose size is a multiple of the shard "
                  "group.", exc=NotImplementedError)
    return dim


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def _reshard(value, is_root: bool, shard_size: int) -> tuple[bool, tuple]:
    if value is None:
        return not is_root, ()
    if isinstance(value, bool):
        return value, ()
    if value == 1:
        return False, ()
    if value == shard_size:
        return True, ()
    return True, (TABLE.warn_ignored("reshard_after_forward=<int>", value),)


def _precision(policy: MixedPrecisionPolicy) -> MixedPrecision:
    """One fully_shard call's policy as the engine's precision of its unit. Its output_dtype
    is applied by a hook fully_shard registers (see _cast_like_fsdp2), not by the engine."""
    param = policy.param_dtype
    return MixedPrecision(
        param_dtype=param,
        reduce_dtype=policy.reduce_dtype or param,  # FSDP2: None -> param_dtype
        cast_forward_inputs=policy.cast_forward_inputs,
        cast_root_forward_inputs=policy.cast_forward_inputs,
    )


def _check_list_call_precision(path: str, call, enclosing_path: str, enclosing) -> None:
    """A list call's modules join the enclosing unit's flat groups, so they gather and reduce
    in that unit's dtypes: their policy must agree on those."""
    for field in ("param_dtype", "reduce_dtype"):
        mine, theirs = getattr(call.mp_policy, field), getattr(enclosing.mp_policy, field)
        if mine != theirs:
            raise bad(f"mp_policy.{field} (of the list call at {path!r})", mine,
                      f"the value of the enclosing fully_shard call at {enclosing_path!r}: "
                      f"{theirs!r} (a list call's modules are gathered with that unit)",
                      "Give the list call the same param_dtype and reduce_dtype as the module "
                      "that encloses it, or fully_shard its modules one by one.")


def _enclosing_call(path: str, calls):
    """(path, call) of the innermost single-module call that encloses module `path`."""
    single = [(p, c) for p, c in calls if len(c.modules) == 1 or p == ""]
    enclosing = [(p, c) for p, c in single if p == "" or path.startswith(p + ".")]
    return max(enclosing, key=lambda pc: len(pc[0]))


def build_plan(root: nn.Module, calls: list[tuple[str, Any]]):
    """`calls`: (path, FullyShardCall) of every fully_shard-ed module under `root`, post-order,
    root ("") last. Returns the plan and the groups it is sharded over."""
    assert calls and calls[-1][0] == ""
    root_mesh, replicates = calls[-1][1].mesh, calls[-1][1].replicates_only
    for path, call in calls:
        if (call.mesh is not root_mesh and call.mesh != root_mesh) \
                or call.replicates_only != replicates:
            raise bad(f"mesh (of {path!r})", call.mesh, f"the root's mesh {root_mesh!r}"
                      f"{' (replicated: dp_mesh_dims without a shard name)' * replicates}",
                      "Pass the same mesh (and dp_mesh_dims) to every fully_shard call.")
    # A 2-D mesh is FSDP2's HSDP: its mode comes from the mesh, not from an argument; a
    # mesh of replicate dimensions alone (dp_mesh_dims without a shard name) is DDP.
    hybrid = root_mesh is not None and root_mesh.ndim == 2
    mode = ShardingMode.REPLICATE if replicates else ShardingMode.HYBRID if hybrid \
        else ShardingMode.SHARD
    topology = resolve_topology(mode, device_mesh=root_mesh, frontend=FRONTEND)
    shard_size = 1 if replicates else root_mesh.size(root_mesh.ndim - 1) \
        if root_mesh is not None else _world()
    notes: tuple = ()
    units = []
    for path, call in calls:
        if len(call.modules) > 1 and path != "":  # a list call: joined to the enclosing unit
            enclosing_path, enclosing = _enclosing_call(path, calls)
            _check_list_call_precision(path, call, enclosing_path, enclosing)
            continue
        reshard, more = _reshard(call.reshard_after_forward, path == "", shard_size)
        notes += more
        # FSDP2 keeps only a root left at the default (None) gathered after forward.
        explicit = path == "" and call.reshard_after_forward is not None
        units.append(UnitSpec(path, reshard, _precision(call.mp_policy), reshard_as_root=explicit))
    offload = any(isinstance(call.offload_policy, CPUOffloadPolicy) for _, call in calls)
    names = {id(p): n for n, p in root.named_parameters(remove_duplicate=False)}
    ignored_names = sorted({names[id(p)] for _, call in calls for p in call.ignored_params
                            if id(p) in names})
    plan = Plan(
        units=tuple(units),
        mode=mode,
        mixed_precision=_precision(calls[-1][1].mp_policy),
        ignored_params=tuple(ignored_names),
        cpu_offload=offload,
        param_layout=ParamLayout.ROWS,
        unused_grad_is_none=True,
        post_accumulate_grad_hooks=True,
        frontend=FRONTEND,
        notes=notes,
    )
    return plan, topology
