"""The host-side rules of the engine's CUDA path, checked on the CPU: the compute device from
the process group's backend config, the gradient-norm foreach kernels against per-parameter
norms, a world of one gathering with one cast-copy and flagging unused parameters without a
tensor or a collective, an explicit unshard kept by the next forward, and CPU offload left as
it was on the CPU. tests/test_gpu.py runs the same paths on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_bridge import engine
from fsdp_bridge.engine.device import (
    backends_of,
    collective_device,
    device_for_backends,
    parse_backend_config,
)
from fsdp_bridge.engine.norms import scale_, tensor_norms
from fsdp_bridge.engine.offload import GradOffload
from fsdp_bridge.plan import MixedPrecision, Plan, UnitSpec
from tests.world import run_world

CUDA0, CUDA1, CPU, META = (torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu"),
                          torch.device("meta"))

# -- the device from the backend config ---------------------------------------------------------


@pytest.mark.parametrize("config, expected", [
    ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ("cuda:nccl", {"cuda": "nccl"}),
    ("cpu:gloo,cuda:gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("nccl", {"cuda": "nccl"}),  # a plain name, as torch without get_backend_config reports
    ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
    ("undefined", {"cpu": "gloo", "cuda": "nccl"}),  # init_process_group() with no backend
])
def test_backend_configs_parse_to_device_types(config, expected):
    assert parse_backend_config(config) == expected


@pytest.mark.parametrize("config, cuda, module_device, expected", [
    # A CUDA backend of its own: the current GPU, even for a model built on the CPU.
    ("cuda:nccl", True, CPU, CUDA1),
    ("cpu:gloo,cuda:nccl", True, CPU, CUDA1),
    ("cpu:gloo,cuda:nccl", True, None, CUDA1),
    # The same mixed group where CUDA is not available: the CPU.
    ("cpu:gloo,cuda:nccl", False, CPU, CPU),
    # gloo: a model stays where it is.
    ("cpu:gloo,cuda:gloo", True, CPU, CPU),
    ("cpu:gloo,cuda:gloo", True, CUDA0, CUDA0),
    ("cpu:gloo,cuda:gloo", False, None, CPU),
    # A model on meta materialises on the current GPU where there is one, as native FSDP1's.
    ("cpu:gloo,cuda:gloo", True, META, CUDA1),
    ("cpu:gloo,cuda:gloo", False, META, CPU),
])
def test_device_follows_what_the_group_talks_on(config, cuda, module_device, expected):
    chosen = device_for_backends(parse_backend_config(config), module_device,
                                 cuda_available=cuda, current_cuda=1)
    assert chosen == expected


def test_a_group_that_talks_on_no_usable_device_is_refused():
    with pytest.raises(ValueError, match=r"backends \(cuda:nccl\).*CUDA available: False"):
        device_for_backends({"cuda": "nccl"}, CPU, cuda_available=False)


def test_bookkeeping_collectives_go_where_the_group_talks():
    assert collective_device(parse_backend_config("cuda:nccl"), CUDA1) == CUDA1
    assert collective_device(parse_backend_config("cpu:gloo,cuda:nccl"), CUDA1) == CPU
    assert collective_device(parse_backend_config("gloo"), CUDA1) == CPU


def real_gloo_group_world(rank, world):
    """On a real gloo group (world 1): its config, the device and collective device it gives,
    and the fingerprint check of a wrap run on it."""
    from fsdp_bridge.engine.init import check_ranks_agree

    plan = Plan(units=(UnitSpec(""),))
    sharded = engine.shard_model(nn.Linear(3, 2), plan)
    check_ranks_agree(plan, "layout", sharded.comm, sharded.device)  # talks on the CPU
    # Unused-parameter flags on a real group of one: no tensor, no collective.
    model = TwoBranches()
    branches = engine.shard_model(model, Plan(units=(UnitSpec(""),), unused_grad_is_none=True))
    built = []
    flags_on_device = branches._flags_on_device
    branches._flags_on_device = lambda seen: built.append(seen) or flags_on_device(seen)
    model(torch.randn(3, 4)).sum().backward()
    return {"backends": backends_of(None), "default_device": str(engine.default_device()),
            "engine_device": str(sharded.device),
            "collective_device": str(collective_device(backends_of(None), CUDA0)),
            "flags_built": len(built), "calls": dict(branches.comm.stats.calls),
            "skipped_grad_is_none": model.skipped.weight.grad is None}


def test_a_real_gloo_group_computes_and_checks_on_the_cpu():
    out = run_world(real_gloo_group_world, 1, backend_name="gloo")[0]
    assert out["backends"] == {"cpu": "gloo", "cuda": "gloo"}
    assert out["default_device"] == out["engine_device"] == "cpu"
    assert out["collective_device"] == "cpu"
    assert out["flags_built"] == 0 and out["calls"] == {}, out
    assert out["skipped_grad_is_none"], out


# -- gradient norms and clipping with foreach kernels --------------------------------------------


def _grads():
    generator = torch.Generator().manual_seed(3)
    shapes = [(7, 5), (0,), (13,), (4, 4, 3), (1,)]
    grads = [torch.randn(shape, generator=generator) * 3 for shape in shapes]
    grads += [torch.randn(9, generator=generator).to(torch.bfloat16),
              torch.randn(6, generator=generator).to(torch.float16)]
    return grads


@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, float("inf")])
def test_foreach_norms_equal_the_per_parameter_norms_bitwise(norm_type):
    grads = [g for g in _grads() if g.numel() > 0 or norm_type != float("inf")]
    expected = torch.stack([torch.linalg.vector_norm(g.float(), norm_type) for g in grads])
    # Bitwise: on the CPU torch's foreach norm runs the per-tensor norm for each tensor, and
    # the norms come back in the parameters' order.
    assert torch.equal(tensor_norms(grads, norm_type, CPU), expected)


def test_foreach_clipping_equals_per_parameter_clipping_bitwise():
    grads, expected = _grads(), _grads()
    coefficient = torch.tensor(0.3125)
    for grad in expected:
        grad.mul_(coefficient.to(grad.device, grad.dtype))
    scale_(grads, coefficient)
    for got, want in zip(grads, expected):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_engine_clipping_equals_the_per_parameter_computation_bitwise():
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
    sharded = engine.shard_model(model, Plan(units=(UnitSpec("0"), UnitSpec(""))))
    model(torch.randn(4, 6)).pow(2).sum().backward()
    grads = [g.clone() for group in sharded.flat_groups() for g in group.local_grads()]
    # What the engine computed before its foreach kernels: a norm and a multiply per tensor.
    norms = torch.stack([torch.linalg.vector_norm(g.float(), 2.0) for g in grads])
    expected_total = norms.pow(2.0).sum().pow(0.5)
    coefficient = torch.clamp(0.1 / (expected_total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(coefficient.to(grad.device, grad.dtype))

    total = sharded.clip_grad_norm_(0.1)
    assert torch.equal(total, expected_total)
    clipped = [g for group in sharded.flat_groups() for g in group.local_grads()]
    assert all(torch.equal(got, want) for got, want in zip(clipped, grads))
    assert float(coefficient) < 1.0, "the test must actually clip"


# -- a world of one -----------------------------------------------------------------------------


class TwoBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.skipped = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def test_world1_gather_casts_straight_into_the_buffer():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    plan = Plan(units=(UnitSpec("0"), UnitSpec("")),
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    sharded = engine.shard_model(model, plan)
    group = sharded.flat_groups()[0]
    group.start_gather()
    group.wait_gather()
    buffer = group.gathered_flat()
    assert group._gather_input(buffer).data_ptr() == buffer.data_ptr()  # written in place
    assert torch.equal(buffer, group.master.to(torch.bfloat16))
    group.invalidate()


def test_world1_flags_unused_parameters_without_a_tensor_or_a_collective():
    model = TwoBranches()
    sharded = engine.shard_model(model, Plan(units=(UnitSpec(""),), unused_grad_is_none=True))
    built = []
    flags_on_device = sharded._flags_on_device
    sharded._flags_on_device = lambda seen: built.append(seen) or flags_on_device(seen)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
    assert model.used.weight.grad is not None and model.skipped.weight.grad is None
    assert built == [] and "all_reduce" not in sharded.comm.stats.calls


def test_explicit_unshard_is_the_gather_the_next_forward_uses():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    sharded = engine.shard_model(model, Plan(units=(UnitSpec("0"), UnitSpec("2"), UnitSpec(""))))
    first = sharded.flat_groups()[0]
    batch = torch.randn(3, 4)
    model(batch).sum().backward()  # a step, so that the forward order is known
    gathers = []
    start_gather = first.start_gather
    first.start_gather = lambda: gathers.append(1) or start_gather()
    expected = model(batch)
    assert len(gathers) == 1  # the forward's own gather
    model(batch).sum().backward()
    gathers.clear()
    engine.unshard_unit(sharded, "0")
    assert len(gathers) == 1
    output = model(batch)
    assert len(gathers) == 1, "the forward gathered again instead of using the explicit unshard"
    assert torch.equal(output, expected)
    output.sum().backward()


def explicit_unshard_gathers(rank, world):
    """fully_shard's `unshard(async_op=True)` ahead of a forward: how many gathers the unit's
    groups start (the unshard's and the forward's), and whether the output is the one a forward
    without it computes. Device-agnostic: tests/test_gpu.py runs it on a GPU."""
    from fsdp_bridge.fsdp import fully_shard
    from tests.world import device

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device())
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    batch = torch.randn(4, 8, device=device())
    model(batch).sum().backward()  # the lazy init, and the forward order
    expected = model(batch).detach()
    model(batch).sum().backward()
    sharded = engine.get_sharded(model)
    unit = next(unit for unit in sharded.units if unit.name == "0")
    gathers = []
    for group in unit.groups:
        start_gather = group.start_gather
        group.start_gather = lambda start=start_gather: gathers.append(1) or start()
    handle = model[0].unshard(async_op=True)
    by_unshard = len(gathers)
    output = model(batch)
    by_forward = len(gathers) - by_unshard
    handle.wait()
    output.sum().backward()
    return {"groups": len(unit.groups), "by_unshard": by_unshard, "by_forward": by_forward,
            "same_output": bool(torch.equal(output.detach(), expected))}


def test_fully_shard_unshard_ahead_of_forward_is_not_gathered_again():
    out = run_world(explicit_unshard_gathers, 1, backend_name="gloo")[0]
    assert out["groups"] >= 1 and out["by_unshard"] == out["groups"], out
    assert out["by_forward"] == 0, out
    assert out["same_output"], out


# -- CPU offload on the CPU ---------------------------------------------------------------------


def test_gradients_join_at_once_where_there_is_no_stream():
    model = nn.Linear(4, 4)
    sharded = engine.shard_model(model, Plan(units=(UnitSpec(""),), cpu_offload=True))
    assert sharded.grad_offload.stream is None
    group = sharded.flat_groups()[0]
    assert group.master.device.type == "cpu" and not group._pins_master
    GradOffload(CPU).accumulate(group, torch.ones(group.shard_numel))
    assert group.accumulator is not None and torch.equal(group.accumulator,
                                                         torch.ones(group.shard_numel))
