"""What the bench trains: the tiny Llama, wrapped by each configuration, its optimizer, its
data and one training step (everything here runs on every rank)."""

from __future__ import annotations

import functools

from fsdp_bridge import tiny

# "ours": our engine through the YaFSDP front-end (flat shards); "ours2": through
# fsdp_bridge.fsdp.fully_shard (DTensor parameters sharded by rows, one copy after each gather);
# "plain": the compute-only baseline, each rank's whole model on its own batch, no communication.
CONFIGS = ("fsdp1", "fsdp2", "ours", "ours2", "plain")


def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_llama(s: dict):
    """The Llama of these settings, seeded: the same weights for every config and rank."""
    return tiny.build_llama(llama_config(s), seed=0)


def llama_config(s: dict):
    return tiny.llama_config(vocab=s["vocab"], hidden=s["hidden"], layers=s["layers"],
                             heads=s["heads"], kv_heads=s["kv_heads"],
                             intermediate=s["intermediate"], positions=s["seq"])


def _wrap_fsdp1(model, dtype, param_init_fn=None):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    mixed = None
    if dtype != torch.float32:
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=policy,
        mixed_precision=mixed, device_id=compute_device(), param_init_fn=param_init_fn,
    )


def compute_device():
    """This rank's GPU where the process group has a CUDA backend of its own (NCCL, `--device
    cuda`), else the CPU: the engine's own choice for a model built on the CPU."""
    from fsdp_bridge.engine import default_device

    return default_device()


@functools.lru_cache(maxsize=None)
def _world_mesh():
    """One 1-D mesh over the world, shared by every FSDP2 build (no new process groups)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(compute_device().type, (dist.get_world_size(),))


def _fully_shard_layers_then_root(fully_shard, model, dtype):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _world_mesh()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _wrap_fsdp2(model, dtype):
    from torch.distributed.fsdp import fully_shard

    return _fully_shard_layers_then_root(fully_shard, model, dtype)


def _wrap_ours(model, dtype, param_init_fn=None):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fsdp_bridge.ya_fsdp import YaFSDP

    layers = [(layer, f"model.layers.{i}") for i, layer in enumerate(model.model.layers)]
    return YaFSDP(
        model, zero_stage=3, modules_to_wrap_with_names=layers,
        rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
        layer_norm_module_cls=LlamaRMSNorm, param_dtype=dtype, gradient_accumulation_steps=1,
        param_init_fn=param_init_fn,
    )


def _wrap_ours_fsdp2(model, dtype):
    from fsdp_bridge.fsdp import fully_shard

    return _fully_shard_layers_then_root(fully_shard, model, dtype)


def _wrap_plain(model, dtype):
    """The compute-only baseline: the unsharded model in the compute dtype (under bf16 its
    parameters are bf16 too: the compute matches, the optimizer is a little cheaper)."""
    return model.to(dtype)


WRAPPERS = {"fsdp1": _wrap_fsdp1, "fsdp2": _wrap_fsdp2, "ours": _wrap_ours,
            "ours2": _wrap_ours_fsdp2, "plain": _wrap_plain}


def build(config: str, dtype_name: str, s: dict):
    import torch

    model = WRAPPERS[config](build_llama(s), torch_dtype(dtype_name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def _materialize_own(module) -> None:
    """A module's own tensors get storage and, where it has one, its `reset_parameters()`
    (Llama's norms have none: their weights stay uninitialised, enough for a memory figure)."""
    module.to_empty(device=compute_device(), recurse=False)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def wrap_from_meta(config: str, dtype_name: str, s: dict):
    """The Llama built on the meta device and wrapped by `config`, materialised as each dialect
    does it: FSDP1 and ours inside the wrap, unit by unit (`param_init_fn`); FSDP2 and plain
    after it, module by module."""
    model = tiny.build_llama(llama_config(s), seed=None, device="meta")
    dtype = torch_dtype(dtype_name)
    if config in ("fsdp1", "ours"):
        return WRAPPERS[config](model, dtype, param_init_fn=_materialize_own)
    wrapped = WRAPPERS[config](model, dtype)
    for module in wrapped.modules():
        _materialize_own(module)
    return wrapped


def step(model, optimizer, ids) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def batch(s: dict, rank: int):
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    return torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=generator)
