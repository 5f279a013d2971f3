"""Gradient accumulation against native torch, bit for bit, in one spawned gloo world: each
case trains a small language model with micro-batches accumulated without synchronisation (FSDP1's
`no_sync()`, FSDP2's `set_requires_gradient_sync(False)`, YaFSDP's declared steps) under one of
our front-ends and under its native reference, the same script otherwise, and returns both
runs' per-step losses, grad norms and final full state dicts (see test_accumulation_native.py).

Native references: torch's FSDP1 for our FSDP1, for Zeta's `fsdp()` and for TorchAcc (both
wrap with torch's FSDP1, configured here as their own code configures it); torch's
`fully_shard` for ours. YaFSDP's own code runs on CUDA only. Its arithmetic (read from
`ya_fsdp/ya_fsdp.py`: each micro-step's gradients reduced in fp32, or in param_dtype with
`bit16_reduce_scatter`, with a plain sum, added into the fp32 gradient shard, and the shard
divided by world size x steps once, after the last micro-step) is native FSDP2's with that
reduce dtype, gradients synchronised at every micro-step and the loss divided by the steps:
the same numbers bit for bit where world size x steps is a power of two (every division is
then exact). So native FSDP2 is its reference here; YaFSDP's `no_sync` (ours: YaFSDP's class
has none) sums as YaFSDP's own `fully_shard` and FSDP2 do.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from tests import models as M
from tests.native_torch import fsdp2_unavailable
from tests.world import device, run_case_table

STEPS = 2
PER_RANK_BATCH = 12  # divisible by every micro-step count, 1 to 4
MAX_NORM = 1.0  # clips: the norm decides the step
NO_CLIP = 1e9  # measures the norm only

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


class Block(nn.Module):
    """A pre-norm residual MLP block: the unit every front-end wraps."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """A small next-token model, light enough for many runs in one world (the rounding order
    under test does not depend on the architecture); its loss is computed in fp32."""

    def __init__(self, vocab: int = 64, width: int = 32, depth: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x)).float()
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def tiny_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().to(device())


def _batches(world: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, 64, (STEPS, PER_RANK_BATCH * world, 16), generator=generator)


def train(model, rank: int, world: int, micro: int, backward_sync, clip,
          loss_divisor=None) -> dict:
    """STEPS optimizer steps of `micro` micro-batches each. `backward_sync(last)` returns the
    context a micro-step's backward runs in; `clip(model)` clips and returns the norm. The loss
    is divided by `loss_divisor` (default: `micro`)."""
    optimizer = M.make_adamw(model.parameters())
    losses, norms = [], []
    for batch in _batches(world):
        total = 0.0
        for index, ids in enumerate(M.rank_slice(batch, rank, world).chunk(micro)):
            loss = model(ids.to(device()))
            with backward_sync(index == micro - 1):
                (loss / (loss_divisor or micro)).backward()
            total += loss.item() / micro
        norm = clip(model)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(total))
    return {"losses": losses, "norms": norms, "state": _full_state(model)}


def _full_state(model) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {key: value.detach().clone() for key, value in state.items()}


def _no_sync_of(model):
    def context(last: bool):
        import contextlib

        return contextlib.nullcontext() if last else model.no_sync()
    return context


def _fsdp1_clip(model, max_norm=MAX_NORM):
    return model.clip_grad_norm_(max_norm)


def _torch_clip(model, max_norm=MAX_NORM):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


# -- FSDP1 and the front-ends that wrap with it -------------------------------------------------


def fsdp1(which: str, rank: int, world: int, param, reduce, micro: int, strategy="FULL_SHARD",
          use_orig_params=False, offload=False, mesh=None, sync_every_step=False) -> dict:
    """torch's FSDP1 script with `torch.distributed.fsdp` ("native") or `fsdp_bridge.fsdp`;
    accumulation by `no_sync()` (or every micro-step synchronised: gradients accumulate in
    `.grad` across reducing backwards)."""
    import importlib

    fsdp = importlib.import_module({"native": "torch.distributed.fsdp",
                                    "ours": "fsdp_bridge.fsdp"}[which])
    wrap = importlib.import_module(fsdp.__name__ + ".wrap")
    kwargs = dict(sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
                  device_id=device(), use_orig_params=use_orig_params,
                  auto_wrap_policy=functools.partial(wrap.transformer_auto_wrap_policy,
                                                     transformer_layer_cls={Block}),
                  mixed_precision=fsdp.MixedPrecision(param_dtype=param, reduce_dtype=reduce))
    if offload:  # ours only: native FSDP1 cannot offload on a CPU-only torch
        kwargs["cpu_offload"] = fsdp.CPUOffload(offload_params=True)
    if mesh is not None:
        kwargs["device_mesh"] = _mesh(mesh)
    model = fsdp.FullyShardedDataParallel(tiny_lm(), **kwargs)
    backward_sync = _synced if sync_every_step else _no_sync_of(model)
    return train(model, rank, world, micro, backward_sync, _fsdp1_clip)


def _synced(last: bool):
    import contextlib

    return contextlib.nullcontext()


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    from tests.world import device_type

    return init_device_mesh(device_type(), shape, mesh_dim_names=("replicate", "shard"))


def zeta(which: str, rank: int, world: int, mp: str, micro: int, shard_strat: str) -> dict:
    """Zeta's `fsdp(model, auto_wrap=True, mp=..., shard_strat=..., TransformerBlock=...)`, and
    torch's FSDP1 as Zeta's own code calls it (plus the CPU device_id it omits)."""
    if which == "ours":
        from fsdp_bridge.zeta import fsdp

        model = fsdp(tiny_lm(), auto_wrap=True, mp=mp, shard_strat=shard_strat,
                     TransformerBlock=Block)
    else:
        from torch.distributed import fsdp as F
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        dtype = {"bf16": BF16, "fp16": FP16, "fp32": FP32}[mp]
        strategy = {"FULL_SHARD": F.ShardingStrategy.FULL_SHARD,
                    "SHARD_GRAD": F.ShardingStrategy.SHARD_GRAD_OP,
                    "NO_SHARD": F.ShardingStrategy.NO_SHARD}[shard_strat]
        model = F.FullyShardedDataParallel(
            tiny_lm(), device_id=device(), sharding_strategy=strategy,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                               transformer_layer_cls={Block}),
            mixed_precision=F.MixedPrecision(param_dtype=dtype, reduce_dtype=dtype,
                                             buffer_dtype=dtype),
            backward_prefetch=F.BackwardPrefetch.BACKWARD_PRE, forward_prefetch=True,
            use_orig_params=True)
    return train(model, rank, world, micro, _no_sync_of(model), _fsdp1_clip)


def torchacc(which: str, rank: int, world: int, micro: int, fsdp_size: int) -> dict:
    """TorchAcc's `accelerate(model, config=...)` with compute.bf16, and torch's FSDP1 as
    TorchAcc's eager backend builds it (FULL_SHARD, or HYBRID_SHARD over (fsdp, dp) groups;
    param bf16, reduce and buffers fp32; outputs cast to fp32: the loss is fp32 already)."""
    if which == "ours":
        from fsdp_bridge.torchacc import Config, accelerate

        config = Config()
        config.compute.bf16 = True
        config.dist.fsdp.size = fsdp_size
        config.dist.fsdp.wrap_layer_cls = {Block.__name__}
        model = accelerate(tiny_lm(), config=config)
    else:
        from torch.distributed import fsdp as F
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        kwargs = {}
        if fsdp_size < world:  # TorchAcc's mesh: fsdp groups of consecutive ranks, dp across
            mesh = _mesh((world // fsdp_size, fsdp_size))
            kwargs = dict(process_group=(mesh.get_group("shard"), mesh.get_group("replicate")),
                          sharding_strategy=F.ShardingStrategy.HYBRID_SHARD)
        model = F.FullyShardedDataParallel(
            tiny_lm(), device_id=device(),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=F.MixedPrecision(param_dtype=BF16, reduce_dtype=FP32,
                                             buffer_dtype=FP32), **kwargs)
    return train(model, rank, world, micro, _no_sync_of(model), _fsdp1_clip)


# -- FSDP2, and YaFSDP ----------------------------------------------------------------------------


def fsdp2(which: str, rank: int, world: int, param, reduce, micro: int, reshard=True,
          offload=False, mesh=None, sync_every_step=False, loss_divisor=None,
          max_norm=MAX_NORM, per_module=False, all_reduce_last_only=False) -> dict:
    """torch's fully_shard script with either import; accumulation by
    `set_requires_gradient_sync(False)` (or every micro-step synchronised). `per_module`: only
    the first layer (and what is below it) and the root alone (`recurse=False`) accumulate;
    the other layers reduce every micro-step. `all_reduce_last_only` (HSDP): every micro-step
    reduce-scatters, only the last all-reduces over the replicas (`set_requires_all_reduce`)."""
    import importlib

    fsdp = importlib.import_module({"native": "torch.distributed.fsdp",
                                    "ours": "fsdp_bridge.fsdp"}[which])
    kwargs = dict(mp_policy=fsdp.MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce),
                  reshard_after_forward=reshard)
    if offload:
        kwargs["offload_policy"] = fsdp.CPUOffloadPolicy(pin_memory=False)
    if mesh is not None:
        kwargs["mesh"] = _mesh(mesh)
    model = tiny_lm()
    for layer in model.layers:
        fsdp.fully_shard(layer, **kwargs)
    fsdp.fully_shard(model, **kwargs)

    def backward_sync(last: bool):
        import contextlib

        if per_module and not last:
            model.layers[0].set_requires_gradient_sync(False)
            model.set_requires_gradient_sync(False, recurse=False)
        elif all_reduce_last_only:
            model.set_requires_all_reduce(last)
        else:
            model.set_requires_gradient_sync(last or sync_every_step)
        return contextlib.nullcontext()

    return train(model, rank, world, micro, backward_sync,
                 functools.partial(_torch_clip, max_norm=max_norm), loss_divisor)


def yafsdp(rank: int, world: int, param, steps: int, zero_stage=3, bit16=False,
           no_sync_micro=1) -> dict:
    """Our YaFSDP with `gradient_accumulation_steps=steps` (the loss is not divided: YaFSDP
    divides by world size x steps), and `no_sync_micro` micro-steps of no_sync inside each."""
    from fsdp_bridge.ya_fsdp import YaFSDP

    model = tiny_lm()
    model = YaFSDP(
        model, zero_stage=zero_stage, param_dtype=param, gradient_accumulation_steps=steps,
        modules_to_wrap_with_names=[(m, f"layers.{i}") for i, m in enumerate(model.layers)],
        rogue_layer_norm_modules_with_names={model.norm: "norm"},
        layer_norm_module_cls=nn.LayerNorm, bit16_reduce_scatter=bit16)

    backwards = [0]

    def backward_sync(last: bool):
        import contextlib

        backwards[0] += 1
        synced = backwards[0] % no_sync_micro == 0
        return contextlib.nullcontext() if synced else model.no_sync()

    # Norms over other layouts than native's differ in the last bits: not clipped.
    return train(model, rank, world, steps * no_sync_micro, backward_sync,
                 functools.partial(_fsdp1_clip, max_norm=NO_CLIP), loss_divisor=no_sync_micro)


def yafsdp_reference(rank: int, world: int, param, steps: int, bit16=False,
                     no_sync_micro=1) -> dict:
    """Native FSDP2 computing YaFSDP's arithmetic (see the module's note)."""
    reduce = param if bit16 else FP32
    return fsdp2("native", rank, world, param, reduce, steps * no_sync_micro,
                 sync_every_step=no_sync_micro == 1, loss_divisor=steps * no_sync_micro,
                 max_norm=NO_CLIP)


# -- the table ------------------------------------------------------------------------------------


def _pair(run, **kwargs):
    def case(rank, world):
        return {which: run(which, rank, world, **kwargs) for which in ("native", "ours")}
    return case


def _ours_vs(ours, native):
    """Our run with the settings native cannot run here, against native without them."""
    def case(rank, world):
        return {"native": native(rank, world), "ours": ours(rank, world)}
    return case


def _fsdp2_pair(**kwargs):
    def case(rank, world):
        why = fsdp2_unavailable(kwargs.get("reshard", True))
        return {"unavailable": why} if why else _pair(fsdp2, **kwargs)(rank, world)
    return case


def _yafsdp_case(param, steps, **kwargs):
    def case(rank, world):
        why = fsdp2_unavailable()
        if why:
            return {"unavailable": why}
        return {"native": yafsdp_reference(rank, world, param, steps,
                                           bit16=kwargs.get("bit16", False),
                                           no_sync_micro=kwargs.get("no_sync_micro", 1)),
                "ours": yafsdp(rank, world, param, steps, **kwargs)}
    return case


# name -> case(rank, world) -> {"native": run, "ours": run} (or {"unavailable": why}).
# A covering sample: every param dtype and reduce dtype, 1 to 4 micro-steps, each sharding
# strategy, CPU offload; each dialect's arithmetic where it differs from the others'.
WORLD2 = {
    # FSDP1: sums in param_dtype, cast once to reduce_dtype.
    "fsdp1 bf16 params, fp32 reduce, 2 micro-steps": _pair(fsdp1, param=BF16, reduce=FP32,
                                                          micro=2),
    "fsdp1 bf16/fp32, 3 micro-steps, CPU offload (native without)": _ours_vs(
        functools.partial(fsdp1, "ours", param=BF16, reduce=FP32, micro=3, offload=True),
        functools.partial(fsdp1, "native", param=BF16, reduce=FP32, micro=3)),
    "fsdp1 fp32 params, fp16 reduce, 3 micro-steps, use_orig_params": _pair(
        fsdp1, param=FP32, reduce=FP16, micro=3, use_orig_params=True),
    "fsdp1 bf16/fp16, 4 micro-steps, SHARD_GRAD_OP": _pair(fsdp1, param=BF16, reduce=FP16,
                                                          micro=4, strategy="SHARD_GRAD_OP"),
    "fsdp1 fp16/fp32, 2 micro-steps, NO_SHARD": _pair(fsdp1, param=FP16, reduce=FP32, micro=2,
                                                     strategy="NO_SHARD"),
    "fsdp1 fp32/bf16, 1 micro-step": _pair(fsdp1, param=FP32, reduce=BF16, micro=1),
    # ... except where a rank's shard is the whole gradient (NO_SHARD): a gradient kept from
    # an earlier reducing backward is reduced again with the next one.
    "fsdp1 fp16/bf16, 3 synchronised micro-steps, NO_SHARD": _pair(
        fsdp1, param=FP16, reduce=BF16, micro=3, strategy="NO_SHARD", use_orig_params=True,
        sync_every_step=True),
    "fsdp1 fp16/fp32, 2 synchronised micro-steps": _pair(fsdp1, param=FP16, reduce=FP32,
                                                        micro=2, sync_every_step=True),
    # FSDP2: sums in reduce_dtype, each gradient after the first added unrounded.
    "fsdp2 fp32 params, fp16 reduce, 3 micro-steps": _fsdp2_pair(param=FP32, reduce=FP16,
                                                                 micro=3),
    "fsdp2 fp32/bf16, 2 micro-steps, no reshard after forward": _fsdp2_pair(
        param=FP32, reduce=BF16, micro=2, reshard=False),
    "fsdp2 bf16/fp16, 4 micro-steps": _fsdp2_pair(param=BF16, reduce=FP16, micro=4),
    "fsdp2 bf16/fp32, 2 micro-steps, CPU offload": _fsdp2_pair(param=BF16, reduce=FP32,
                                                               micro=2, offload=True),
    "fsdp2 bf16/bf16, 3 micro-steps": _fsdp2_pair(param=BF16, reduce=BF16, micro=3),
    "fsdp2 fp32/fp16, 2 micro-steps, sync off for one layer and the root alone": _fsdp2_pair(
        param=FP32, reduce=FP16, micro=2, per_module=True),
    # Zeta and TorchAcc wrap with torch's FSDP1.
    "zeta bf16 FULL_SHARD, 3 micro-steps": _pair(zeta, mp="bf16", micro=3,
                                                 shard_strat="FULL_SHARD"),
    "zeta fp16 NO_SHARD, 2 micro-steps": _pair(zeta, mp="fp16", micro=2, shard_strat="NO_SHARD"),
    "torchacc bf16, 2 micro-steps": _pair(torchacc, micro=2, fsdp_size=2),
    # YaFSDP: declared steps reduce every micro-step and sum in fp32.
    "yafsdp bf16, 2 declared steps": _yafsdp_case(BF16, 2),
    "yafsdp bf16, 4 declared steps, ZeRO-2, bit16_reduce_scatter": _yafsdp_case(
        BF16, 4, zero_stage=2, bit16=True),
    "yafsdp bf16, 2 no_sync micro-steps per declared step": _yafsdp_case(
        BF16, 1, no_sync_micro=2),
}

# Hybrid sharding needs a replica dimension and a shard dimension: world 4.
WORLD4 = {
    "fsdp1 HYBRID_SHARD bf16/fp32, 2 micro-steps": _pair(fsdp1, param=BF16, reduce=FP32,
                                                        micro=2, strategy="HYBRID_SHARD",
                                                        mesh=(2, 2)),
    "fsdp2 HSDP fp32/fp16, 3 micro-steps": _fsdp2_pair(param=FP32, reduce=FP16, micro=3,
                                                       mesh=(2, 2)),
    "fsdp2 HSDP fp32/bf16, 3 micro-steps, all-reduced at the last only": _fsdp2_pair(
        param=FP32, reduce=BF16, micro=3, mesh=(2, 2), all_reduce_last_only=True),
    "torchacc bf16 hybrid (fsdp 2 x dp 2), 2 micro-steps": _pair(torchacc, micro=2,
                                                                 fsdp_size=2),
}


def differences(case: str, result: dict) -> list[str]:
    """What differs between our run and native's in `result` (empty: bit for bit the same).
    Norms are compared to 1e-6 where our layout sums them in another order than the
    reference's (YaFSDP against FSDP2)."""
    native, ours = result["native"], result["ours"]
    found = []
    if ours["losses"] != native["losses"]:
        found.append(f"{case}: losses {ours['losses']} != native {native['losses']}")
    norms, native_norms = torch.tensor(ours["norms"]), torch.tensor(native["norms"])
    if case.startswith("yafsdp") and torch.allclose(norms, native_norms, rtol=1e-6, atol=0):
        pass
    elif not torch.equal(norms, native_norms):
        found.append(f"{case}: grad norms {ours['norms']} != native {native['norms']}")
    if sorted(ours["state"]) != sorted(native["state"]):
        found.append(f"{case}: state dict keys {sorted(ours['state'])} != native "
                     f"{sorted(native['state'])}")
        return found
    found += [f"{case}: final {key} differs by up to "
              f"{(ours['state'][key].float() - value.float()).abs().max().item():.3g}"
              for key, value in native["state"].items()
              if not torch.equal(ours["state"][key], value)]
    return found


def run_cases(rank, world, names):
    table = WORLD2 if world == 2 else WORLD4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return run_case_table(table, names)
