"""The engine in one process without a process group (a world of one): mixed-precision casts,
state-dict round trips and the user's view of the parameters. Fast, no spawning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fsdp_bridge import engine
from fsdp_bridge.plan import MixedPrecision, Plan, UnitSpec
from tests import models as M


def llama_plan(**mp):
    units = tuple(UnitSpec(f"model.layers.{i}") for i in range(3)) + (UnitSpec(""),)
    return Plan(units=units, mixed_precision=MixedPrecision(**mp))


def test_world_of_one_is_exactly_the_plain_model():
    plain, sharded_model = M.tiny_llama(), M.tiny_llama()
    engine.shard_model(sharded_model, llama_plan())
    ids = M.global_batches(1, 4)[0]
    expected = M.lm_loss(plain, ids)
    actual = M.lm_loss(sharded_model, ids)
    expected.backward()
    actual.backward()
    assert torch.equal(actual, expected)
    for (name, p), (ref_name, ref) in zip(sharded_model.named_parameters(), plain.named_parameters()):
        assert name == ref_name
        assert torch.equal(p.grad, ref.grad.reshape(-1)), name


def test_output_and_input_casting():
    model = M.tiny_llama()
    engine.shard_model(
        model, llama_plan(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    )
    logits = model(input_ids=M.global_batches(1, 2)[0]).logits
    assert logits.dtype == torch.float32  # cast back at the root output

    seen = {}
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    def record_input_dtype(module, args):
        seen["dtype"] = args[0].dtype

    mlp[1].register_forward_pre_hook(record_input_dtype)
    plan = Plan(units=(UnitSpec("1"), UnitSpec("")),
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    engine.shard_model(mlp, plan)
    out = mlp(torch.randn(3, 4))  # fp32 input is cast to bf16 at the root
    assert out.dtype == torch.bfloat16 and seen["dtype"] == torch.bfloat16


def test_buffer_dtype_casts_buffers_but_state_dict_keeps_their_dtype():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    sharded = engine.shard_model(
        model, Plan(units=(UnitSpec(""),), mixed_precision=MixedPrecision(buffer_dtype=torch.float16))
    )
    assert model[1].running_mean.dtype == torch.float16
    state = engine.full_state_dict(sharded)
    assert state["1.running_mean"].dtype == torch.float32
    for key in expected:
        torch.testing.assert_close(state[key], expected[key])


def test_load_full_state_dict_checks_keys_and_shapes():
    model = M.tiny_llama()
    sharded = engine.shard_model(model, llama_plan())
    good = M.tiny_llama(seed=5).state_dict()
    engine.load_full_state_dict(sharded, good)
    for key, value in engine.full_state_dict(sharded).items():
        assert torch.equal(value, good[key]), key
    bad = dict(good)
    bad.pop("lm_head.weight")
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing keys \['lm_head.weight'\].*unexpected keys \['extra.weight'\]"):
        engine.load_full_state_dict(sharded, bad)
    wrong_shape = dict(good)
    wrong_shape["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(3, 3\) in the state dict"):
        engine.load_full_state_dict(sharded, wrong_shape)


def test_sharding_twice_is_refused():
    model = M.tiny_llama()
    engine.shard_model(model, llama_plan())
    with pytest.raises(ValueError, match="already sharded"):
        engine.shard_model(model, llama_plan())


def test_plan_is_printable_and_fingerprint_stable():
    plan = llama_plan(param_dtype=torch.bfloat16)
    text = str(plan)
    assert "model.layers.2 (reshard-after-forward)" in text and "<root>" in text
    assert plan.fingerprint() == llama_plan(param_dtype=torch.bfloat16).fingerprint()
    assert plan.fingerprint() != llama_plan().fingerprint()


def test_layer_gather_buffers_hold_memory_only_while_needed():
    model = M.tiny_llama()
    engine.shard_model(model, llama_plan())
    sharded = engine.get_sharded(model)
    layers = [unit for unit in sharded.units if unit.name.startswith("model.layers.")]
    assert [b.owner for b in sharded.transient_buffers] == [None] * len(layers)
    assert len(sharded.transient_buffers) == len(layers) == 3  # one per layer group

    def held():
        return [b for b in sharded.transient_buffers if b.tensor.untyped_storage().nbytes() > 0]

    assert held() == []  # nothing allocated before the first gather
    loss = M.lm_loss(model, M.global_batches(1, 2)[0])
    last_layer = sharded.units[2]
    assert last_layer.name == "model.layers.2"
    # Through the turn to backward, where activations peak, no layer's weights stay gathered
    # (backward gathers the last layer again, as FSDP2 does); the root's stay.
    assert held() == []
    root = sharded.units[-1]
    assert root.name == "" and all(g.buffer.holds_memory for g in root.groups)
    loss.backward()
    # Between steps a rank holds shards only: every gathered copy, the root's included, is
    # freed before the optimizer step.
    assert held() == []
    assert not any(g.buffer.holds_memory for unit in sharded.units for g in unit.groups)


def test_cpu_offload_is_warned_about_only_where_it_is_not_implemented():
    from fsdp_bridge.engine.init import warn_unhonoured_offload
    from fsdp_bridge.plan import ParamLayout

    rows = Plan(units=(UnitSpec(""),), cpu_offload=True, frontend="fully_shard",
                param_layout=ParamLayout.ROWS)
    with pytest.warns(UserWarning, match=r"fully_shard.*CPU offload is not implemented yet "
                                         r"for fully_shard's DTensor.*stay on cuda:0"):
        warn_unhonoured_offload(rows, torch.device("cuda", 0))
    flat = Plan(units=(UnitSpec(""),), cpu_offload=True, frontend="FullyShardedDataParallel")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # flat parameters are offloaded; on a CPU nothing moves
        warn_unhonoured_offload(flat, torch.device("cuda", 0))
        warn_unhonoured_offload(rows, torch.device("cpu"))


def test_cpu_offload_on_a_cpu_device_trains_as_the_plain_model():
    plain, model = M.tiny_llama(device="cpu"), M.tiny_llama(device="cpu")
    plan = Plan(units=llama_plan().units, cpu_offload=True)
    sharded = engine.shard_model(model, plan, device=torch.device("cpu"))
    masters = [group.master for group in sharded.flat_groups()]
    for group in sharded.flat_groups():
        group.offload_to_host()  # already on the host: nothing moves
    assert all(group.master is master for group, master in zip(sharded.flat_groups(), masters))
    ids = M.global_batches(1, 2)[0]
    M.lm_loss(plain, ids).backward()
    M.lm_loss(model, ids).backward()
    for (name, p), (_, ref) in zip(model.named_parameters(), plain.named_parameters()):
        assert p.device.type == "cpu" and torch.equal(p.grad, ref.grad.reshape(-1)), name
