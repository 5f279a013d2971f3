"""Rank functions for the checkpoint tests (spawned gloo worlds, many cases per world).

Models are built by any of our front-ends (`build(frontend, model_name)`); "truth" for a
sharded model is taken with the engine's own, independent full gathers
(`engine.full_state_dict`, `engine.full_optim_state_dict`), never with the checkpoint code under
test.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings

import torch
import torch.distributed as dist

from tests import models as M
from tests.world import device, device_type

GLOBAL_BATCH = 8


def _layer_cls(model_name):
    if model_name == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        return LlamaDecoderLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    return GPT2Block


def _layers(model, model_name):
    return model.model.layers if model_name == "llama" else model.transformer.h


def fresh(model_name, seed=0):
    return M.tiny_llama(seed) if model_name == "llama" else M.tiny_gpt2(seed)


def build(frontend, model_name="llama", seed=0, model=None):
    """A model sharded by one of our front-ends (or plain, for "plain")."""
    model = fresh(model_name, seed) if model is None else model
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if frontend == "plain":
            return model
        if frontend == "fsdp2":
            from fsdp_bridge.fsdp import fully_shard
            for layer in _layers(model, model_name):
                fully_shard(layer)
            fully_shard(model)
            return model
        if frontend == "fsdp1":
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            from fsdp_bridge.fsdp import FullyShardedDataParallel
            policy = functools.partial(transformer_auto_wrap_policy,
                                       transformer_layer_cls={_layer_cls(model_name)})
            return FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                            device_id=device(), use_orig_params=True)
        if frontend == "yafsdp":
            from tests.engine_cases import yafsdp_gpt2, yafsdp_llama
            return yafsdp_llama(model) if model_name == "llama" else yafsdp_gpt2(model)
        if frontend == "hybrid":  # FSDP1 HYBRID_SHARD over a (2, world/2) mesh
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import ShardingStrategy
            from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

            from fsdp_bridge.fsdp import FullyShardedDataParallel
            world = dist.get_world_size()
            mesh = init_device_mesh(device_type(), (2, world // 2), mesh_dim_names=("replicate", "shard"))
            policy = functools.partial(transformer_auto_wrap_policy,
                                       transformer_layer_cls={_layer_cls(model_name)})
            return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_mesh=mesh,
                                            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                                            device_id=device(), use_orig_params=True)
        if frontend in ("native_fsdp2", "native_fsdp1"):
            return build_native(frontend, model, model_name)
    raise ValueError(frontend)


def build_native(frontend, model, model_name):
    if frontend == "native_fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in _layers(model, model_name):
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={_layer_cls(model_name)})
    return FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                    device_id=device(), use_orig_params=True)


def optimizer_for(model):
    return M.make_adamw(model.parameters(), lr=1e-3)


def train_steps(model, optimizer, steps, start=0, seed=1234):
    """`steps` AdamW steps on batches start..start+steps of one fixed sequence of batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = M.global_batches(start + steps, GLOBAL_BATCH, seed=seed)[start:]
    losses = []
    for batch in batches:
        loss = M.lm_loss(model, M.rank_slice(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(loss.item()))
    return losses


def _sharded_of(model):
    from fsdp_bridge.state_dicts.parts import find_parts
    parts = find_parts(model)
    assert len(parts) == 1 and parts[0].prefix == "", parts
    return parts[0].sharded


def truth(model, optimizer):
    """Full parameters and full optimizer state, gathered by the engine's own code (native
    models: torch's own full state dicts)."""
    from fsdp_bridge import engine
    from fsdp_bridge.state_dicts.parts import has_flat_shards
    if not has_flat_shards(model):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )
        options = StateDictOptions(full_state_dict=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            params = get_model_state_dict(model, options=options)
            optim = get_optimizer_state_dict(model, optimizer, options=options)
        return _plain(params), _plain(optim["state"])
    sharded = _sharded_of(model)
    params = engine.full_state_dict(sharded, cpu_offload=True)
    optim = engine.full_optim_state_dict(sharded, optimizer)
    return _plain(params), _plain(optim["state"])


def _plain(tree):
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if torch.is_tensor(tree):
        value = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
        return value.detach().clone().cpu()
    return tree


def max_diff(a, b, path=""):
    """The largest |a - b| over two nested dicts of tensors (inf when keys differ)."""
    if isinstance(a, dict) or isinstance(b, dict):
        if not (isinstance(a, dict) and isinstance(b, dict)) or set(a) != set(b):
            missing = set(a) ^ set(b) if isinstance(a, dict) and isinstance(b, dict) else path
            raise AssertionError(f"key mismatch at {path!r}: {sorted(missing)[:6]}")
        return max([max_diff(a[k], b[k], f"{path}.{k}") for k in a] or [0.0])
    if torch.is_tensor(a):
        assert tuple(a.shape) == tuple(b.shape), (path, a.shape, b.shape)
        if a.numel() == 0:
            return 0.0
        return (a.double() - b.double()).abs().max().item()
    assert a == b, (path, a, b)
    return 0.0


def bit_equal(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(bit_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return set(a) == set(b) and all(bit_equal(a[k], b[k]) for k in a)
    if torch.is_tensor(a):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def save_truth(path, model, optimizer):
    params, optim = truth(model, optimizer)
    if dist.get_rank() == 0:
        torch.save({"params": params, "optim": optim}, path)
    dist.barrier()


def compare_truth(path, model, optimizer):
    params, optim = truth(model, optimizer)
    expected = torch.load(path)
    return {"params": max_diff(params, expected["params"]),
            "optim": max_diff(optim, expected["optim"])}


# -- resharding: 2 -> 4 -> 1 -> 2, a different front-end at each stage ---------------------------


def reshard_stage(rank, world, directory, stage, frontend, source, target):
    """Load `source` (if any) into a fresh model, compare with the truth saved with it, train
    one step, save to `target` with its truth."""
    from fsdp_bridge import checkpoint
    torch.manual_seed(0)
    model = build(frontend, seed=stage)  # a different init: loading must overwrite it
    optimizer = optimizer_for(model)
    out = {}
    if source is None:
        train_steps(model, optimizer, 2)
    else:
        checkpoint.load_state(os.path.join(directory, source), model, optimizer)
        out["after_load"] = compare_truth(os.path.join(directory, source + ".truth"), model,
                                          optimizer)
        # One more step from the loaded state, compared below with the saved continuation.
    checkpoint.save_state(os.path.join(directory, target), model, optimizer)
    save_truth(os.path.join(directory, target + ".truth"), model, optimizer)
    out["losses"] = train_steps(model, optimizer, 1, start=2)
    return out


# -- bit-identical resume ------------------------------------------------------------------------


def resume(rank, world, directory):
    """10 steps vs 5 + save + a new process group + load + 5: bit-identical (fp32, CPU).
    Replaces the default process group: run it last in a world."""
    from fsdp_bridge import checkpoint
    model = build("fsdp2", seed=0)
    optimizer = optimizer_for(model)
    train_steps(model, optimizer, 10)
    straight = truth(model, optimizer)

    model = build("fsdp2", seed=0)
    optimizer = optimizer_for(model)
    train_steps(model, optimizer, 5)
    path = os.path.join(directory, "resume")
    checkpoint.save_state(path, model, optimizer)
    del model, optimizer
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{directory}/pg-resume", rank=rank,
                            world_size=world)
    model = build("fsdp2", seed=99)  # another init: everything must come from the checkpoint
    optimizer = optimizer_for(model)
    checkpoint.load_state(path, model, optimizer)
    train_steps(model, optimizer, 5, start=5)
    resumed = truth(model, optimizer)
    return {"bit_identical": bit_equal(straight, resumed),
            "max_diff": max(max_diff(straight[0], resumed[0]), max_diff(straight[1], resumed[1]))}


# -- bad input ----------------------------------------------------------------------------------


def _digest(directory):
    import hashlib
    out = {}
    for root, _, files in os.walk(directory):
        for name in sorted(files):
            file = os.path.join(root, name)
            with open(file, "rb") as handle:
                out[os.path.relpath(file, directory)] = hashlib.sha256(handle.read()).hexdigest()
    return out


def _expect_error(fn, *fragments):
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        text = str(exc)
        missing = [f for f in fragments if f not in text]
        return {"raised": type(exc).__name__, "ok": not missing, "message": text[:400]}
    return {"raised": None, "ok": False, "message": "no error"}


def bad_inputs(rank, world, directory, source):
    """Loading what does not fit: clear errors, the model and the files untouched."""
    from transformers import LlamaConfig

    from fsdp_bridge import checkpoint
    from fsdp_bridge.tiny import build_llama
    path = os.path.join(directory, source)
    before = _digest(directory) if rank == 0 else None
    out = {}

    def fresh_llama(**changes):
        config = fresh("llama").config.to_dict()
        config.update(changes)
        return build_llama(LlamaConfig(**config), seed=0)

    # Another model altogether.
    gpt2 = build("fsdp1", "gpt2")
    out["other_model"] = _expect_error(lambda: checkpoint.load_state(path, gpt2, optimizer_for(gpt2)),
                                       "missing from the checkpoint", "transformer.h.0")
    # Fewer layers: the checkpoint has extra keys.
    small = build("fsdp2", model=fresh_llama(num_hidden_layers=2))
    opt_small = optimizer_for(small)
    params_before = truth(small, opt_small)[0]
    out["extra_keys"] = _expect_error(lambda: checkpoint.load_state(path, small, opt_small),
                                      "not in the model", "model.layers.2")
    out["model_untouched"] = max_diff(params_before, truth(small, opt_small)[0]) == 0.0
    # Wider: wrong shapes.
    wide = build("fsdp1", model=fresh_llama(intermediate_size=96))
    out["wrong_shapes"] = _expect_error(lambda: checkpoint.load_state(path, wide, optimizer_for(wide)),
                                        "wrong shapes", "mlp.gate_proj.weight", "(96, 64)")
    # A full state dict with a wrong shape straight into set_model_state_dict.
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    full = {k: v.clone() for k, v in fresh("llama").state_dict().items()}
    full["model.norm.weight"] = torch.ones(3)
    llama = build("yafsdp")
    out["set_wrong_shape"] = _expect_error(
        lambda: set_model_state_dict(llama, full, options=StateDictOptions(full_state_dict=True)),
        "model.norm.weight", "(3,)", "(64,)")
    # Damaged files: a copy with a truncated data file, and one without its metadata.
    truncated = os.path.join(directory, "truncated")
    no_meta = os.path.join(directory, "no_metadata")
    if rank == 0:
        import shutil
        shutil.copytree(path, truncated)
        data = sorted(f for f in os.listdir(truncated) if f.endswith(".distcp"))[0]
        with open(os.path.join(truncated, data), "r+b") as handle:
            handle.truncate(os.path.getsize(os.path.join(truncated, data)) // 2)
        shutil.copytree(path, no_meta)
        os.remove(os.path.join(no_meta, ".metadata"))
    dist.barrier()
    before_damaged = _digest(directory) if rank == 0 else None
    model = build("fsdp2")
    opt = optimizer_for(model)
    out["truncated"] = _expect_error(lambda: checkpoint.load_state(truncated, model, opt),
                                     "truncated", ".distcp")
    out["no_metadata"] = _expect_error(lambda: checkpoint.load_state(no_meta, model, opt),
                                       "no '.metadata' file")
    dist.barrier()
    if rank == 0:
        after = _digest(directory)
        out["files_untouched"] = all(after.get(k) == v for k, v in before.items()) and \
            after == before_damaged
    return out


def legacy_per_rank_save(rank, world, directory):
    """Per-rank files with no offsets (the engine's own sharded state dict and
    `optim.state_dict()`): loadable only at the world size that wrote them."""
    from fsdp_bridge import engine
    model = build("fsdp1")
    optimizer = optimizer_for(model)
    train_steps(model, optimizer, 1)
    torch.save({"model": engine.sharded_state_dict(_sharded_of(model)),
                "optim": optimizer.state_dict()},
               os.path.join(directory, f"legacy_rank{rank}.pt"))
    dist.barrier()


def legacy_per_rank_load(rank, world, directory):
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    from fsdp_bridge import engine
    model = build("fsdp1")
    optimizer = optimizer_for(model)
    saved = torch.load(os.path.join(directory, f"legacy_rank{rank % 2}.pt"))
    out = {"model": _expect_error(lambda: engine.load_sharded_state_dict(_sharded_of(model),
                                                                         saved["model"]),
                                  "world size")}
    named = {}
    for name, param in model.named_parameters():
        named[name.replace("_fsdp_wrapped_module.", "")] = param
    # The per-rank optimizer state keyed by name (what a user re-keys by hand).
    order = [n for n in named]
    osd = {"state": {order[i]: s for i, s in saved["optim"]["state"].items()},
           "param_groups": [dict(g, params=[order[i] for i in g["params"]])
                            for g in saved["optim"]["param_groups"]]}
    out["optim"] = _expect_error(lambda: set_optimizer_state_dict(model, optimizer, osd),
                                 "per-rank", "another world size")
    return out


# -- interop: one step after a load must match the same step taken by the source -----------------


def _step_truth(model, optimizer, start=2):
    train_steps(model, optimizer, 1, start=start)
    return truth(model, optimizer)


def _pair_diffs(a, b):
    return max(max_diff(a[0], b[0]), max_diff(a[1], b[1]))


def _reference_step(model_name, full_params, lr=1e-3):
    """One step of a single process on the global batch, from `full_params`, fresh AdamW."""
    model = fresh(model_name)
    model.load_state_dict(full_params)
    optimizer = M.make_adamw(model.parameters(), lr=lr)
    batch = M.global_batches(3, GLOBAL_BATCH)[2]
    M.lm_loss(model, batch).backward()
    optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def hf_interop(rank, world, directory, model_name):
    """save_pretrained -> ours, and ours -> save_pretrained -> from_pretrained."""
    from fsdp_bridge.checkpoint import hf
    source = fresh(model_name, seed=5)
    hf_dir = os.path.join(directory, f"hf_{model_name}")
    if rank == 0:
        source.save_pretrained(hf_dir, safe_serialization=True)
    dist.barrier()
    out = {}
    model = build("fsdp1", model_name, seed=6)
    hf.load_pretrained(model, hf_dir)
    optimizer = optimizer_for(model)
    expected = {k: v.detach().clone() for k, v in source.state_dict().items()}
    out["in_after_load"] = max_diff(truth(model, optimizer)[0], expected)
    # One step on each side, from the same weights.
    reference = _reference_step(model_name, expected)
    train_steps(model, optimizer, 1, start=2)
    out["in_step"] = max_diff(truth(model, optimizer)[0], reference)
    # Ours -> save_pretrained -> from_pretrained.
    ours_dir = os.path.join(directory, f"ours_hf_{model_name}")
    hf.save_pretrained(model, ours_dir)
    params = truth(model, optimizer)[0]
    if rank == 0:
        cls = type(source)
        loaded = cls.from_pretrained(ours_dir)
        out["out_after_load"] = max_diff({k: v.detach() for k, v in loaded.state_dict().items()},
                                         params)
        out["out_files"] = sorted(os.listdir(ours_dir))
    return out


def native_fsdp2_interop(rank, world, directory, model_name="llama"):
    """native FSDP2 (dcp.save of torch's own state dicts) -> ours, and ours -> native FSDP2."""
    from tests.native_torch import fsdp2_unavailable

    if fsdp2_unavailable():
        return {"unavailable": fsdp2_unavailable()}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from fsdp_bridge import checkpoint
    out = {}
    native = build("native_fsdp2", model_name, seed=3)
    native_opt = optimizer_for(native)
    train_steps(native, native_opt, 2)
    path = os.path.join(directory, f"native_fsdp2_{model_name}")
    dcp.save({"model": get_model_state_dict(native),
              "optim": get_optimizer_state_dict(native, native_opt)}, checkpoint_id=path)
    ours = build("fsdp2", model_name, seed=7)
    ours_opt = optimizer_for(ours)
    checkpoint.load_state(path, ours, ours_opt)
    out["in_after_load"] = _pair_diffs(truth(native, native_opt), truth(ours, ours_opt))
    out["in_step"] = _pair_diffs(_step_truth(native, native_opt), _step_truth(ours, ours_opt))
    # Ours -> native.
    out.update(_ours_to_native(directory, "native_fsdp2", model_name, 8, ours, ours_opt))
    return out


def native_fsdp1_interop(rank, world, directory, model_name="llama"):
    """native FSDP1 FULL (torch.save on rank 0, optimizer via FSDP.optim_state_dict) and
    SHARDED (dcp.save under SHARDED_STATE_DICT) -> ours; ours -> native FSDP1 (via DSD)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.fsdp import FullyShardedDataParallel as NativeFSDP
    from torch.distributed.fsdp import StateDictType

    from fsdp_bridge import checkpoint
    out = {}
    warnings.simplefilter("ignore")
    native = build("native_fsdp1", model_name, seed=4)
    native_opt = optimizer_for(native)
    train_steps(native, native_opt, 2)
    # FULL: the classic FSDP1 recipe, one file written by rank 0.
    # offload_to_cpu=False: with its default (True), native FSDP1's FULL optimizer state dict
    # is silently wrong on a CPU-only build (exp_avg off by up to 9e-3 from a single-process
    # reference, measured on torch 2.13); the model state dict is right either way.
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig
    with NativeFSDP.state_dict_type(native, StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                    FullOptimStateDictConfig(offload_to_cpu=False)):
        full = {"model": native.state_dict(), "optim": NativeFSDP.optim_state_dict(native, native_opt)}
    full_path = os.path.join(directory, f"native_fsdp1_full_{model_name}.pt")
    if rank == 0:
        torch.save(full, full_path)
    dist.barrier()
    ours = build("fsdp1", model_name, seed=9)
    ours_opt = optimizer_for(ours)
    loaded = torch.load(full_path) if rank == 0 else {"model": {}, "optim": {}}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(ours, loaded["model"], options=options)
    set_optimizer_state_dict(ours, ours_opt, loaded["optim"], options=options)
    out["full_after_load"] = _pair_diffs(truth(native, native_opt), truth(ours, ours_opt))
    # SHARDED: dcp.save under SHARDED_STATE_DICT (ShardedTensor values).
    sharded_path = os.path.join(directory, f"native_fsdp1_sharded_{model_name}")
    with NativeFSDP.state_dict_type(native, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": native.state_dict(),
                  "optim": NativeFSDP.optim_state_dict(native, native_opt)},
                 checkpoint_id=sharded_path)
    ours2 = build("fsdp2", model_name, seed=10)
    ours2_opt = optimizer_for(ours2)
    checkpoint.load_state(sharded_path, ours2, ours2_opt)
    out["sharded_after_load"] = _pair_diffs(truth(native, native_opt), truth(ours2, ours2_opt))
    native_next = _step_truth(native, native_opt)
    out["full_step"] = _pair_diffs(native_next, _step_truth(ours, ours_opt))
    out["sharded_step"] = _pair_diffs(native_next, _step_truth(ours2, ours2_opt))
    # Ours -> native FSDP1 (torch's own helpers, SHARDED under the hood).
    out.update(_ours_to_native(directory, "native_fsdp1", model_name, 11, ours2, ours2_opt))
    return out


# -- the llama-recipes sharded FSDP1 checkpoint, on our FSDP1 face ---------------------------------


def _fsdp1_face(kind):
    """(FullyShardedDataParallel class, model builder) of native FSDP1 or of ours."""
    if kind == "native":
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel, functools.partial(build, "native_fsdp1")
    from fsdp_bridge.fsdp import FullyShardedDataParallel
    return FullyShardedDataParallel, functools.partial(build, "fsdp1")


def recipes_save(FSDP, model, optimizer, path):
    """llama-recipes' save_model_and_optimizer_sharded, as written there (FSDP1 names)."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        if optimizer is not None:
            state_dict["optim"] = FSDP.optim_state_dict(model, optimizer)
        dist_cp.save(state_dict, storage_writer=dist_cp.FileSystemWriter(path))


def recipes_load(FSDP, model, optimizer, path):
    """llama-recipes' load_model_sharded (and the optimizer the same way, through
    FSDP.optim_state_dict_to_load, when `optimizer` is given)."""
    import torch.distributed.checkpoint as dist_cp
    from torch.distributed.fsdp import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict()}
        if optimizer is not None:
            state_dict["optim"] = FSDP.optim_state_dict(model, optimizer)
        dist_cp.load(state_dict, storage_reader=dist_cp.FileSystemReader(path))
        model.load_state_dict(state_dict["model"])
        if optimizer is not None:
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(model, optimizer, state_dict["optim"]))


def llama_recipes_sharded(rank, world, directory):
    """Ours -> ours, native -> ours and ours -> native, model and optimizer, each compared
    with the saving model: bit-identical."""
    warnings.simplefilter("ignore")
    OursFSDP, build_ours = _fsdp1_face("ours")
    NativeFSDP, build_native_fsdp1 = _fsdp1_face("native")
    out = {}
    ours = build_ours(seed=21)
    ours_opt = optimizer_for(ours)
    train_steps(ours, ours_opt, 2)
    path = os.path.join(directory, "recipes_ours")
    recipes_save(OursFSDP, ours, ours_opt, path)
    save_truth(path + ".truth", ours, ours_opt)
    loaded = build_ours(seed=22)
    loaded_opt = optimizer_for(loaded)
    recipes_load(OursFSDP, loaded, loaded_opt, path)
    out["ours_to_ours"] = compare_truth(path + ".truth", loaded, loaded_opt)
    out["ours_to_ours_step"] = _pair_diffs(_step_truth(ours, ours_opt), _step_truth(loaded, loaded_opt))
    native = build_native_fsdp1(seed=23)
    native_opt = optimizer_for(native)
    native_path = os.path.join(directory, "recipes_native")
    train_steps(native, native_opt, 2)
    recipes_save(NativeFSDP, native, native_opt, native_path)
    from_native = build_ours(seed=24)
    from_native_opt = optimizer_for(from_native)
    recipes_load(OursFSDP, from_native, from_native_opt, native_path)
    out["native_to_ours"] = _pair_diffs(truth(native, native_opt), truth(from_native, from_native_opt))
    to_native = build_native_fsdp1(seed=25)
    to_native_opt = optimizer_for(to_native)
    # Native FSDP1's template has optimizer state only after a step; the load overwrites it.
    train_steps(to_native, to_native_opt, 1)
    recipes_load(NativeFSDP, to_native, to_native_opt, path)
    out["ours_to_native"] = compare_truth(path + ".truth", to_native, to_native_opt)
    return out


def llama_recipes_reshard(rank, world, directory):
    """The world-2 llama-recipes checkpoint of ours, loaded by ours at this world size."""
    warnings.simplefilter("ignore")
    OursFSDP, build_ours = _fsdp1_face("ours")
    path = os.path.join(directory, "recipes_ours")
    model = build_ours(seed=26)
    optimizer = optimizer_for(model)
    recipes_load(OursFSDP, model, optimizer, path)
    return compare_truth(path + ".truth", model, optimizer)


def _ours_to_native(directory, native_kind, model_name, seed, ours, ours_opt) -> dict:
    """Save ours with our checkpoint API, load it into a fresh native model through torch's
    own DCP helpers, and compare after the load and after one more step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from fsdp_bridge import checkpoint

    path = os.path.join(directory, f"ours_to_{native_kind}_{model_name}")
    checkpoint.save_state(path, ours, ours_opt)
    native = build(native_kind, model_name, seed=seed)
    native_opt = optimizer_for(native)
    state = {"model": get_model_state_dict(native),
             "optim": get_optimizer_state_dict(native, native_opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(native, state["model"])
    set_optimizer_state_dict(native, native_opt, state["optim"])
    return {
        "out_after_load": _pair_diffs(truth(native, native_opt), truth(ours, ours_opt)),
        "out_step": _pair_diffs(_step_truth(native, native_opt, 3), _step_truth(ours, ours_opt, 3)),
    }


# -- torch's own state-dict helpers, unpatched, on the flat-layout front-ends ------------------


def _torch_helpers_untouched() -> bool:
    import torch.distributed.checkpoint.state_dict as dsd

    workers = ("_get_model_state_dict", "_load_model_state_dict", "_get_optim_state_dict",
               "_load_optim_state_dict", "get_model_state_dict", "get_optimizer_state_dict")
    # torch decorates some of them (no_grad); whatever wraps them must be torch's own code
    return all(inspect.unwrap(getattr(dsd, name)).__code__.co_filename == dsd.__file__
               for name in workers)


def torch_helpers_on_flat(rank, world, frontend):
    """torch's get_/set_ state-dict functions on an FSDP1 / YaFSDP model of ours: full form
    equal to the engine's own full state, sharded form as row DTensors, a round trip through
    set_state_dict (full, flattened, broadcast from rank 0) onto a fresh model; outside those
    functions, state_dict() / optim.state_dict() / named_parameters() keep FSDP1's meanings."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.tensor import DTensor, Shard

    model = build(frontend)
    optimizer = optimizer_for(model)
    train_steps(model, optimizer, 1)
    params, optim = truth(model, optimizer)
    full = StateDictOptions(full_state_dict=True)
    got_model, got_optim = get_state_dict(model, optimizer, options=full)
    sharded_model, sharded_optim = get_state_dict(model, optimizer)
    rows = [v for v in sharded_model.values() if isinstance(v, DTensor)]
    state_rows = [v for s in sharded_optim["state"].values() for v in s.values()
                  if isinstance(v, DTensor)]
    local = optimizer.state_dict()["state"]
    pieces = [p for p in model.parameters()]
    out = {
        "untouched": _torch_helpers_untouched(),
        "model_full": max_diff(_plain(got_model), params),
        "optim_full": max_diff(_plain(got_optim["state"]), optim),
        "model_rows": bool(rows) and all(v.placements[-1] == Shard(0) for v in rows),
        "optim_rows": bool(state_rows) and all(v.placements[-1] == Shard(0) for v in state_rows),
        "sharded_equals_full": max_diff(_plain(sharded_model), params),
        "local_optim_pieces": all(s["exp_avg"].shape == pieces[i].shape
                                  for i, s in local.items()),
        "plain_names_kept": [n for n, _ in model.named_parameters()][0],
    }
    for name, options in (("full", full),
                          ("sharded", StateDictOptions()),
                          # (torch 2.13 cannot load full_state_dict with a flattened optimizer
                          # state dict even for native FSDP2, so flattened is tried sharded)
                          ("flattened", StateDictOptions(flatten_optimizer_state_dict=True)),
                          ("broadcast", StateDictOptions(full_state_dict=True,
                                                         broadcast_from_rank0=True))):
        src_model, src_optim = get_state_dict(model, optimizer, options=options)
        fresh_model = build(frontend, seed=7)
        fresh_optim = optimizer_for(fresh_model)
        set_state_dict(fresh_model, fresh_optim, model_state_dict=src_model,
                       optim_state_dict=src_optim, options=options)
        new_params, new_optim = truth(fresh_model, fresh_optim)
        out[f"round_trip_{name}"] = max(max_diff(new_params, params),
                                        max_diff(new_optim, optim))
    out["unconverted_refused"] = _unconverted_state_refused(frontend, optimizer, model)
    return out


def _unconverted_state_refused(frontend, optimizer, model):
    """Sharded optimizer state loaded by torch's helper into an optimizer that never stepped
    but holds gradients (torch then skips its initialising step, so nothing converts the
    state): the first step refuses it by name instead of stepping pieces with whole-parameter
    values. (With full_state_dict=True torch itself refuses such an optimizer.)"""
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    saved = get_optimizer_state_dict(model, optimizer)
    fresh_model = build(frontend, seed=7)
    fresh_optim = optimizer_for(fresh_model)
    batch = M.rank_slice(M.global_batches(1, GLOBAL_BATCH, seed=5)[0], dist.get_rank(),
                         dist.get_world_size())
    M.lm_loss(fresh_model, batch).backward()
    set_optimizer_state_dict(fresh_model, fresh_optim, saved)
    return _expect_error(fresh_optim.step, "had not stepped yet", "zero_grad")


def world2_first(rank, world, directory):
    """Everything the first world-2 run does (one spawn)."""
    out = {"reshard": reshard_stage(rank, world, directory, 0, "fsdp2", None, "w2")}
    legacy_per_rank_save(rank, world, directory)
    for name, fn in (("bad_inputs", lambda: bad_inputs(rank, world, directory, "w2")),
                     ("hf_llama", lambda: hf_interop(rank, world, directory, "llama")),
                     ("hf_gpt2", lambda: hf_interop(rank, world, directory, "gpt2")),
                     ("native_fsdp2", lambda: native_fsdp2_interop(rank, world, directory)),
                     ("native_fsdp2_gpt2", lambda: native_fsdp2_interop(rank, world, directory,
                                                                        "gpt2")),
                     ("native_fsdp1", lambda: native_fsdp1_interop(rank, world, directory)),
                     ("llama_recipes", lambda: llama_recipes_sharded(rank, world, directory)),
                     ("torch_helpers_fsdp1", lambda: torch_helpers_on_flat(rank, world, "fsdp1")),
                     ("torch_helpers_yafsdp",
                      lambda: torch_helpers_on_flat(rank, world, "yafsdp"))):
        out[name] = fn()
        dist.barrier()
    out["resume"] = resume(rank, world, directory)  # last: it replaces the process group
    return out


def world4(rank, world, directory):
    out = {"reshard": reshard_stage(rank, world, directory, 1, "hybrid", "w2", "w4")}
    out["legacy"] = legacy_per_rank_load(rank, world, directory)
    out["llama_recipes"] = llama_recipes_reshard(rank, world, directory)
    return out


def world1(rank, world, directory):
    return {"reshard": reshard_stage(rank, world, directory, 2, "yafsdp", "w4", "w1"),
            "llama_recipes": llama_recipes_reshard(rank, world, directory)}


def world2_last(rank, world, directory):
    return {"reshard": reshard_stage(rank, world, directory, 3, "fsdp1", "w1", "w2b")}
