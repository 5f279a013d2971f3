"""What the engine chooses per device, checked in one process on the CPU: the backward prefetch
schedule (the CPU's unchanged, NCCL's pre-backward one selectable and training the same), the
CUDA device made current, the divide skipped when there is nothing to divide by."""

from __future__ import annotations

import pytest
import torch

from fsdp_bridge import engine
from fsdp_bridge.engine import device as engine_device
from fsdp_bridge.engine.device import BackwardPrefetch
from fsdp_bridge.plan import MixedPrecision, Plan, UnitSpec
from tests import models as M


def llama_plan():
    units = tuple(UnitSpec(f"model.layers.{i}") for i in range(3)) + (UnitSpec(""),)
    return Plan(units=units, mixed_precision=MixedPrecision())


@pytest.mark.parametrize("device, expected", [
    ("cpu", BackwardPrefetch.POST_BACKWARD),
    ("cuda:0", BackwardPrefetch.PRE_BACKWARD),
    ("cuda:1", BackwardPrefetch.PRE_BACKWARD),
])
def test_the_backward_prefetch_schedule_follows_the_device(device, expected):
    assert engine_device.default_backward_prefetch(torch.device(device)) is expected
    assert engine_device.has_streams(torch.device(device)) == device.startswith("cuda")


def test_the_cpu_engine_keeps_the_post_backward_schedule():
    model = M.tiny_llama(device="cpu")
    sharded = engine.shard_model(model, llama_plan(), device=torch.device("cpu"))
    assert sharded.backward_prefetch is BackwardPrefetch.POST_BACKWARD
    assert sharded.replica_stream is None  # no streams: the replica all-reduce runs at finish


def record_schedule(sharded):
    """Log, in order, every gather start and every post-backward, by unit name."""
    events = []
    for unit in sharded.units:
        for group in unit.groups:
            def start_gather(group=group, name=unit.name, original=group.start_gather):
                events.append(("gather", name))
                original()
            group.start_gather = start_gather
    original_post_backward = sharded.post_backward

    def post_backward(group, grads):
        events.append(("post_backward", sharded.unit_of_group[id(group)].name))
        original_post_backward(group, grads)

    sharded.post_backward = post_backward
    return events


def backward_events(schedule: BackwardPrefetch):
    model = M.tiny_llama(device="cpu")
    sharded = engine.shard_model(model, llama_plan(), device=torch.device("cpu"))
    sharded.backward_prefetch = schedule
    events = record_schedule(sharded)
    loss = M.lm_loss(model, M.global_batches(1, 2)[0])
    del events[:]
    loss.backward()
    return model, events


def test_pre_backward_prefetch_starts_a_gather_before_the_unit_before_it_finishes():
    _, pre = backward_events(BackwardPrefetch.PRE_BACKWARD)
    _, post = backward_events(BackwardPrefetch.POST_BACKWARD)
    layer = "model.layers.{}".format
    # Both schedules gather every layer once in backward, last layer first.
    for events in (pre, post):
        assert [name for kind, name in events if kind == "gather"] == [layer(2), layer(1), layer(0)]

    def gather_of(events, name):
        return events.index(("gather", name))

    def done(events, name):
        return events.index(("post_backward", name))

    # Pre-backward: layer 1 is being gathered while layer 2's backward runs (before its
    # post-backward); post-backward: only once layer 2's backward is over.
    assert gather_of(pre, layer(1)) < done(pre, layer(2))
    assert gather_of(pre, layer(0)) < done(pre, layer(1))
    assert gather_of(post, layer(1)) > done(post, layer(2))
    assert gather_of(post, layer(0)) > done(post, layer(1))


def test_both_schedules_train_exactly_as_the_plain_model():
    plain = M.tiny_llama(device="cpu")
    ids = M.global_batches(1, 2)[0]
    M.lm_loss(plain, ids).backward()
    for schedule in BackwardPrefetch:
        model, _ = backward_events(schedule)
        for (name, p), (_, ref) in zip(model.named_parameters(), plain.named_parameters()):
            assert torch.equal(p.grad, ref.grad.reshape(-1)), (schedule, name)
        sharded = engine.get_sharded(model)
        # Nothing stays gathered once backward is over, whatever the schedule.
        assert not any(g.buffer.holds_memory for g in sharded.flat_groups())


def test_pre_backward_holds_at_most_two_layers_gathered():
    model = M.tiny_llama(device="cpu")
    sharded = engine.shard_model(model, llama_plan(), device=torch.device("cpu"))
    sharded.backward_prefetch = BackwardPrefetch.PRE_BACKWARD
    most = []
    original = sharded.post_backward

    def post_backward(group, grads):
        most.append(sum(b.holds_memory for b in sharded.transient_buffers))
        original(group, grads)

    sharded.post_backward = post_backward
    M.lm_loss(model, M.global_batches(1, 2)[0]).backward()
    assert most and max(most) == 2


def test_a_cuda_device_is_made_current_and_others_are_left(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    engine_device.select_device(torch.device("cpu"))
    engine_device.select_device(torch.device("cuda", 0))  # already current
    engine_device.select_device(torch.device("cuda"))  # no index: the current one
    assert calls == []
    engine_device.select_device(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)]


def test_a_divide_by_one_leaves_the_gradient_untouched():
    model = torch.nn.Linear(4, 4)
    sharded = engine.shard_model(model, Plan(units=(UnitSpec(""),)))
    group = sharded.flat_groups()[0]
    for divisor, expected in ((1.0, False), (2.0, True)):
        shard = torch.full((group.shard_numel,), 4.0)
        group.accumulate(shard)  # the cycle's first shard becomes its accumulator
        version = shard._version
        group.finalize_grads(divisor)
        assert (shard._version != version) is expected, divisor
        assert torch.equal(shard, torch.full_like(shard, 4.0 / divisor))
        assert model.weight.grad.data_ptr() == shard.data_ptr()
        model.zero_grad(set_to_none=True)
