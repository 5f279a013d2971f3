"""Invalid inputs across the five front-ends (FSDP1, FSDP2, YaFSDP, Zeta, TorchAcc), table-driven
and without processes: each raises an error naming the argument, the value received and what is
accepted (and giving a fix). Also: every ignored setting warns once, by name."""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy, transformer_auto_wrap_policy

from fsdp_bridge.fsdp import _fsdp1_translate as F1
from fsdp_bridge.fsdp import _fsdp2_translate as F2
from fsdp_bridge.fsdp.fully_sharded_data_parallel import resolve_device, resolve_groups
from fsdp_bridge.torchacc import Config
from fsdp_bridge.torchacc import _translate as TA
from fsdp_bridge.translation import FsdpBridgeWarning
from fsdp_bridge.wrapper import ShardedWrapper
from fsdp_bridge.ya_fsdp._translate import build_plan as ya_build_plan
from fsdp_bridge.zeta import _translate as Z
from tests import models as M
from tests.test_yafsdp_translate import _bad_cases as yafsdp_bad_cases
from tests.test_yafsdp_translate import kwargs_for as yafsdp_kwargs

LLAMA = M.tiny_llama()
GPT2 = M.tiny_gpt2()
LAYERS = list(LLAMA.model.layers)


def _layer_cls():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    return LlamaDecoderLayer


def fsdp1(**kwargs):
    return lambda: F1.build_plan(kwargs.pop("module", LLAMA), **kwargs)


def _custom(override):
    return CustomPolicy(lambda m: override if isinstance(m, _layer_cls()) else False)


def _batchnorm_case():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    return lambda: F1.build_plan(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))


def _fsdp2(**overrides):
    args = dict(module=nn.Linear(2, 2), mesh=None, reshard_after_forward=None,
                shard_placement_fn=None, mp_policy=MixedPrecisionPolicy(),
                offload_policy=None, ignored_params=None, dp_mesh_dims=None)
    args.update(overrides)
    return lambda: F2.check_call(**args)


def _torchacc(world=2, **changes):
    config = Config()
    config.dist.fsdp.size = 2
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    for path, value in changes.items():
        target = config
        parts = path.split("__")
        for part in parts[:-1]:
            target = getattr(target, part)
        setattr(target, parts[-1], value)
    return lambda: TA.build_plan(GPT2, config, world)


def _summon_rank0_writeback():
    with ShardedWrapper.summon_full_params(LLAMA, rank0_only=True, writeback=True):
        pass


def _shard5(param):
    from torch.distributed.tensor import Shard
    return Shard(5)


# (call, argument named, value shown, what is accepted)
CASES = [
    # -- FSDP1 ------------------------------------------------------------------------------
    (fsdp1(sharding_strategy="FULLSHARD"), "sharding_strategy", "'FULLSHARD'", "ShardingStrategy"),
    (fsdp1(sharding_strategy=3), "sharding_strategy", "3", "ShardingStrategy"),
    (fsdp1(mixed_precision="bf16"), "mixed_precision", "'bf16'", "MixedPrecision"),
    (fsdp1(mixed_precision=MixedPrecision(param_dtype=torch.int8)),
     "mixed_precision.param_dtype", "torch.int8", "a floating torch.dtype"),
    (fsdp1(mixed_precision=MixedPrecision(reduce_dtype="fp32")),
     "mixed_precision.reduce_dtype", "'fp32'", "a floating torch.dtype"),
    (fsdp1(mixed_precision=MixedPrecision(buffer_dtype=torch.int64)),
     "mixed_precision.buffer_dtype", "torch.int64", "a floating torch.dtype"),
    (fsdp1(cpu_offload=True), "cpu_offload", "True", "CPUOffload"),
    (fsdp1(backward_prefetch="pre"), "backward_prefetch", "'pre'", "BackwardPrefetch"),
    (fsdp1(auto_wrap_policy="transformer"), "auto_wrap_policy", "'transformer'", "policy"),
    (fsdp1(auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                              transformer_layer_cls={None})),
     "auto_wrap_policy", "functools.partial", "a policy that can be evaluated"),
    (fsdp1(ignored_modules=[LLAMA.lm_head], ignored_states=[LLAMA.lm_head]), "ignored_states",
     "<given together with ignored_modules>", "only one of ignored_modules and ignored_states"),
    (fsdp1(ignored_modules=[nn.Linear(2, 2)]), "ignored_modules[0]", "Linear",
     "a submodule of the wrapped model"),
    (fsdp1(ignored_modules=["lm_head"]), "ignored_modules[0]", "'lm_head'", "an nn.Module"),
    (fsdp1(ignored_modules=5), "ignored_modules", "5", "an iterable of modules"),
    (fsdp1(ignored_states=[LLAMA.lm_head, LLAMA.lm_head.weight]), "ignored_states", "Linear",
     "all parameters or all modules"),
    (fsdp1(sync_module_states="yes"), "sync_module_states", "'yes'", "True or False"),
    (fsdp1(use_orig_params=None), "use_orig_params", "None", "True or False"),
    (fsdp1(auto_wrap_policy=_custom({"sharding_strategy": ShardingStrategy.NO_SHARD})),
     "sharding_strategy", "NO_SHARD", "a strategy of the root's mode"),
    (fsdp1(auto_wrap_policy=_custom({"cpu_offload": CPUOffload(offload_params=True)})),
     "cpu_offload", "CPUOffload(offload_params=True)", "the root's value"),
    (_batchnorm_case(), "mixed_precision._module_classes_to_ignore", "_BatchNorm",
     "classes the model does not contain"),
    (fsdp1(module="model"), "module", "'model'", "an nn.Module"),
    (lambda: resolve_device("banana"), "device_id", "'banana'", "a torch.device"),
    (lambda: resolve_device(3) if not torch.cuda.is_available() else resolve_device(1.5),
     "device_id", "3" if not torch.cuda.is_available() else "1.5", "a torch.device"),
    (lambda: resolve_groups(ShardingStrategy.HYBRID_SHARD, ("a", "b"), None, None),
     "process_group", "('a', 'b')", "a tuple (shard_group, replicate_group)"),
    (lambda: resolve_groups(ShardingStrategy.FULL_SHARD, "pg", None, None), "process_group",
     "'pg'", "one ProcessGroup"),
    (lambda: resolve_groups(ShardingStrategy.FULL_SHARD, "pg", "mesh", None), "device_mesh",
     "'mesh'", "only one of process_group and device_mesh"),
    (lambda: resolve_groups(ShardingStrategy.FULL_SHARD, None, "mesh", None), "device_mesh",
     "'mesh'", "a DeviceMesh"),
    (lambda: ShardedWrapper.set_state_dict_type(LLAMA, "LOCAL_STATE_DICT"),
     "state_dict_type", "'LOCAL_STATE_DICT'", "a StateDictType"),
    (_summon_rank0_writeback, "writeback", "True", "False when rank0_only=True"),
    # -- FSDP2 ------------------------------------------------------------------------------
    (_fsdp2(module="x"), "module", "'x'", "an nn.Module"),
    (_fsdp2(module=nn.ModuleList([nn.Linear(2, 2)])), "module", "ModuleList",
     "a module that implements forward"),
    (_fsdp2(module=[]), "module", "[]", "a non-empty list"),
    (_fsdp2(module=[nn.Linear(2, 2), "b"]), "module[1]", "'b'", "an nn.Module"),
    (_fsdp2(mesh="cpu"), "mesh", "'cpu'", "a DeviceMesh"),
    (_fsdp2(reshard_after_forward="yes"), "reshard_after_forward", "'yes'", "None, True, False"),
    (_fsdp2(reshard_after_forward=3), "reshard_after_forward", "3", "an int >= 1 dividing"),
    (_fsdp2(reshard_after_forward=0), "reshard_after_forward", "0", "an int >= 1 dividing"),
    (_fsdp2(mp_policy=MixedPrecision()), "mp_policy", "MixedPrecision(", "MixedPrecisionPolicy"),
    (_fsdp2(mp_policy=MixedPrecisionPolicy(param_dtype=torch.int32)), "mp_policy.param_dtype",
     "torch.int32", "a floating torch.dtype"),
    (_fsdp2(mp_policy=MixedPrecisionPolicy(output_dtype="fp32")), "mp_policy.output_dtype",
     "'fp32'", "a floating torch.dtype"),
    (_fsdp2(offload_policy=CPUOffload()), "offload_policy", "CPUOffload(", "CPUOffloadPolicy"),
    (_fsdp2(ignored_params=[1, 2]), "ignored_params", "[1, 2]", "a set of nn.Parameter"),
    (_fsdp2(dp_mesh_dims=("dp",)), "dp_mesh_dims", "('dp',)", "None"),
    (lambda: F2.shard_dim(_shard5, _shard5(None), torch.nn.Parameter(torch.zeros(2, 2)), "w",
                          (2, 2), 2),
     "shard_placement_fn", "_shard5", "Shard(d) with d a dim of the parameter"),
    (lambda: F2.check_factor(0), "factor", "0", "a positive number"),
    (lambda: F2.flag("set_requires_gradient_sync", "requires_gradient_sync", "no"),
     "requires_gradient_sync", "'no'", "True or False"),
    (lambda: F2.flag("set_is_last_backward", "is_last_backward", torch.ones(2)),
     "is_last_backward", "tensor([1., 1.])", "True or False"),
    (lambda: F2.check_bool("set_reshard_after_forward", "reshard_after_forward", 1),
     "reshard_after_forward", "1", "True or False (a bool)"),
    # -- Zeta -------------------------------------------------------------------------------
    (lambda: Z.build_plan(LLAMA, mp="bf32"), "mp", "'bf32'", "'bf16', 'fp16' or 'fp32'"),
    (lambda: Z.build_plan(LLAMA, mp=torch.bfloat16), "mp", "torch.bfloat16", "'bf16'"),
    (lambda: Z.build_plan(LLAMA, shard_strat="SHARD"), "shard_strat", "'SHARD'", "SHARD_GRAD_OP"),
    (lambda: Z.build_plan(LLAMA, shard_strat=1), "shard_strat", "1", "'FULL_SHARD'"),
    (lambda: Z.build_plan(LLAMA, auto_wrap=True), "TransformerBlock", "None",
     "an nn.Module subclass when auto_wrap=True"),
    (lambda: Z.build_plan(LLAMA, auto_wrap="yes"), "auto_wrap", "'yes'", "True or False"),
    (lambda: Z.build_plan(LLAMA, auto_wrap=True, TransformerBlock="Block"), "TransformerBlock",
     "'Block'", "an nn.Module subclass"),
    (lambda: Z.build_plan(None), "model", "None", "an nn.Module"),
    # -- TorchAcc ---------------------------------------------------------------------------
    (_torchacc(dist__fsdp__size=3), "dist.fsdp.size", "3", "a divisor of the world size"),
    (_torchacc(dist__fsdp__size=0), "dist.fsdp.size", "0", "an int >= 1"),
    (_torchacc(dist__tp__size=2), "dist.tp.size", "2", "1 (only data parallelism"),
    (_torchacc(dist__pp__size=2), "dist.pp.size", "2", "1 (only data parallelism"),
    (_torchacc(compute__bf16=True, compute__fp16=True), "compute.fp16", "True",
     "False when compute.bf16 is True"),
    (_torchacc(dist__fsdp__wrap_layer_cls={"GPT2Blok"}), "dist.fsdp.wrap_layer_cls",
     "GPT2Blok", "names of module classes in the model"),
    (_torchacc(dist__fsdp__wrap_layer_cls="GPT2Block"), "dist.fsdp.wrap_layer_cls",
     "'GPT2Block'", "a set of class names"),
    # A class, or a set of classes, where TorchAcc takes names: the fix names them.
    (_torchacc(dist__fsdp__wrap_layer_cls=type(GPT2.transformer.h[0])), "dist.fsdp.wrap_layer_cls",
     "GPT2Block", "Pass the classes' names: config.dist.fsdp.wrap_layer_cls = {'GPT2Block'}"),
    (_torchacc(dist__fsdp__wrap_layer_cls={type(GPT2.transformer.h[0])}), "dist.fsdp.wrap_layer_cls",
     "GPT2Block", "Pass the classes' names: config.dist.fsdp.wrap_layer_cls = {'GPT2Block'}"),
    (_torchacc(dist__dp__size=3), "dist.dp.size", "3", "world / fsdp.size"),
    (lambda: TA.build_plan(GPT2, {"fsdp": 2}, 2), "config", "{'fsdp': 2}", "a torchacc.Config"),
]

YAFSDP_CASES = [
    (lambda o=overrides: ya_build_plan(LLAMA, **yafsdp_kwargs(LLAMA, **o)), argument, value,
     accepted)
    for overrides, argument, value, accepted in yafsdp_bad_cases(LLAMA)
]

ALL = CASES + YAFSDP_CASES


def test_at_least_forty_across_five_frontends():
    assert len(ALL) >= 40
    assert len(YAFSDP_CASES) >= 10 and len(CASES) >= 50


@pytest.mark.parametrize("index", range(len(ALL)))
def test_invalid_input_names_argument_value_and_accepted(index):
    call, argument, value, accepted = ALL[index]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises((ValueError, TypeError)) as info:
            call()
    message = str(info.value)
    assert f"{argument}=" in message, message
    assert value in message, message
    assert accepted in message, message
    assert re.search(r"\.\s+\S", message), f"no fix given: {message}"


# -- ignored settings warn once, by name ----------------------------------------------------------


def _warnings_of(call):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in record if issubclass(w.category, FsdpBridgeWarning)]


@pytest.mark.parametrize("call, names", [
    (fsdp1(backward_prefetch=BackwardPrefetch.BACKWARD_POST, limit_all_gathers=False,
           mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                          keep_low_precision_grads=True)),
     ["backward_prefetch=", "limit_all_gathers=", "keep_low_precision_grads="]),
    (fsdp1(backward_prefetch=None), ["backward_prefetch=None"]),
    (fsdp1(forward_prefetch=True, limit_all_gathers=True), []),  # honoured: silent
    (_torchacc(dist__fsdp__use_spmd=True, dist__fsdp__flatten_parameters=False,
               dist__fsdp__shard_output_callable=print, compute__acc_scaled_dot_attn=True,
               memory__gc=True),
     ["flatten_parameters", "use_spmd", "shard_output_callable", "acc_scaled_dot_attn",
      "memory.gc"]),
    (_torchacc(), []),
])
def test_ignored_settings_warn_once_by_name(call, names):
    messages = _warnings_of(call)
    assert len(messages) == len(names), messages
    for name, message in zip(names, messages):
        assert name in message and "ignored" in message, message


def test_fsdp2_int_reshard_warns_once_by_name():
    messages = _warnings_of(lambda: F2._reshard(2, False, 4))
    assert len(messages) == 1 and "reshard_after_forward=<int>=2" in messages[0], messages
    assert _warnings_of(lambda: F2._reshard(4, False, 4)) == []  # == shard size: honoured
