"""The same training script run with `torch.distributed.fsdp` and with `fsdp_bridge.fsdp` (only
the module object differs), on spawned gloo ranks; many cases per world.

Each case returns {"native": result, "ours": result} (or {"ours": ...} where native torch cannot
run the setting on a CPU-only build; the parent then compares with the single-process
reference). A result is the global per-step losses, grad norms when clipping, and the final
full state dict.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import torch
import torch.distributed as dist
from torch import nn

from tests import models as M
from tests.native_torch import fsdp2_unavailable
from tests.world import device, device_type

STEPS = 5
GLOBAL_BATCH = 8


def dialect(name: str):
    return importlib.import_module({"native": "torch.distributed.fsdp",
                                    "ours": "fsdp_bridge.fsdp"}[name])


def wrap_module(fsdp):
    return importlib.import_module(fsdp.__name__ + ".wrap")


def _model(name, seed=0):
    return M.tiny_llama(seed) if name == "llama" else M.tiny_gpt2(seed)


def _layer_cls(name):
    if name == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer
        return LlamaDecoderLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    return GPT2Block


def policy_for(fsdp, kind, layer_cls):
    wrap = wrap_module(fsdp)
    if kind is None:
        return None
    if kind == "transformer":
        return functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    if kind == "module_wrap":
        return wrap.ModuleWrapPolicy({layer_cls})
    if kind == "lambda":
        return functools.partial(wrap.lambda_auto_wrap_policy,
                                 lambda_fn=lambda m: isinstance(m, (layer_cls, nn.Embedding)))
    if kind == "size_based":
        return functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=20_000)
    if kind == "custom":
        strategy = fsdp.ShardingStrategy.SHARD_GRAD_OP

        def lambda_fn(module):
            if isinstance(module, layer_cls):
                return {"sharding_strategy": strategy} if module is first[0] else True
            return False

        first = [None]
        policy = wrap.CustomPolicy(lambda_fn)
        policy._first = first
        return policy
    if kind == "or":
        return functools.partial(wrap._or_policy, policies=[
            functools.partial(wrap.lambda_auto_wrap_policy,
                              lambda_fn=lambda m: isinstance(m, nn.Embedding)),
            functools.partial(wrap.transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}),
        ])
    raise ValueError(kind)


def train(rank, world, model, optimizer, micro_steps=1, no_sync=None, clip=None):
    losses, norms = [], []
    for batch in M.global_batches(STEPS, GLOBAL_BATCH):
        micro = M.rank_slice(batch, rank, world).chunk(micro_steps)
        total = 0.0
        for index, ids in enumerate(micro):
            loss = M.lm_loss(model, ids) / micro_steps
            if no_sync is not None and index < micro_steps - 1:
                with no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.item()
        if clip is not None:
            norm = clip(model)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(total))
    return losses, norms


# -- FSDP1: one script, two dialects -----------------------------------------------------------


def fsdp1_script(which, rank, world, model_name="llama", strategy="FULL_SHARD", policy="transformer",
                 mp=None, use_orig_params=False, micro_steps=1, clip=None, mesh_shape=None,
                 pg_tuple=False, manual=False, extra=None):
    fsdp = dialect(which)
    model = _model(model_name)
    layer_cls = _layer_cls(model_name)
    kwargs = dict(sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
                  device_id=device(), use_orig_params=use_orig_params, **(extra or {}))
    if mp is not None:
        kwargs["mixed_precision"] = fsdp.MixedPrecision(**mp)
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type(), mesh_shape, mesh_dim_names=("replicate", "shard"))
        if pg_tuple:
            kwargs["process_group"] = (mesh.get_group("shard"), mesh.get_group("replicate"))
        else:
            kwargs["device_mesh"] = mesh
    auto = policy_for(fsdp, policy, layer_cls)
    if policy == "custom":
        auto._first[0] = next(m for m in model.modules() if isinstance(m, layer_cls))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if manual:  # enable_wrap / wrap, the FSDP1 way of nesting by hand
            wrap = wrap_module(fsdp)
            with wrap.enable_wrap(wrapper_cls=fsdp.FullyShardedDataParallel, **kwargs):
                layers = model.model.layers if model_name == "llama" else model.transformer.h
                for index in range(len(layers)):
                    layers[index] = wrap.wrap(layers[index])
                wrapped = wrap.wrap(model)
        else:
            wrapped = fsdp.FullyShardedDataParallel(model, auto_wrap_policy=auto, **kwargs)
    optimizer = M.make_adamw(wrapped.parameters())
    clip_fn = None if clip is None else (lambda m: m.clip_grad_norm_(clip))
    losses, norms = train(rank, world, wrapped, optimizer, micro_steps,
                          no_sync=wrapped.no_sync if micro_steps > 1 else None, clip=clip_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp.FullyShardedDataParallel.state_dict_type(
            wrapped, fsdp.StateDictType.FULL_STATE_DICT, fsdp.FullStateDictConfig()
        ):
            state = {k: v.detach().clone().float() for k, v in wrapped.state_dict().items()}
    return {"losses": losses, "norms": norms, "state": state}


def both(script, *args, **kwargs):
    def run(rank, world):
        unavailable = native_unavailable(script, kwargs)
        if unavailable:
            return {"ours": script("ours", rank, world, *args, **kwargs),
                    "unavailable": unavailable}
        return {which: script(which, rank, world, *args, **kwargs) for which in ("native", "ours")}
    return run


def native_unavailable(script, kwargs):
    """Why this torch cannot run the native side of an FSDP2 script here (None: it can)."""
    if script is not fsdp2_script:
        return None
    return fsdp2_unavailable(kwargs.get("reshard"))


def ours_only(script, *args, **kwargs):
    def run(rank, world):
        return {"ours": script("ours", rank, world, *args, **kwargs)}
    return run


BF16 = dict(param_dtype=torch.bfloat16)
BF16_FP32_REDUCE = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                        buffer_dtype=torch.bfloat16)

# name -> (runner, model for the reference, dtype kind)
FSDP1_WORLD2 = {
    "fsdp1_full_transformer_orig": (both(fsdp1_script, use_orig_params=True, clip=0.5), "llama"),
    "fsdp1_full_module_wrap": (both(fsdp1_script, policy="module_wrap"), "llama"),
    "fsdp1_grad_op_lambda": (both(fsdp1_script, strategy="SHARD_GRAD_OP", policy="lambda",
                                  use_orig_params=True), "llama"),
    "fsdp1_no_shard_size_based": (both(fsdp1_script, strategy="NO_SHARD", policy="size_based"),
                                  "llama"),
    "fsdp1_full_size_based": (both(fsdp1_script, policy="size_based"), "llama"),
    "fsdp1_custom_override": (both(fsdp1_script, policy="custom", use_orig_params=True), "llama"),
    "fsdp1_or_policy": (both(fsdp1_script, policy="or", use_orig_params=True), "llama"),
    "fsdp1_enable_wrap": (both(fsdp1_script, policy=None, manual=True), "llama"),
    "fsdp1_no_policy": (both(fsdp1_script, policy=None), "llama"),
    "fsdp1_gpt2_tied": (both(fsdp1_script, model_name="gpt2", use_orig_params=True), "gpt2"),
    "fsdp1_gpt2_grad_op": (both(fsdp1_script, model_name="gpt2", strategy="SHARD_GRAD_OP"), "gpt2"),
    "fsdp1_no_sync_clip": (both(fsdp1_script, micro_steps=2, clip=0.5, use_orig_params=True),
                           "llama"),
    "fsdp1_bf16": (both(fsdp1_script, mp=BF16, use_orig_params=True), "llama-bf16"),
    "fsdp1_bf16_fp32_reduce": (both(fsdp1_script, mp=BF16_FP32_REDUCE), "llama-bf16"),
    "fsdp1_bf16_no_shard": (both(fsdp1_script, strategy="NO_SHARD", mp=BF16_FP32_REDUCE),
                            "llama-bf16"),
}


def _cpu_offload_extra():
    from torch.distributed.fsdp import CPUOffload
    return {"cpu_offload": CPUOffload(offload_params=True)}


def _sync_module_states(which, rank, world):
    # Every rank initialises differently; rank 0's weights (seed 0) must win.
    original = M.tiny_llama
    try:
        M.tiny_llama = lambda seed=0, device=None: original(seed + rank, device)
        return fsdp1_script(which, rank, world, extra={"sync_module_states": True})
    finally:
        M.tiny_llama = original


# Settings native FSDP1 cannot run on a CPU-only build: compared with the reference.
FSDP1_WORLD2_REF_ONLY = {
    "fsdp1_cpu_offload": (ours_only(fsdp1_script, extra=_cpu_offload_extra()), "llama"),
    "fsdp1_sync_module_states": (lambda rank, world: {"ours": _sync_module_states("ours", rank, world)},
                                 "llama"),
}

FSDP1_ALL = {**FSDP1_WORLD2, **FSDP1_WORLD2_REF_ONLY}


# -- FSDP2: one script, two dialects -----------------------------------------------------------


def fsdp2_script(which, rank, world, model_name="llama", reshard=None, mp=None, offload=False,
                 mesh_shape=None, meta=False, clip=None, micro_steps=1, root_output_fp32=False):
    fsdp = dialect(which)
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    mesh = None
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(device_type(), mesh_shape, mesh_dim_names=("replicate", "shard"))
    policy = fsdp.MixedPrecisionPolicy(**(mp or {}))
    kwargs = dict(mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    if offload:
        kwargs["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if meta:
            model = _model_on_meta(model_name)
        else:
            model = _model(model_name)
        layers = model.model.layers if model_name == "llama" else model.transformer.h
        for layer in layers:
            fsdp.fully_shard(layer, **kwargs)
        root_kwargs = dict(kwargs)
        if root_output_fp32:
            root_kwargs["mp_policy"] = fsdp.MixedPrecisionPolicy(**(mp or {}),
                                                                 output_dtype=torch.float32)
        fsdp.fully_shard(model, **root_kwargs)
        if meta:
            model.to_empty(device=device())
            fresh = _model(model_name)
            with torch.no_grad():  # non-persistent buffers (rotary inv_freq) are not in a state dict
                for name, buffer in fresh.named_buffers():
                    model.get_buffer(name).copy_(buffer)
            full = fresh.state_dict() if rank == 0 else {}
            set_model_state_dict(model, full, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True))
    optimizer = M.make_adamw(model.parameters())

    def no_sync():
        import contextlib

        @contextlib.contextmanager
        def context():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return context()

    clip_fn = None if clip is None else (
        lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), clip))
    losses, norms = train(rank, world, model, optimizer, micro_steps,
                          no_sync=no_sync if micro_steps > 1 else None, clip=clip_fn)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().clone().float() for k, v in state.items()}
    # model.state_dict() values are DTensors in both dialects
    direct = model.state_dict()
    first = next(iter(direct.values()))
    return {"losses": losses, "norms": norms, "state": state,
            "state_dict_has_full_tensor": hasattr(first, "full_tensor"),
            "class_name": type(model).__name__,
            "is_fsdp_module": isinstance(model, fsdp.FSDPModule)}


def _model_on_meta(model_name):
    with torch.device("meta"):
        return _model(model_name)


FSDP2_WORLD2 = {
    "fsdp2_default": (both(fsdp2_script, clip=0.5), "llama"),
    "fsdp2_reshard_true": (both(fsdp2_script, reshard=True), "llama"),
    "fsdp2_reshard_false": (both(fsdp2_script, reshard=False, micro_steps=2), "llama"),
    "fsdp2_reshard_int": (both(fsdp2_script, reshard=1), "llama"),
    "fsdp2_gpt2_tied": (both(fsdp2_script, model_name="gpt2"), "gpt2"),
    "fsdp2_bf16_fp32_reduce": (both(fsdp2_script, mp=dict(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.float32)),
                               "llama-bf16"),
    "fsdp2_bf16": (both(fsdp2_script, mp=dict(param_dtype=torch.bfloat16),
                        root_output_fp32=True), "llama-bf16"),
    "fsdp2_bf16_no_input_cast": (both(fsdp2_script, mp=dict(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32,
                                                            cast_forward_inputs=False)),
                                 "llama-bf16"),
    "fsdp2_cpu_offload": (both(fsdp2_script, offload=True), "llama"),
    "fsdp2_meta_init": (both(fsdp2_script, meta=True), "llama"),
}


# -- world 4: hybrid ---------------------------------------------------------------------------

WORLD4 = {
    "fsdp1_hybrid_mesh": (both(fsdp1_script, strategy="HYBRID_SHARD", mesh_shape=(2, 2),
                               use_orig_params=True, clip=1.0), "llama"),
    "fsdp1_hybrid_zero2_pg_tuple": (both(fsdp1_script, model_name="gpt2",
                                         strategy="_HYBRID_SHARD_ZERO2", mesh_shape=(2, 2),
                                         pg_tuple=True), "gpt2"),
    # Native FSDP1 silently never synchronises replicas here (pytorch#154888): reference only.
    "fsdp1_hybrid_shard_size_1": (ours_only(fsdp1_script, strategy="HYBRID_SHARD",
                                            mesh_shape=(4, 1)), "llama"),
    "fsdp1_hybrid_no_groups": (ours_only(fsdp1_script, strategy="HYBRID_SHARD"), "llama"),
    "fsdp2_hsdp": (both(fsdp2_script, mesh_shape=(2, 2)), "llama"),
    "fsdp2_reshard_int_world4": (both(fsdp2_script, reshard=2), "llama"),
}


def run_world4_cases(rank, world, names, accumulation_names):
    """The hybrid cases above, then accumulation_cases.py's (hybrid accumulation against
    native, bit for bit) in the same world of four."""
    from tests.frontends import accumulation_cases

    out = run_cases(rank, world, "WORLD4", names)
    out.update(accumulation_cases.run_cases(rank, world, accumulation_names))
    return out


def run_cases(rank, world, table_name, names):
    table = globals()[table_name]
    torch.manual_seed(0)
    out = {}
    for name in names:
        out[name] = table[name][0](rank, world)
        dist.barrier()
    return out
