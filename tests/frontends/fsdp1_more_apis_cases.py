"""FSDP1 APIs beyond the everyday ones, run with `torch.distributed.fsdp` and `fsdp_bridge.fsdp`
in one spawned gloo world of two ranks (see test_fsdp1_more_apis.py): LOCAL_STATE_DICT round
trips, the legacy sharded optimizer state dicts, scattering a full optimizer state dict without
an optimizer, rank-0-only optimizer loads, and the wrapper's process group attributes.

Each checkpoint case trains 3 steps, saves, trains 2 more (the uninterrupted run), then builds a
fresh model, loads the checkpoint (of its own dialect, and of the other one where the format is
shared) and trains the same 2 steps. Both dialects are wrapped alike in each case. The
sharded optimizer case uses `use_orig_params=True`; the others `use_orig_params=False`, as
native FSDP1 needs: it cannot load its own LOCAL dict back with True (its load expects the
original parameters' keys), and with True its own full optimizer state dict did not resume bit
for bit here (torch 2.13, CPU), whichever dialect loaded it. Ours does not depend on the flag.
"""

from __future__ import annotations

import copy
import io
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import ShardingStrategy

from tests import models as M
from tests.frontends.method_cases import WHICH, _clone_tree, _train, fsdp1_wrap, full_state

SAVE_AT, STEPS = 3, 5


def _wrap(which, use_orig_params=True, **extra):
    fsdp, FSDP, w, _ = fsdp1_wrap(which, use_orig_params=use_orig_params, **extra)
    return fsdp, FSDP, w


def _first_run(which, rank, world, save, **wrap):
    """3 steps, `save(fsdp, FSDP, w, optimizer)` (the checkpoint), 2 more steps."""
    fsdp, FSDP, w = _wrap(which, **wrap)
    optimizer = M.make_adamw(w.parameters())
    _train(w, optimizer, rank, world, range(SAVE_AT))
    out = {"saved": save(fsdp, FSDP, w, optimizer), "model": full_state(fsdp, w)}
    out["losses_rest"] = _train(w, optimizer, rank, world, range(SAVE_AT, STEPS))
    out["state"] = full_state(fsdp, w)
    return out


def _resumed(which, rank, world, load, **wrap):
    """A fresh model; `load(fsdp, FSDP, w)` returns its optimizer (or the optimizer and what
    the load saw); the last 2 steps."""
    fsdp, FSDP, w = _wrap(which, **wrap)
    loaded = load(fsdp, FSDP, w)
    optimizer, seen = loaded if isinstance(loaded, tuple) else (loaded, {})
    losses = _train(w, optimizer, rank, world, range(SAVE_AT, STEPS))
    return {"losses_rest": losses, "state": full_state(fsdp, w), **seen}


def _load_full_model(fsdp, FSDP, w, model_state):
    with FSDP.state_dict_type(w, fsdp.StateDictType.FULL_STATE_DICT):
        w.load_state_dict(copy.deepcopy(model_state))


def _resume_table(rank, world, save, load, cross=True, describe=None, others=(None,), **wrap):
    """Every first run, then every (target, source) resume the format allows (for each of
    `others`, what `load` gets on ranks other than 0 where it takes one). `describe(saved)`:
    what the test sees of a checkpoint (checkpoints hold process groups: not returned)."""
    runs = {}
    for which in WHICH:
        runs[which] = _first_run(which, rank, world, save, **wrap)
        if describe is not None:
            runs[which]["described"] = describe(runs[which]["saved"])
        dist.barrier()
    for source in WHICH:
        for target in WHICH:
            if source != target and not cross:
                continue
            for index, other in enumerate(others):
                run = runs[source]
                name = f"{target}_from_{source}" + (f"_{index}" if index else "")
                runs[name] = _resumed(target, rank, world,
                                      lambda fsdp, FSDP, w: load(fsdp, FSDP, w, run, other),
                                      **wrap)
                dist.barrier()
    for which in WHICH:
        runs[which].pop("saved")
    return runs


# -- LOCAL_STATE_DICT ---------------------------------------------------------------------------


def _local_save(fsdp, FSDP, w, optimizer):
    with FSDP.state_dict_type(w, fsdp.StateDictType.LOCAL_STATE_DICT):
        model = w.state_dict()
        optim = FSDP.optim_state_dict(w, optimizer)
    buffer = io.BytesIO()
    torch.save({"model": model, "optim": optim}, buffer)  # as a script checkpoints it
    return buffer.getvalue()


def _local_load(fsdp, FSDP, w, run, _other):
    saved = torch.load(io.BytesIO(run["saved"]), weights_only=False)
    optimizer = M.make_adamw(w.parameters())
    with FSDP.state_dict_type(w, fsdp.StateDictType.LOCAL_STATE_DICT):
        result = w.load_state_dict(saved["model"])
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(w, optimizer, saved["optim"]))
    assert not result.missing_keys and not result.unexpected_keys, result
    return optimizer


def _describe_local(fsdp, FSDP, w) -> dict:
    """Keys and value types of a LOCAL state dict, and what this rank's flat pieces hold."""
    with FSDP.state_dict_type(w, fsdp.StateDictType.LOCAL_STATE_DICT):
        sd = w.state_dict()
        config = FSDP.get_state_dict_type(w)
    flat = {k: v for k, v in sd.items() if type(v).__name__ == "ShardedTensor"}
    return {
        "keys": list(sd),
        "flat_keys": list(flat),
        "flat_numel": sum(v.size().numel() for v in flat.values()),
        "local_numel": sum(s.tensor.numel() for v in flat.values() for s in v.local_shards()),
        "config": (config.state_dict_type.name, type(config.state_dict_config).__name__,
                   type(config.optim_state_dict_config).__name__),
        "whole": {k: v.clone() for k, v in sd.items() if k not in flat},
    }


def local_state_dict(rank, world):
    out = _resume_table(rank, world, _local_save, _local_load, cross=False,
                        use_orig_params=False)
    for which in WHICH:
        fsdp, FSDP, w = _wrap(which, use_orig_params=False)
        out[f"describe_{which}"] = _describe_local(fsdp, FSDP, w)
        dist.barrier()
    # A native LOCAL dict offered to ours: refused by name, nothing loaded.
    fsdp, FSDP, native = _wrap("native", use_orig_params=False)
    with FSDP.state_dict_type(native, fsdp.StateDictType.LOCAL_STATE_DICT):
        native_sd = native.state_dict()
    fsdp, FSDP, ours = _wrap("ours")
    before = full_state(fsdp, ours)
    try:
        with FSDP.state_dict_type(ours, fsdp.StateDictType.LOCAL_STATE_DICT):
            ours.load_state_dict(native_sd)
        out["native_into_ours"] = None
    except ValueError as error:
        out["native_into_ours"] = str(error)
    out["unchanged_after_refusal"] = all(
        torch.equal(v, before[k]) for k, v in full_state(fsdp, ours).items())
    # Ours with a flat piece replaced by a plain tensor (not what state_dict gave): refused.
    with FSDP.state_dict_type(ours, fsdp.StateDictType.LOCAL_STATE_DICT):
        sd = ours.state_dict()
        key = next(k for k in sd if type(sd[k]).__name__ == "ShardedTensor")
        sd[key] = torch.zeros(sd[key].size())
        try:
            ours.load_state_dict(sd)
            out["plain_tensor_refused"] = None
        except ValueError as error:
            out["plain_tensor_refused"] = (key, str(error))
    return out


def local_state_dict_ignored_head(rank, world):
    """lm_head in ignored_modules: whole on every rank, a plain tensor under its own name in
    the LOCAL dict, as natively; the round trip resumes bit for bit."""
    out = _resume_table(rank, world, _local_save, _local_load, cross=False,
                        use_orig_params=False, ignore_head=True)
    for which in WHICH:
        fsdp, FSDP, w = _wrap(which, use_orig_params=False, ignore_head=True)
        out[f"describe_{which}"] = _describe_local(fsdp, FSDP, w)
        dist.barrier()
    return out


def local_state_dict_no_shard(rank, world):
    """NO_SHARD: native FSDP1 gives (and takes) the full state dict under LOCAL_STATE_DICT,
    with a warning; the format is shared, so each dialect resumes from the other's too."""
    out = _resume_table(rank, world, _local_save, _local_load, use_orig_params=False,
                        sharding_strategy=ShardingStrategy.NO_SHARD)
    for which in WHICH:
        fsdp, FSDP, w = _wrap(which, use_orig_params=False,
                              sharding_strategy=ShardingStrategy.NO_SHARD)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with FSDP.state_dict_type(w, fsdp.StateDictType.LOCAL_STATE_DICT):
                sd = w.state_dict()
        out[f"values_{which}"] = {k: v.detach().clone() for k, v in sd.items()}
        out[f"warned_{which}"] = any("NO_SHARD" in str(c.message) for c in caught)
        dist.barrier()
    return out


# -- sharded_optim_state_dict / flatten_sharded_optim_state_dict ---------------------------------


def _sharded_optim_save(fsdp, FSDP, w, optimizer):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        osd = FSDP.sharded_optim_state_dict(w, optimizer)
    warned = any(issubclass(c.category, FutureWarning) and "sharded_optim_state_dict"
                 in str(c.message) for c in caught)
    return {"osd": osd, "warned": warned}


def _describe_sharded_optim(saved) -> dict:
    state = saved["osd"]["state"]
    return {"warned": saved["warned"], "keys": list(state),
            "per_param": {fqn: sorted(v) for fqn, v in state.items()},
            "groups": [g["params"] for g in saved["osd"]["param_groups"]]}


def _sharded_optim_load(fsdp, FSDP, w, run, _other):
    _load_full_model(fsdp, FSDP, w, run["model"])
    optimizer = M.make_adamw(w.parameters())
    before = _clone_tree(optimizer.state_dict())
    flat = FSDP.flatten_sharded_optim_state_dict(_fresh(run["saved"]["osd"]), w, optimizer)
    untouched = _same_tree(optimizer.state_dict(), before)
    optimizer.load_state_dict(flat)
    return optimizer, {"flatten_left_optimizer_alone": untouched}


def _fresh(tree):
    """`tree` with its plain tensors copied (`step`: an optimizer loads it as it is and steps it
    in place, which would change the checkpoint the next resume loads); sharded values are
    gathered by the load, never kept."""
    if type(tree) is torch.Tensor:
        return tree.clone()
    if isinstance(tree, dict):
        return {k: _fresh(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_fresh(v) for v in tree]
    return tree


def _same_tree(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return a == b


def sharded_optim(rank, world):
    return _resume_table(rank, world, _sharded_optim_save, _sharded_optim_load,
                         describe=_describe_sharded_optim)


# -- scatter / shard a full optimizer state dict without an optimizer ---------------------------


def _full_optim_save(fsdp, FSDP, w, optimizer):
    return _clone_tree(FSDP.full_optim_state_dict(w, optimizer))  # rank0_only=True: {} elsewhere


def _scatter_load(fsdp, FSDP, w, run, other):
    _load_full_model(fsdp, FSDP, w, run["model"])
    full = run["saved"] if dist.get_rank() == 0 else other
    local = FSDP.scatter_full_optim_state_dict(copy.deepcopy(full), w)
    optimizer = M.make_adamw(w.parameters())
    optimizer.load_state_dict(local)
    return optimizer


def _shard_load(fsdp, FSDP, w, run, _other):
    """shard_full_optim_state_dict(optim omitted): every rank holds the full dict."""
    _load_full_model(fsdp, FSDP, w, run["model"])
    full = [copy.deepcopy(run["saved"])]
    dist.broadcast_object_list(full, src=0)
    local = FSDP.shard_full_optim_state_dict(full[0], w)
    optimizer = M.make_adamw(w.parameters())
    optimizer.load_state_dict(local)
    return optimizer


def scatter_without_optim(rank, world):
    describe = lambda saved: sorted(saved.get("state", {}))  # noqa: E731
    out = _resume_table(rank, world, _full_optim_save, _scatter_load, describe=describe,
                        others=(None, {}), use_orig_params=False)
    out["shard"] = _resume_table(rank, world, _full_optim_save, _shard_load,
                                 use_orig_params=False)
    return out


# -- rank-0-only optimizer loads ------------------------------------------------------------------


def _rank0_config(fsdp):
    return (fsdp.StateDictType.FULL_STATE_DICT, fsdp.FullStateDictConfig(rank0_only=True),
            fsdp.FullOptimStateDictConfig(rank0_only=True))


def _rank0_save(fsdp, FSDP, w, optimizer):
    with FSDP.state_dict_type(w, *_rank0_config(fsdp)):
        return _clone_tree(FSDP.optim_state_dict(w, optimizer))


def _rank0_load(fsdp, FSDP, w, run, other):
    _load_full_model(fsdp, FSDP, w, run["model"])
    optimizer = M.make_adamw(w.parameters())
    osd = copy.deepcopy(run["saved"]) if dist.get_rank() == 0 else other
    with FSDP.state_dict_type(w, *_rank0_config(fsdp)):
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(w, optimizer, osd))
    return optimizer


def rank0_only_load(rank, world):
    """Rank 0 alone holds the saved dict; the others pass None, then {}."""
    describe = lambda saved: sorted(saved.get("state", {}))  # noqa: E731
    return _resume_table(rank, world, _rank0_save, _rank0_load, describe=describe,
                         others=(None, {}), use_orig_params=False)


# -- process_group / rank / world_size -------------------------------------------------------------


def process_group(rank, world):
    group = dist.new_group([0, 1])
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    hybrid = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD,
              "process_group": (singles[rank], group)}
    out = {}
    for which in WHICH:
        for setting, extra in (("default", {}), ("given", {"process_group": group}),
                               ("no_shard", {"sharding_strategy": ShardingStrategy.NO_SHARD}),
                               ("hybrid", hybrid)):
            fsdp, FSDP, w = _wrap(which, **extra)
            expected = {"given": group, "hybrid": singles[rank]}.get(setting, dist.group.WORLD)
            out[f"{which}_{setting}"] = {
                "is_expected_group": w.process_group is expected,
                "rank": w.rank, "world_size": w.world_size,
                "group_rank": w.process_group.rank(), "group_size": w.process_group.size(),
            }
            dist.barrier()
    return out


CASES = {
    "local_state_dict": local_state_dict,
    "local_state_dict_ignored_head": local_state_dict_ignored_head,
    "local_state_dict_no_shard": local_state_dict_no_shard,
    "sharded_optim": sharded_optim,
    "scatter_without_optim": scatter_without_optim,
    "rank0_only_load": rank0_only_load,
    "process_group": process_group,
}


def run_cases(rank, world, names=None):
    from tests.world import run_case_table

    return run_case_table(CASES, names)
