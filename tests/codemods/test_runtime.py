"""The runtime helpers' pure parts (no processes): FSDP1 unit selection, option mapping, errors."""

import functools

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import (
    FullStateDictConfig,
    MixedPrecision,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from fsdp_bridge.migrate.runtime import (
    _yafsdp_reduces_in_param_dtype,
    fsdp1_state_dict_options,
    fsdp1_units,
    yafsdp_modules_to_wrap,
    yafsdp_zero_stage,
)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def _model():
    return nn.Sequential(Block(), Block(), nn.Linear(4, 2))


def test_units_children_first_root_excluded():
    model = _model()
    for policy in (ModuleWrapPolicy({Block}),
                   functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})):
        assert [m for m, _ in fsdp1_units(model, policy)] == [model[0], model[1]]
    linears = [m for m, _ in fsdp1_units(model, ModuleWrapPolicy({nn.Linear}))]
    assert linears == [model[0].a, model[0].b, model[1].a, model[1].b, model[2]]


def test_size_based_policy_follows_fsdp1_recursion():
    model = _model()
    policy = functools.partial(size_based_auto_wrap_policy, min_num_params=30)
    # Each Block holds 40 parameters (>= 30) but each Linear only 20: FSDP1 wraps the Blocks.
    assert [m for m, _ in fsdp1_units(model, policy)] == [model[0], model[1]]


def test_custom_policy_overrides_are_returned():
    model = _model()
    policy = CustomPolicy(lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if m is model[1] else False)
    assert fsdp1_units(model, policy) == [(model[1], {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP})]


def test_yafsdp_refuses_custom_policy_keyword_dicts():
    model = _model()
    policy = CustomPolicy(lambda m: {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP} if m is model[1] else False)
    with pytest.raises(ValueError, match="CustomPolicy sets sharding_strategy for module '1'"):
        yafsdp_modules_to_wrap(model, policy)
    # Flags FSDP2 and YaFSDP schedule themselves are not settings that vary per module.
    prefetch_only = CustomPolicy(lambda m: {"limit_all_gathers": True} if m is model[1] else False)
    assert yafsdp_modules_to_wrap(model, prefetch_only) == [(model[1], "1")]


def test_yafsdp_reduce_dtype_follows_fsdp1():
    bf16, fp32 = torch.bfloat16, torch.float32
    # FSDP1 reduces in param_dtype when reduce_dtype is unset: YaFSDP's bit16_reduce_scatter.
    assert _yafsdp_reduces_in_param_dtype(MixedPrecision(param_dtype=bf16)) is True
    assert _yafsdp_reduces_in_param_dtype(MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)) is True
    assert _yafsdp_reduces_in_param_dtype(MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)) is False
    assert _yafsdp_reduces_in_param_dtype(None) is False
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float16\) with param_dtype=torch.bfloat16"):
        _yafsdp_reduces_in_param_dtype(MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float16))


def test_yafsdp_mapping():
    model = _model()
    assert yafsdp_zero_stage(None) == 3 and yafsdp_zero_stage(ShardingStrategy.SHARD_GRAD_OP) == 2
    with pytest.raises(ValueError, match="HYBRID_SHARD has no YaFSDP zero_stage"):
        yafsdp_zero_stage(ShardingStrategy.HYBRID_SHARD)
    assert yafsdp_modules_to_wrap(model, ModuleWrapPolicy({Block})) == [(model[0], "0"), (model[1], "1")]


def test_state_dict_options():
    exact = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    full = fsdp1_state_dict_options(StateDictType.FULL_STATE_DICT, exact)
    assert full.full_state_dict and full.cpu_offload
    with pytest.warns(UserWarning, match="state_dict_config: offload_to_cpu=False with rank0_only=True"):
        fsdp1_state_dict_options(StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True))
    sharded = fsdp1_state_dict_options(StateDictType.SHARDED_STATE_DICT)
    assert not sharded.full_state_dict and not sharded.cpu_offload
    # Sharded stays sharded, offloaded where FSDP1 offloads (its optimizer configs do by default).
    offloaded = fsdp1_state_dict_options(StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(offload_to_cpu=True))
    assert not offloaded.full_state_dict and offloaded.cpu_offload
    optim = fsdp1_state_dict_options(StateDictType.SHARDED_STATE_DICT, for_optimizer=True)
    assert not optim.full_state_dict and optim.cpu_offload
    with pytest.raises(ValueError, match="LOCAL_STATE_DICT has no FSDP2 form"):
        fsdp1_state_dict_options(StateDictType.LOCAL_STATE_DICT)


def test_bad_policy_names_the_argument():
    with pytest.raises(TypeError, match="auto_wrap_policy=42 is not a wrap policy"):
        fsdp1_units(_model(), 42)


def test_custom_policy_override_that_cannot_be_honoured_is_an_error():
    import torch

    from fsdp_bridge.migrate.runtime import _check_overrides

    _check_overrides({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP, "backward_prefetch": None})
    with pytest.raises(ValueError, match="sets param_init_fn, sync_module_states for one module"):
        _check_overrides({"param_init_fn": lambda m: None, "sync_module_states": True, "mixed_precision": None})
    assert torch  # the helpers import torch only


def test_helpers_leave_modules_without_fsdp2_units_alone():
    from fsdp_bridge.migrate.runtime import fsdp1_load_state_dict, fsdp1_state_dict, fsdp1_unwrap

    model = _model()
    state = fsdp1_state_dict(model)
    assert state.keys() == model.state_dict().keys()
    assert fsdp1_load_state_dict(model, state).missing_keys == []
    partial_state = {k: v for k, v in state.items() if not k.endswith("bias")}
    assert fsdp1_load_state_dict(model, partial_state, strict=False).missing_keys == [
        k for k in state if k.endswith("bias")]
    with pytest.raises(RuntimeError, match="Missing key"):
        fsdp1_load_state_dict(model, partial_state)

    class Wrapper(nn.Module):  # DDP-like: the model lives in .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    assert fsdp1_unwrap(Wrapper(model)) is model
