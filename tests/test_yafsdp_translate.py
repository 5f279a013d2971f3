"""YaFSDP arguments -> Plan, without processes: the translation and its error messages."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from fsdp_bridge.plan import ShardingMode
from fsdp_bridge.translation import FsdpBridgeWarning
from fsdp_bridge.ya_fsdp._translate import TABLE, build_plan, ignored_notes
from tests import models as M


@pytest.fixture(scope="module")
def llama():
    return M.tiny_llama()


def kwargs_for(model, **overrides):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kwargs = dict(
        zero_stage=3,
        param_dtype=torch.bfloat16,
        modules_to_wrap_with_names=[(layer, f"model.layers.{i}")
                                    for i, layer in enumerate(model.model.layers)],
        rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
        layer_norm_module_cls=LlamaRMSNorm,
        gradient_accumulation_steps=2,
    )
    kwargs.update(overrides)
    return kwargs


def test_translation(llama):
    plan = build_plan(llama, **kwargs_for(llama))
    assert plan.unit_names == ("model.layers.0", "model.layers.1", "model.layers.2", "")
    assert all(u.reshard_after_forward for u in plan.units)
    assert plan.mode is ShardingMode.SHARD
    assert plan.mixed_precision.param_dtype is torch.bfloat16
    assert plan.mixed_precision.reduce_dtype is torch.float32  # YaFSDP reduces in fp32
    assert plan.gradient_accumulation_steps == 2
    assert "model.norm" in plan.norm_modules
    assert "model.layers.0.input_layernorm" in plan.norm_modules
    zero2 = build_plan(llama, **kwargs_for(llama, zero_stage=2, bit16_reduce_scatter=True))
    assert not any(u.reshard_after_forward for u in zero2.units)
    assert zero2.mixed_precision.reduce_dtype is torch.bfloat16
    assert "model.layers.1 (reshard-after-forward)" in str(plan)


def _bad_cases(model):
    layers = model.model.layers
    outsider = nn.Linear(2, 2)
    return [
        # (overrides, argument named, value shown, what is accepted)
        (dict(zero_stage=1), "zero_stage", "1", "3 (ZeRO-3"),
        (dict(zero_stage="3"), "zero_stage", "'3'", "3 (ZeRO-3"),
        (dict(zero_stage=True), "zero_stage", "True", "3 (ZeRO-3"),
        (dict(param_dtype=torch.int32), "param_dtype", "torch.int32", "a floating torch.dtype"),
        (dict(param_dtype="bf16"), "param_dtype", "'bf16'", "a floating torch.dtype"),
        (dict(gradient_accumulation_steps=0), "gradient_accumulation_steps", "0", "an int >= 1"),
        (dict(gradient_accumulation_steps=1.5), "gradient_accumulation_steps", "1.5", "an int >= 1"),
        (dict(modules_to_wrap_with_names=[(layers[0], "model.layers.0"), (layers[0], "model.layers.0")]),
         "modules_to_wrap_with_names[1]", "model.layers.0", "each module listed once"),
        (dict(modules_to_wrap_with_names=[(outsider, "extra")]),
         "modules_to_wrap_with_names[0]", "Linear", "a submodule of the wrapped model"),
        (dict(modules_to_wrap_with_names=[(layers[1], "model.layers.0")]),
         "modules_to_wrap_with_names[0]", "model.layers.0", "the module's path in the model, here 'model.layers.1'"),
        (dict(modules_to_wrap_with_names=[layers[0]]),
         "modules_to_wrap_with_names[0]", "LlamaDecoderLayer", "a (module, name) pair"),
        (dict(rogue_layer_norm_modules_with_names={model.model.norm: "norm"}),
         "rogue_layer_norm_modules_with_names[0]", "'norm'", "here 'model.norm'"),
        (dict(layer_norm_module_cls="LlamaRMSNorm"), "layer_norm_module_cls", "'LlamaRMSNorm'",
         "an nn.Module subclass"),
    ]


def test_bad_inputs_name_argument_value_and_accepted(llama):
    for overrides, argument, value, accepted in _bad_cases(llama):
        with pytest.raises((ValueError, TypeError)) as info:
            build_plan(llama, **kwargs_for(llama, **overrides))
        message = str(info.value)
        assert f"{argument}=" in message, message
        assert value in message, message
        assert accepted in message, message
        assert re.search(r"\.\s+\S", message), f"no fix given: {message}"


def test_ignored_settings_warn_once_by_name():
    with pytest.warns(FsdpBridgeWarning) as record:
        notes = ignored_notes({"use_yccl": True, "hpz_first_layers_num": 2, "profile": False})
    assert len(record) == 2
    assert "use_yccl=True" in str(record[0].message)
    assert "private collective library" in str(record[0].message)
    assert "hpz_first_layers_num=2" in str(record[1].message)
    assert len(notes) == 2


def test_table_renders_every_argument():
    text = TABLE.render_markdown()
    for argument in TABLE.arguments:
        assert f"`{argument.name}`" in text
