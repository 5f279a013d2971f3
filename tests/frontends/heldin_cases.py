"""A held-in table of front-end cases (FSDP1, FSDP2, YaFSDP, Zeta, TorchAcc): bad inputs and
settings we cannot honour, each ending in a clear error or a named warning, plus cases compared
with native torch or with the single-process reference.

Kinds (the `kind` column):
- "error"     bad input: raises, naming the argument, the value received, what is accepted and
              the fix; constructor cases also check the model was left exactly as it was.
- "warning"   a setting we cannot honour: accepted with an FsdpBridgeWarning naming it.
- "plan"      accepted input: the Plan says what was asked (guards against over-refusing).
- "native"    numerics / behaviour compared with native torch on the same spawned world.
- "reference" numerics compared with the single-process reference on the global batch.

The first three run in the test process (no world needed); "native" and "reference" cases run
together in one spawned gloo world of 2 (`run_world_cases`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from tests import models as M
from tests.native_torch import fsdp2_case


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    frontend: str  # FSDP1 / FSDP2 / YaFSDP / Zeta / TorchAcc
    kind: str  # error / warning / plan / native / reference
    run: Optional[Callable[[], Any]] = None  # in-process kinds
    # error: (argument, value shown, accepted); warning: names expected in the warnings, in
    # order; plan: a predicate on the returned Plan.
    expect: Any = None


# -- models and snapshots ------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _llama():
    return M.tiny_llama()


def _fresh_llama():
    return M.tiny_llama()


def _small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _snapshot(model: nn.Module) -> dict:
    return {k: (v.device.type, v.dtype, v.detach().clone()) for k, v in model.state_dict().items()}


def untouched(build: Callable[[], nn.Module], wrap: Callable[[nn.Module], Any]):
    """A call that wraps a fresh model, expects it to raise, and checks the model afterwards is
    exactly as before (same keys, devices, dtypes, values); re-raises for the message check."""

    def call():
        model = build()
        before = _snapshot(model)
        try:
            wrap(model)
        except Exception:
            after = _snapshot(model)
            assert list(after) == list(before), "the failed wrap changed the state dict keys"
            for key, (device, dtype, value) in before.items():
                assert after[key][:2] == (device, dtype), f"{key} moved or changed dtype"
                assert torch.equal(after[key][2], value), f"{key} changed"
            raise
        raise AssertionError("no error raised")

    return call


def _cuda_device_we_lack():
    """A CUDA device this machine cannot use (all of CUDA on a CPU-only build)."""
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


def _cuda_index_we_lack():
    return 0 if not torch.cuda.is_available() else torch.cuda.device_count()


# -- FSDP1 -----------------------------------------------------------------------------------------


def _fsdp1_plan(**kwargs):
    from fsdp_bridge.fsdp import _fsdp1_translate as F1

    model = kwargs.pop("module", None) or _llama()
    return lambda: F1.build_plan(model, **kwargs)


def _fsdp1_wrap(**kwargs):
    from fsdp_bridge.fsdp import FullyShardedDataParallel

    return untouched(_small, lambda model: FullyShardedDataParallel(model, **kwargs))


def _mp(**kwargs):
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(**kwargs)


def _offload(value):
    from torch.distributed.fsdp import CPUOffload

    return CPUOffload(offload_params=value)


def _stranger_param():
    return nn.Parameter(torch.ones(3, 3))


def _layer_copy():
    return copy.deepcopy(_llama().model.layers[0])


def _ignored_head_plan():
    return _fsdp1_plan(ignored_states=[_llama().lm_head.weight])()


def _nested_inner(method: str):
    """An FSDP1 wrapper nested by hand, asked for a root-only method after the outer wrap."""
    from fsdp_bridge.fsdp import FullyShardedDataParallel as FSDP

    def call():
        model = _small()
        model[0] = FSDP(model[0])
        inner = model[0]
        root = FSDP(model)
        root(torch.randn(2, 4)).sum().backward()
        if method == "no_sync":
            with inner.no_sync():
                pass
        else:
            getattr(inner, method)(*((1.0,) if method == "clip_grad_norm_" else ()))

    return call


def _wrapped_small():
    from fsdp_bridge.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(_small())


def _summon(**kwargs):
    def call():
        from fsdp_bridge.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(_wrapped_small(), **kwargs):
            pass

    return call


def _state_dict_config(**kwargs):
    def call():
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType

        from fsdp_bridge.fsdp import FullyShardedDataParallel as FSDP

        FSDP.set_state_dict_type(_wrapped_small(), StateDictType.FULL_STATE_DICT,
                                 FullStateDictConfig(**kwargs))

    return call


FSDP1 = [
    Case("fsdp1 sync_module_states='no'", "FSDP1", "error",
         _fsdp1_plan(sync_module_states="no"), ("sync_module_states", "'no'", "True or False")),
    Case("fsdp1 use_orig_params='True'", "FSDP1", "error",
         _fsdp1_plan(use_orig_params="True"), ("use_orig_params", "'True'", "True or False")),
    Case("fsdp1 forward_prefetch='yes'", "FSDP1", "error",
         _fsdp1_plan(forward_prefetch="yes"), ("forward_prefetch", "'yes'", "True or False")),
    Case("fsdp1 limit_all_gathers=1", "FSDP1", "error",
         _fsdp1_plan(limit_all_gathers=1), ("limit_all_gathers", "1", "True or False")),
    Case("fsdp1 cast_forward_inputs='no'", "FSDP1", "error",
         _fsdp1_plan(mixed_precision=_mp(param_dtype=torch.bfloat16, cast_forward_inputs="no")),
         ("mixed_precision.cast_forward_inputs", "'no'", "True or False")),
    Case("fsdp1 cast_root_forward_inputs=0", "FSDP1", "error",
         _fsdp1_plan(mixed_precision=_mp(cast_root_forward_inputs=0)),
         ("mixed_precision.cast_root_forward_inputs", "0", "True or False")),
    Case("fsdp1 keep_low_precision_grads='false'", "FSDP1", "error",
         _fsdp1_plan(mixed_precision=_mp(keep_low_precision_grads="false")),
         ("mixed_precision.keep_low_precision_grads", "'false'", "True or False")),
    Case("fsdp1 CPUOffload(offload_params='no')", "FSDP1", "error",
         _fsdp1_plan(cpu_offload=_offload("no")),
         ("cpu_offload.offload_params", "'no'", "True or False")),
    Case("fsdp1 ignored_states: a parameter from elsewhere", "FSDP1", "error",
         lambda: _fsdp1_plan(ignored_states=[_stranger_param()])(),
         ("ignored_states[0]", "shape (3, 3)", "parameters of the module being sharded")),
    Case("fsdp1 ignored_modules: a copy of a layer", "FSDP1", "error",
         lambda: _fsdp1_plan(ignored_modules=[_layer_copy()])(),
         ("ignored_modules[0]", "LlamaDecoderLayer", "a submodule of the wrapped model")),
    Case("fsdp1 ignored_states: the model's own head", "FSDP1", "plan", _ignored_head_plan,
         lambda plan: plan.ignored_params == ("lm_head.weight",)),
    Case("fsdp1 device_id=meta leaves the model as it was", "FSDP1", "error",
         _fsdp1_wrap(device_id=torch.device("meta")), ("device_id", "device(type='meta')",
                                                       "not 'meta'")),
    Case("fsdp1 device_id='meta' string", "FSDP1", "error",
         _fsdp1_wrap(device_id="meta"), ("device_id", "'meta'", "not 'meta'")),
    Case("fsdp1 device_id=CUDA we lack", "FSDP1", "error",
         _fsdp1_wrap(device_id=_cuda_device_we_lack()),
         ("device_id", repr(_cuda_device_we_lack()), "this torch can")),
    Case("fsdp1 device_id=CUDA index we lack", "FSDP1", "error",
         _fsdp1_wrap(device_id=_cuda_index_we_lack()),
         ("device_id", str(_cuda_index_we_lack()), "CUDA")),
    Case("fsdp1 device_id=True", "FSDP1", "error", _fsdp1_wrap(device_id=True),
         ("device_id", "True", "an int CUDA index, a torch.device")),
    Case("fsdp1 device_id=-1", "FSDP1", "error", _fsdp1_wrap(device_id=-1),
         ("device_id", "-1", "a CUDA index >= 0")),
    Case("fsdp1 device_id=1.5", "FSDP1", "error", _fsdp1_wrap(device_id=1.5),
         ("device_id", "1.5", "a torch.device")),
    Case("fsdp1 device_id='gpu0'", "FSDP1", "error", _fsdp1_wrap(device_id="gpu0"),
         ("device_id", "'gpu0'", "a device string")),
    Case("fsdp1 inner.clip_grad_norm_ after the outer wrap", "FSDP1", "error",
         _nested_inner("clip_grad_norm_"), ("", "'0'", "on the root instance")),
    Case("fsdp1 inner.no_sync after the outer wrap", "FSDP1", "error", _nested_inner("no_sync"),
         ("", "'0'", "on the root instance")),
    Case("fsdp1 summon_full_params(writeback='no')", "FSDP1", "error",
         _summon(writeback="no"), ("writeback", "'no'", "True or False")),
    Case("fsdp1 summon_full_params(with_grads=1)", "FSDP1", "error",
         _summon(with_grads=1), ("with_grads", "1", "True or False")),
    Case("fsdp1 FullStateDictConfig(rank0_only='no')", "FSDP1", "error",
         _state_dict_config(rank0_only="no"),
         ("state_dict_config.rank0_only", "'no'", "True or False")),
    Case("fsdp1 FullStateDictConfig(offload_to_cpu='False')", "FSDP1", "error",
         _state_dict_config(offload_to_cpu="False"),
         ("state_dict_config.offload_to_cpu", "'False'", "True or False")),
    Case("fsdp1 limit_all_gathers=False warns", "FSDP1", "warning",
         _fsdp1_plan(limit_all_gathers=False), ["limit_all_gathers=False"]),
    Case("fsdp1 nested inner clip_grad_norm_ / no_sync vs native", "FSDP1", "native"),
    Case("fsdp1 limit_all_gathers=False trains like native", "FSDP1", "native"),
]


# -- FSDP2 -----------------------------------------------------------------------------------------


def _fsdp2_call(**overrides):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_bridge.fsdp import _fsdp2_translate as F2

    args = dict(module=nn.Linear(2, 2), mesh=None, reshard_after_forward=None,
                shard_placement_fn=None, mp_policy=MixedPrecisionPolicy(), offload_policy=None,
                ignored_params=None, dp_mesh_dims=None)
    args.update(overrides)
    return lambda: F2.check_call(**args)


def _fsdp2_bool(value):
    from fsdp_bridge.fsdp import _fsdp2_translate as F2

    return lambda: F2.flag("set_requires_gradient_sync", "requires_gradient_sync", value)


def _share(modules):
    def call():
        from fsdp_bridge.fsdp import share_comm_ctx

        share_comm_ctx(modules)

    return call


FSDP2 = [
    Case("fsdp2 reshard_after_forward='False'", "FSDP2", "error",
         _fsdp2_call(reshard_after_forward="False"), ("reshard_after_forward", "'False'",
                                                      "None, True, False")),
    Case("fsdp2 set_requires_gradient_sync('False')", "FSDP2", "error", _fsdp2_bool("False"),
         ("requires_gradient_sync", "'False'", "True or False")),
    Case("fsdp2 share_comm_ctx of a plain module", "FSDP2", "error",
         _share([nn.Linear(2, 2)]), ("modules[0]", "Linear", "FSDPModule")),
    Case("fsdp2 share_comm_ctx of fully_shard modules trains like native", "FSDP2", "native"),
]


# -- YaFSDP ----------------------------------------------------------------------------------------


def _ya_kwargs(model, **overrides):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kwargs = dict(zero_stage=3, param_dtype=torch.bfloat16,
                  modules_to_wrap_with_names=[(layer, f"model.layers.{i}")
                                              for i, layer in enumerate(model.model.layers)],
                  rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
                  layer_norm_module_cls=LlamaRMSNorm, gradient_accumulation_steps=1)
    kwargs.update(overrides)
    return kwargs


def _ya_plan(model_fn=_llama, **overrides):
    from fsdp_bridge.ya_fsdp._translate import build_plan

    def call():
        model = model_fn()
        kwargs = _ya_kwargs(model, **{k: v for k, v in overrides.items()
                                      if not callable(v) or isinstance(v, type)})
        kwargs.update({k: v(model) for k, v in overrides.items()
                       if callable(v) and not isinstance(v, type)})
        return build_plan(model, **kwargs)

    return call


def _ya_ignored(**given):
    from fsdp_bridge.ya_fsdp._translate import ignored_notes

    return lambda: ignored_notes(given)


def _ya_wrap(**kwargs):
    from fsdp_bridge.ya_fsdp import YaFSDP

    return untouched(_fresh_llama, lambda model: YaFSDP(model, **_ya_kwargs(model, **kwargs)))


def _norm_also_unit(model):
    layers = [(layer, f"model.layers.{i}") for i, layer in enumerate(model.model.layers)]
    return layers + [(model.model.norm, "model.norm")]


def _llama64():
    return M.tiny_llama().double()


def _ya_step_mid_cycle():
    """Declared accumulation of 2, but the optimizer steps after the first micro-step."""
    from fsdp_bridge.ya_fsdp import YaFSDP

    model = _small()
    wrapped = YaFSDP(model, zero_stage=3, gradient_accumulation_steps=2)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    wrapped(torch.randn(2, 4)).sum().backward()
    optimizer.step()


def _ya_other_optimizer_mid_cycle():
    """An optimizer of other parameters may step whenever it likes."""
    from fsdp_bridge.ya_fsdp import YaFSDP

    wrapped = YaFSDP(_small(), zero_stage=3, gradient_accumulation_steps=2)
    other = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    wrapped(torch.randn(2, 4)).sum().backward()
    other(torch.randn(1, 2)).sum().backward()
    optimizer.step()
    return wrapped.plan


YAFSDP = [
    Case("yafsdp sync_module_states='no'", "YaFSDP", "error", _ya_plan(sync_module_states="no"),
         ("sync_module_states", "'no'", "True or False")),
    Case("yafsdp bit16_reduce_scatter='yes'", "YaFSDP", "error",
         _ya_plan(bit16_reduce_scatter="yes"), ("bit16_reduce_scatter", "'yes'", "True or False")),
    Case("yafsdp is_trainable='False'", "YaFSDP", "error", _ya_ignored(is_trainable="False"),
         ("is_trainable", "'False'", "True or False")),
    Case("yafsdp use_yccl='no'", "YaFSDP", "error", _ya_ignored(use_yccl="no"),
         ("use_yccl", "'no'", "True or False")),
    Case("yafsdp profile=1", "YaFSDP", "error", _ya_ignored(profile=1),
         ("profile", "1", "True or False")),
    Case("yafsdp param_dtype=float64 over fp32", "YaFSDP", "error",
         _ya_plan(param_dtype=torch.float64), ("param_dtype", "torch.float64",
                                                "no wider than the model's parameters")),
    Case("yafsdp param_dtype=float64 over a float64 model", "YaFSDP", "plan",
         _ya_plan(_llama64, param_dtype=torch.float64),
         lambda plan: plan.mixed_precision.param_dtype is torch.float64),
    Case("yafsdp rogue norm that is also a unit", "YaFSDP", "error",
         _ya_plan(layer_norm_module_cls=None, modules_to_wrap_with_names=_norm_also_unit),
         ("rogue_layer_norm_modules_with_names[0]", "model.norm", "not also in "
          "modules_to_wrap_with_names")),
    Case("yafsdp layer_norm_module_cls matching a unit", "YaFSDP", "error",
         _ya_plan(rogue_layer_norm_modules_with_names=None,
                  modules_to_wrap_with_names=_norm_also_unit),
         ("layer_norm_module_cls", "LlamaRMSNorm", "not also in modules_to_wrap_with_names")),
    Case("yafsdp device_id=True", "YaFSDP", "error", _ya_wrap(device_id=True),
         ("device_id", "True", "a torch.device")),
    Case("yafsdp device_id=CUDA index we lack", "YaFSDP", "error",
         _ya_wrap(device_id=_cuda_index_we_lack()),
         ("device_id", str(_cuda_index_we_lack()), "CUDA")),
    Case("yafsdp device_id=meta", "YaFSDP", "error", _ya_wrap(device_id=torch.device("meta")),
         ("device_id", "meta", "not 'meta'")),
    Case("yafsdp device_id=CUDA we lack", "YaFSDP", "error",
         _ya_wrap(device_id=_cuda_device_we_lack()),
         ("device_id", repr(_cuda_device_we_lack()), "this torch can")),
    Case("yafsdp data_parallel_process_group='world'", "YaFSDP", "error",
         _ya_wrap(data_parallel_process_group="world"),
         ("data_parallel_process_group", "'world'", "a torch.distributed.ProcessGroup")),
    Case("yafsdp data_parallel_process_group=[0, 1]", "YaFSDP", "error",
         _ya_wrap(data_parallel_process_group=[0, 1]),
         ("data_parallel_process_group", "[0, 1]", "a torch.distributed.ProcessGroup")),
    Case("yafsdp optimizer steps inside an accumulation cycle", "YaFSDP", "error",
         _ya_step_mid_cycle, ("gradient_accumulation_steps", "2", "once every 2 backward")),
    Case("yafsdp another optimizer steps mid-cycle", "YaFSDP", "plan",
         _ya_other_optimizer_mid_cycle, lambda plan: plan.gradient_accumulation_steps == 2),
    Case("yafsdp hpz_first_layers_num=2 warns", "YaFSDP", "warning",
         _ya_ignored(hpz_first_layers_num=2), ["hpz_first_layers_num=2"]),
    Case("yafsdp accumulation of 2 stepping every 2 = reference", "YaFSDP", "reference"),
    Case("yafsdp stepping every micro-step refused on every rank", "YaFSDP", "reference"),
]


# -- Zeta ------------------------------------------------------------------------------------------


def _zeta(**kwargs):
    from fsdp_bridge.zeta import _translate as Z

    return lambda: Z.build_plan(_llama(), **kwargs)


def _gpt2_block():
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return GPT2Block


ZETA = [
    Case("zeta TransformerBlock absent (GPT2Block in Llama)", "Zeta", "error",
         lambda: _zeta(auto_wrap=True, TransformerBlock=_gpt2_block())(),
         ("TransformerBlock", "GPT2Block", "a class with instances in the model")),
    Case("zeta TransformerBlock absent (nn.TransformerEncoderLayer)", "Zeta", "error",
         _zeta(auto_wrap=True, TransformerBlock=nn.TransformerEncoderLayer),
         ("TransformerBlock", "TransformerEncoderLayer", "LlamaDecoderLayer")),
    Case("zeta auto_wrap='no'", "Zeta", "error", _zeta(auto_wrap="no"),
         ("auto_wrap", "'no'", "True or False")),
    Case("zeta mp='BF16'", "Zeta", "error", _zeta(mp="BF16"), ("mp", "'BF16'", "'bf16'")),
    Case("zeta shard_strat='full_shard' (any case)", "Zeta", "plan",
         _zeta(shard_strat="full_shard"), lambda plan: plan.mode.value == "shard"),
    Case("zeta auto_wrap with the model's block trains like the reference", "Zeta", "reference"),
]


# -- TorchAcc --------------------------------------------------------------------------------------


def _config(**changes):
    from fsdp_bridge.torchacc import Config

    config = Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}
    for path, value in changes.items():
        target = config
        parts = path.split("__")
        for part in parts[:-1]:
            target = getattr(target, part)
        setattr(target, parts[-1], value)
    return config


def _acc(**changes):
    from fsdp_bridge.torchacc import _translate as TA

    return lambda: TA.build_plan(_llama(), _config(**changes), 2)


TORCHACC = [
    Case("torchacc compute.bf16='no'", "TorchAcc", "error", _acc(compute__bf16="no"),
         ("compute.bf16", "'no'", "True or False")),
    Case("torchacc compute.fp16='False'", "TorchAcc", "error", _acc(compute__fp16="False"),
         ("compute.fp16", "'False'", "True or False")),
    Case("torchacc dist.fsdp.sync_module_states='no'", "TorchAcc", "error",
         _acc(dist__fsdp__sync_module_states="no"),
         ("dist.fsdp.sync_module_states", "'no'", "True or False")),
    Case("torchacc dist.fsdp.flatten_parameters='yes'", "TorchAcc", "error",
         _acc(dist__fsdp__flatten_parameters="yes"),
         ("dist.fsdp.flatten_parameters", "'yes'", "True or False")),
    Case("torchacc dist.fsdp.use_spmd=1", "TorchAcc", "error", _acc(dist__fsdp__use_spmd=1),
         ("dist.fsdp.use_spmd", "1", "True or False")),
    Case("torchacc memory.gc='off'", "TorchAcc", "error", _acc(memory__gc="off"),
         ("memory.gc", "'off'", "True or False")),
    Case("torchacc compute.acc_scaled_dot_attn='no'", "TorchAcc", "error",
         _acc(compute__acc_scaled_dot_attn="no"),
         ("compute.acc_scaled_dot_attn", "'no'", "True or False")),
    Case("torchacc compute.disable_kernel_patches='no'", "TorchAcc", "error",
         _acc(compute__disable_kernel_patches="no"),
         ("compute.disable_kernel_patches", "'no'", "True or False")),
    Case("torchacc backend='xla'", "TorchAcc", "error", _acc(backend="xla"),
         ("backend", "'xla'", "'eager' or 'lazy'")),
    Case("torchacc backend='lazy' warns", "TorchAcc", "warning", _acc(backend="lazy"),
         ["backend='lazy'"]),
    Case("torchacc dataloader.buckets warns", "TorchAcc", "warning",
         _acc(dataloader__buckets=[8, 16]), ["dataloader.buckets=[8, 16]"]),
    Case("torchacc max_length + num_buckets warn", "TorchAcc", "warning",
         _acc(dataloader__max_length=64, dataloader__num_buckets=4),
         ["dataloader.num_buckets=4", "dataloader.max_length=64"]),
    Case("torchacc pad_value_dict warns", "TorchAcc", "warning",
         _acc(dataloader__pad_value_dict={"input_ids": 0}), ["dataloader.pad_value_dict="]),
    Case("torchacc compute.bf16=True", "TorchAcc", "plan", _acc(compute__bf16=True),
         lambda plan: plan.mixed_precision.param_dtype is torch.bfloat16),
    Case("torchacc backend='lazy' + buckets train like the reference", "TorchAcc", "reference"),
]

CASES = FSDP1 + FSDP2 + YAFSDP + ZETA + TORCHACC
IN_PROCESS = [case for case in CASES if case.run is not None]
IN_WORLD = [case.name for case in CASES if case.run is None]


# -- cases in one spawned world of 2 --------------------------------------------------------------

STEPS = 3
GLOBAL_BATCH = 8


def _batches():
    return M.global_batches(STEPS, GLOBAL_BATCH)


def _train(rank, world, model, micro_steps=1, divide_loss=True, batches=None):
    optimizer = M.make_adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in batches if batches is not None else _batches():
        total = 0.0
        for ids in M.rank_slice(batch, rank, world).chunk(micro_steps):
            loss = M.lm_loss(model, ids)
            (loss / micro_steps if divide_loss else loss).backward()
            total += loss.item() / micro_steps
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(total))
    return losses


def _fsdp(which):
    import importlib

    return importlib.import_module({"native": "torch.distributed.fsdp",
                                    "ours": "fsdp_bridge.fsdp"}[which])


def _nested_vs_native(rank, world):
    result = {}
    for which in ("native", "ours"):
        fsdp = _fsdp(which)
        cpu = torch.device("cpu")
        model = M.tiny_llama()
        model.model.layers[0] = fsdp.FullyShardedDataParallel(model.model.layers[0], device_id=cpu)
        inner = model.model.layers[0]
        root = fsdp.FullyShardedDataParallel(model, device_id=cpu)
        M.lm_loss(root, M.rank_slice(_batches()[0], rank, world)).backward()
        errors = []
        for call in (lambda: inner.clip_grad_norm_(1.0), lambda: inner.no_sync().__enter__()):
            try:
                call()
                errors.append(None)
            except RuntimeError as exc:
                errors.append(("RuntimeError", "root" in str(exc)))
        result[which] = {"errors": errors, "root_norm": float(root.clip_grad_norm_(1.0))}
    return result


def _limit_all_gathers_vs_native(rank, world):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    result = {}
    for which in ("native", "ours"):
        fsdp = _fsdp(which)
        policy = fsdp.wrap.ModuleWrapPolicy({LlamaDecoderLayer})
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            model = fsdp.FullyShardedDataParallel(M.tiny_llama(), auto_wrap_policy=policy,
                                                  device_id=torch.device("cpu"),
                                                  limit_all_gathers=False)
        named = [str(w.message) for w in record if "limit_all_gathers=False" in str(w.message)]
        result[which] = {"losses": _train(rank, world, model), "warned": bool(named)}
    return result


def _share_comm_ctx_vs_native(rank, world):
    if not hasattr(_fsdp("native"), "share_comm_ctx"):
        return {"unavailable": f"torch {torch.__version__} has no "
                               "torch.distributed.fsdp.share_comm_ctx"}
    result = {}
    for which in ("native", "ours"):
        fsdp = _fsdp(which)
        model = M.tiny_llama()
        for layer in model.model.layers:
            fsdp.fully_shard(layer)
        fsdp.fully_shard(model)
        fsdp.share_comm_ctx([model.model.layers[0], model])
        result[which] = {"losses": _train(rank, world, model)}
    return result


def _yafsdp_declared_accumulation(rank, world):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fsdp_bridge.ya_fsdp import YaFSDP

    model = M.tiny_llama()
    wrapped = YaFSDP(model, zero_stage=3, param_dtype=torch.float32,
                     modules_to_wrap_with_names=[(layer, f"model.layers.{i}")
                                                 for i, layer in enumerate(model.model.layers)],
                     rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
                     layer_norm_module_cls=LlamaRMSNorm, gradient_accumulation_steps=2)
    return {"ours": _train(rank, world, wrapped, micro_steps=2, divide_loss=False)}


def _yafsdp_step_every_micro_step(rank, world):
    from fsdp_bridge.ya_fsdp import YaFSDP

    wrapped = YaFSDP(M.tiny_llama(), zero_stage=3, gradient_accumulation_steps=2)
    optimizer = M.make_adamw(wrapped.parameters())
    M.lm_loss(wrapped, M.rank_slice(_batches()[0], rank, world)).backward()
    try:
        optimizer.step()
    except RuntimeError as exc:
        return {"ours": str(exc)}
    return {"ours": None}


def _zeta_blocks(rank, world):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_bridge.zeta import fsdp

    model = fsdp(M.tiny_llama(), auto_wrap=True, shard_strat="FULL_SHARD",
                 TransformerBlock=LlamaDecoderLayer)
    return {"ours": _train(rank, world, model), "units": len(model.plan.units)}


def _torchacc_lazy_buckets(rank, world):
    from fsdp_bridge import torchacc

    config = _config(backend="lazy", dataloader__buckets=[8, 16])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model, loader = torchacc.accelerate(M.tiny_llama(), list(_batches()), config)
    named = sorted({m for w in record for m in ("backend='lazy'", "dataloader.buckets")
                    if m in str(w.message)})
    optimizer = M.make_adamw(model.parameters())
    losses = []
    for ids in loader:
        loss = M.lm_loss(model, ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(loss.item()))
    return {"ours": losses, "warned": named}


WORLD_CASES = {
    "fsdp1 nested inner clip_grad_norm_ / no_sync vs native": _nested_vs_native,
    "fsdp1 limit_all_gathers=False trains like native": _limit_all_gathers_vs_native,
    "fsdp2 share_comm_ctx of fully_shard modules trains like native":
        fsdp2_case(_share_comm_ctx_vs_native),
    "yafsdp accumulation of 2 stepping every 2 = reference": _yafsdp_declared_accumulation,
    "yafsdp stepping every micro-step refused on every rank": _yafsdp_step_every_micro_step,
    "zeta auto_wrap with the model's block trains like the reference": _zeta_blocks,
    "torchacc backend='lazy' + buckets train like the reference": _torchacc_lazy_buckets,
}


def run_world_cases(rank: int, world: int) -> dict:
    """Every world case on this rank; a failing case records its traceback, the rest go on."""
    import traceback

    results = {}
    for name, case in WORLD_CASES.items():
        try:
            results[name] = case(rank, world)
        except Exception:  # noqa: BLE001 - reported by the parent, per case
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    return results
