"""What only a CUDA run can check, on NCCL (`FSDP_BRIDGE_DEVICE=cuda`, `make test-gpu`):

- the engine's training cases at world 1 against the single-process reference (so a machine
  with one GPU still trains every strategy on NCCL; the world-2/4 suites need 2/4 GPUs);
- the same cases at world 2 over gloo with CUDA tensors, both ranks on one GPU: at world 1 no
  collective runs (a gather is a local copy), so this is what exercises the multi-rank CUDA
  path on a machine with one GPU;
- at world 2 on NCCL (2 GPUs): the collectives NCCL is given, and ranks whose current device
  is not their `device_id`;
- memory flat over 50 steps (prefetch streams and events leak nothing);
- `device_id` as an int, a `torch.device`, and None (the current device, set from LOCAL_RANK);
- `cpu_offload`: fp32 master shards kept on the CPU in pinned memory (after a cast too), and
  training under offload with bf16 gathers and with clipping;
- the compute device chosen from the process group's backend config (NCCL, "cpu:gloo,cuda:nccl");
- a world-1 backward that never waits for the GPU (no host sync: gathers, reductions, unused
  parameter flags), a world-1 bf16 gather written in place, an explicit `unshard()` kept by the
  next forward, foreach clipping against per-parameter clipping;
- hybrid sharding (2 x 2) at world 4 over gloo on one GPU (no replica stream there: gloo orders
  no CUDA stream) and, on 4 GPUs, over NCCL with the replica all-reduce on its own stream.

Each world-1 check is one entry of a table run in one spawned world; an entry that raises is
recorded with its traceback and fails only its own tests.

On the CPU (the default) every test here is skipped: the same cases run at world 2 and 4 on
gloo in test_engine_parity.py, and the rest has no meaning without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests import engine_cases as C
from tests import models as M
from tests.test_engine_cuda_path import TwoBranches, explicit_unshard_gathers
from tests.test_engine_parity import (
    BF16,
    FP32,
    assert_matches_reference,
    assert_states_close,
    reference,
)
from tests.world import case_result, device, device_type, run_case_table, run_world

pytestmark = pytest.mark.skipif(
    device_type() != "cuda",
    reason="CUDA-only checks: run with FSDP_BRIDGE_DEVICE=cuda (make test-gpu)",
)

MEMORY_STEPS = 50

# The training cases of the world-2 run over gloo on one GPU (the multi-rank CUDA path).
GLOO_WORLD2_CASES = [
    C.case_llama_zero3,
    C.case_llama_zero2,
    C.case_llama_replicate,
    C.case_gpt2_zero3,
    C.case_accumulation_declared,
    C.case_accumulation_no_sync,
    C.case_clip,
]

WORLD1_CASES = GLOO_WORLD2_CASES + [
    C.case_frozen_embedding,
    C.case_meta_init,
    C.case_sync_module_states,
    C.case_bf16_vs_fsdp2,
]


# -- rank functions (module level: spawned ranks import them) -----------------------------------


def memory_over_steps(rank, world):
    """Bytes allocated on the GPU after each of 50 steps of ZeRO-3 (prefetch on)."""
    model = C.yafsdp_llama(M.tiny_llama())
    optimizer = M.make_adamw(model.parameters())
    allocated = []
    for batch in M.global_batches(MEMORY_STEPS, C.GLOBAL_BATCH):
        M.lm_loss(model, M.rank_slice(batch, rank, world)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    return allocated


def device_id_forms(rank, world):
    """Where FSDP1-dialect parameters land for each accepted form of device_id."""
    from fsdp_bridge.fsdp import FullyShardedDataParallel

    index = torch.cuda.current_device()
    os.environ["LOCAL_RANK"] = str(index)  # what torchrun sets; the spawner set the device from it
    forms = {"int": index, "torch.device": torch.device("cuda", index), "None": None}
    out = {}
    for name, device_id in forms.items():
        model = M.tiny_llama(device="cpu")  # FSDP1 users pass a CPU model and a device_id
        wrapped = FullyShardedDataParallel(model, device_id=device_id, use_orig_params=True)
        loss = M.lm_loss(wrapped, M.global_batches(1, C.GLOBAL_BATCH)[0])
        loss.backward()
        out[name] = {
            "param_devices": sorted({str(p.device) for p in wrapped.parameters()}),
            "loss_device": str(loss.device),
        }
    out["expected"] = str(torch.device("cuda", index))
    return out


def offload_cast_and_bf16(rank, world):
    """Under CPU offload: masters still pinned after a cast of the wrapped model (a cast
    rebuilds them), and bf16 gathers (the fp32 master copied to the GPU, then cast there)
    training as without offload."""
    from torch.distributed.fsdp import CPUOffload, MixedPrecision

    from fsdp_bridge.fsdp import FullyShardedDataParallel

    def wrapped(offload):
        extra = {"cpu_offload": CPUOffload(offload_params=True)} if offload else {}
        return FullyShardedDataParallel(
            M.tiny_llama(device="cpu"), device_id=device(), use_orig_params=True,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16), **extra)

    losses = {name: C.train(rank, world, wrapped(name == "offload"), steps=3)[0]
              for name in ("offload", "device")}
    cast = FullyShardedDataParallel(nn.Linear(8, 8), device_id=device(), use_orig_params=True,
                                    cpu_offload=CPUOffload(offload_params=True))
    cast.double()
    cast(torch.randn(2, 8, device=device(), dtype=torch.float64)).sum().backward()
    masters = [group.master for unit in cast._sharded.units for group in unit.groups]
    return {"losses": losses,
            "cast_masters": sorted({f"{m.device.type} {m.dtype} pinned={m.is_pinned()}"
                                    for m in masters}),
            "cast_grads": sorted({f"{p.grad.device.type} {p.grad.dtype}"
                                  for p in cast.parameters()})}


def offload_clip(rank, world):
    """Clipping under CPU offload (gradients on the host, the norm on the GPU)."""
    from torch.distributed.fsdp import CPUOffload

    from fsdp_bridge.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(M.tiny_llama(device="cpu"), device_id=device(),
                                     use_orig_params=True,
                                     cpu_offload=CPUOffload(offload_params=True))
    return C.result(rank, world, model, clip=0.5)


def device_from_backend_config(rank, world):
    """The compute device the engine picks, without device_id, for a CPU-built model on the
    NCCL world and on a mixed "cpu:gloo,cuda:nccl" group."""
    import torch.distributed as dist

    from fsdp_bridge import engine
    from fsdp_bridge.engine.device import backends_of
    from fsdp_bridge.plan import Plan, UnitSpec

    mixed = dist.new_group(backend="cpu:gloo,cuda:nccl")
    out = {"expected": str(device()), "mixed_backends": backends_of(mixed)}
    for name, group in (("world", None), ("mixed", mixed)):
        model = nn.Linear(8, 8)  # built on the CPU
        sharded = engine.shard_model(model, Plan(units=(UnitSpec(""),)), shard_group=group)
        model(torch.randn(2, 8, device=sharded.device)).sum().backward()
        out[name] = {"default": str(engine.default_device(group)), "engine": str(sharded.device),
                     "params": sorted({str(p.device) for p in model.parameters()}),
                     "grads": sorted({str(p.grad.device) for p in model.parameters()})}
    return out


def backward_without_host_sync(rank, world):
    """A world-1 backward (ZeRO-3 units, bf16 gathers, an unused parameter whose `.grad` stays
    None) run with CUDA's sync debug mode set to raise on any wait of the host for the GPU."""
    from fsdp_bridge import engine
    from fsdp_bridge.plan import MixedPrecision, Plan, UnitSpec

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), TwoBranches(), nn.Linear(4, 4))
    model[2].used, model[2].skipped = nn.Linear(16, 4), nn.Linear(16, 4)
    plan = Plan(units=(UnitSpec("0"), UnitSpec("2"), UnitSpec("")), unused_grad_is_none=True,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    engine.shard_model(model.to(device()), plan)
    batch = torch.randn(8, 16, device=device())
    model(batch).float().pow(2).sum().backward()  # a warm-up step (allocations, lazy inits)
    loss = model(batch).float().pow(2).sum()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return {"skipped_grad_is_none": model[2].skipped.weight.grad is None,
            "used_grad": model[2].used.weight.grad is not None}


def gather_in_place_and_foreach_clip(rank, world):
    """A world-1 bf16 gather written straight into the buffer; foreach norms and scaling of
    CUDA tensors against the per-parameter ones."""
    from fsdp_bridge import engine
    from fsdp_bridge.engine.norms import scale_, tensor_norms
    from fsdp_bridge.plan import MixedPrecision, Plan, UnitSpec

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).to(device())
    plan = Plan(units=(UnitSpec("0"), UnitSpec("")),
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    group = engine.shard_model(model, plan).flat_groups()[0]
    group.start_gather()
    group.wait_gather()
    buffer = group.gathered_flat()
    in_place = group._gather_input(buffer).data_ptr() == buffer.data_ptr()
    equal = torch.equal(buffer, group.master.to(torch.bfloat16))
    group.invalidate()

    generator = torch.Generator().manual_seed(5)
    grads = [torch.randn(n, generator=generator).to(device=device(), dtype=dtype)
             for n, dtype in ((1000, torch.float32), (37, torch.float32), (300, torch.bfloat16))]
    per_param = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
    foreach = tensor_norms(grads, 2.0, device())
    scaled, expected = [g.clone() for g in grads], [g.clone() for g in grads]
    factor = torch.tensor(0.37, device=device())
    for grad in expected:
        grad.mul_(factor.to(grad.device, grad.dtype))
    scale_(scaled, factor)
    return {"in_place": in_place, "gathered_equals_cast_master": equal,
            "norms": (foreach.cpu(), per_param.cpu()),
            "scaled_equal": all(torch.equal(a, b) for a, b in zip(scaled, expected))}


def nccl_collectives(rank, world):
    """Which collectives ZeRO-3 calls over one step (and the flags the backend set)."""
    model = C.yafsdp_llama(M.tiny_llama())
    comm = model._sharded.comm
    comm.stats.reset()
    ids = M.rank_slice(M.global_batches(1, C.GLOBAL_BATCH)[0], rank, world)
    M.lm_loss(model, ids).backward()
    return {
        "in_place_all_reduce": comm.reduce_scatter_in_place,
        "waits_on_futures": comm.wait_on_futures,
        "calls": dict(comm.stats.calls),
    }


def offload_placement(rank, world):
    """Where the fp32 master shards live under FSDP1 CPUOffload(offload_params=True), and
    whether training still matches the reference."""
    from torch.distributed.fsdp import CPUOffload

    from fsdp_bridge.fsdp import FullyShardedDataParallel

    model = M.tiny_llama(device="cpu")
    wrapped = FullyShardedDataParallel(model, device_id=device(), use_orig_params=True,
                                       cpu_offload=CPUOffload(offload_params=True))
    masters = [group.master for unit in wrapped._sharded.units for group in unit.groups]
    placement = {
        "devices": sorted({str(m.device) for m in masters}),
        "pinned": all(m.device.type == "cpu" and m.is_pinned() for m in masters),
    }
    return {"placement": placement, **C.result(rank, world, wrapped)}


def device_not_current(rank, world):
    """Every rank's current device is cuda:0, its device_id its own GPU: the engine must make
    the device_id current (NCCL talks on the current device: two ranks on cuda:0 fail)."""
    torch.cuda.set_device(0)
    model = C.yafsdp_llama(M.tiny_llama(device="cpu"), device_id=rank)
    losses, _ = C.train(rank, world, model, steps=1)
    return {"current": torch.cuda.current_device(),
            "param_devices": sorted({str(p.device) for p in model.parameters()}),
            "losses": losses}


def world2_nccl_cases(rank, world):
    return {"collectives": nccl_collectives(rank, world),
            "device_not_current": device_not_current(rank, world)}


def gloo_world2_cases(rank, world, names):
    out = C.run_cases(rank, world, names)
    model = C.yafsdp_llama(M.tiny_llama())
    out["param_devices"] = sorted({str(p.device) for p in model.parameters()})
    out["collectives"] = nccl_collectives(rank, world)["calls"]
    return out


WORLD1_CHECKS = {
    "memory_over_steps": memory_over_steps,
    "device_id_forms": device_id_forms,
    "offload": offload_placement,
    "offload_cast_and_bf16": offload_cast_and_bf16,
    "offload_clip": offload_clip,
    "device_from_backend_config": device_from_backend_config,
    "backward_without_host_sync": backward_without_host_sync,
    "gather_in_place_and_foreach_clip": gather_in_place_and_foreach_clip,
    "explicit_unshard": explicit_unshard_gathers,
}


def world1_cases(rank, world, names):
    """Every training case and check, each recorded on its own (its result, or its
    traceback: see `entry`)."""
    table = {case.__name__: case for case in WORLD1_CASES}
    table.update(WORLD1_CHECKS)
    return run_case_table(table, [*names, *WORLD1_CHECKS])


def hybrid_cases(rank, world, names):
    table = {name: getattr(C, name) for name in names}
    out = run_case_table(table, names)
    model, sharded = C._hybrid(M.tiny_llama(), "model.layers")
    out["replica_stream"] = sharded.replica_stream is not None
    return out


# -- the tests ---------------------------------------------------------------------------------


HYBRID_CASES = ["case_hybrid_llama", "case_hybrid_gpt2",
                "case_hybrid_replica_reduces_wait_for_the_end"]


@pytest.fixture(scope="module")
def world1():
    return run_world(world1_cases, 1, [case.__name__ for case in WORLD1_CASES])[0]


def entry(world1, name):
    """World-1 entry `name`; fails the test with the entry's own traceback if it raised."""
    return case_result([world1], name)


@pytest.fixture(scope="module")
def world2():
    return run_world(world2_nccl_cases, 2, backend_name="nccl")


@pytest.fixture(scope="module")
def world2_gloo():
    names = [case.__name__ for case in GLOO_WORLD2_CASES]
    return run_world(gloo_world2_cases, 2, names, backend_name="gloo")


@pytest.mark.parametrize(
    "case, model",
    [("case_llama_zero3", "llama"), ("case_llama_zero2", "llama"), ("case_llama_replicate", "llama"),
     ("case_gpt2_zero3", "gpt2"), ("case_accumulation_declared", "llama"),
     ("case_accumulation_no_sync", "llama"), ("case_meta_init", "llama"),
     ("case_sync_module_states", "llama")],
)
def test_world1_matches_reference(world1, case, model):
    assert_matches_reference(entry(world1, case), reference(model))


def test_world1_clip_and_frozen(world1):
    losses, norms, state = reference("llama", clip=0.5)
    clipped = entry(world1, "case_clip")
    torch.testing.assert_close(torch.tensor(clipped["norms"]), torch.tensor(norms),
                               rtol=1e-5, atol=1e-6)
    assert_matches_reference(clipped, (losses, norms, state))
    assert_matches_reference(entry(world1, "case_frozen_embedding"),
                             reference("llama", frozen=True))


def test_world1_bf16_gathers_match_native_fsdp2(world1):
    bf16 = entry(world1, "case_bf16_vs_fsdp2")
    ours, native = bf16["ours"], bf16["native"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]), **BF16)
    assert_states_close(ours["state"], native["state"], **BF16)
    assert ours["losses"] != reference("llama")[0], "bf16 must really run in low precision"


def test_memory_is_flat_over_50_steps(world1):
    allocated = entry(world1, "memory_over_steps")
    assert len(allocated) == MEMORY_STEPS
    # After the first steps (optimizer state, buffers), every step ends with the same bytes.
    settled = allocated[3:]
    assert max(settled) == min(settled), f"GPU memory grows over steps: {settled}"


@pytest.mark.parametrize("form", ["int", "torch.device", "None"])
def test_device_id_forms_put_parameters_on_the_gpu(world1, form):
    out = entry(world1, "device_id_forms")
    assert out[form]["param_devices"] == [out["expected"]]
    assert out[form]["loss_device"] == out["expected"]


def test_nccl_zero3_reduce_scatters_at_world2(world2):
    calls = world2[0]["collectives"]["calls"]
    assert calls.get("reduce_scatter", 0) > 0, calls
    assert calls.get("all_reduce", 0) == 0, calls
    assert calls.get("all_gather", 0) > 0, calls


def test_ranks_train_on_their_device_id_not_the_current_device(world2):
    for rank, out in enumerate(world2):
        out = out["device_not_current"]
        assert out["current"] == rank
        assert out["param_devices"] == [f"cuda:{rank}"]
    assert world2[0]["device_not_current"]["losses"] == world2[1]["device_not_current"]["losses"]


@pytest.mark.parametrize("case, model", [
    ("case_llama_zero3", "llama"), ("case_llama_zero2", "llama"), ("case_llama_replicate", "llama"),
    ("case_gpt2_zero3", "gpt2"), ("case_accumulation_declared", "llama"),
    ("case_accumulation_no_sync", "llama"),
])
def test_world2_over_gloo_on_cuda_matches_reference(world2_gloo, case, model):
    assert_matches_reference(world2_gloo[0][case], reference(model))


def test_world2_over_gloo_on_cuda_communicates_cuda_tensors(world2_gloo):
    assert world2_gloo[0]["param_devices"] == [str(device())]
    calls = world2_gloo[0]["collectives"]
    assert calls.get("all_gather", 0) > 0 and calls.get("reduce_scatter", 0) > 0, calls
    losses, norms, state = reference("llama", clip=0.5)
    clipped = world2_gloo[0]["case_clip"]
    torch.testing.assert_close(torch.tensor(clipped["norms"]), torch.tensor(norms),
                               rtol=1e-5, atol=1e-6)
    assert_matches_reference(clipped, (losses, norms, state))


def test_cpu_offload_keeps_pinned_masters_on_the_cpu(world1):
    out = entry(world1, "offload")
    assert out["placement"] == {"devices": ["cpu"], "pinned": True}
    assert_matches_reference(out, reference("llama"))


def test_cpu_offload_pins_masters_rebuilt_by_a_cast(world1):
    out = entry(world1, "offload_cast_and_bf16")
    assert out["cast_masters"] == ["cpu torch.float64 pinned=True"], out
    assert out["cast_grads"] == ["cpu torch.float64"], out


def test_cpu_offload_with_bf16_gathers_trains_as_without_offload(world1):
    losses = entry(world1, "offload_cast_and_bf16")["losses"]
    # The same bf16 gathers and fp32 reductions; the AdamW step runs on the host under
    # offload and on the GPU without: equal within bf16 tolerance.
    torch.testing.assert_close(torch.tensor(losses["offload"]), torch.tensor(losses["device"]),
                               **BF16)


def test_clipping_under_cpu_offload_matches_the_reference(world1):
    out = entry(world1, "offload_clip")
    losses, norms, state = reference("llama", clip=0.5)
    torch.testing.assert_close(torch.tensor(out["norms"]), torch.tensor(norms), **FP32)
    assert_matches_reference(out, (losses, norms, state))


@pytest.mark.parametrize("group", ["world", "mixed"])
def test_device_comes_from_the_groups_backend_config(world1, group):
    out = entry(world1, "device_from_backend_config")
    assert out["mixed_backends"] == {"cpu": "gloo", "cuda": "nccl"}, out
    chosen = out[group]
    expected = out["expected"]
    assert chosen["default"] == chosen["engine"] == expected, out
    assert chosen["params"] == [expected] and chosen["grads"] == [expected], out


def test_world1_backward_never_waits_for_the_gpu(world1):
    out = entry(world1, "backward_without_host_sync")
    assert out == {"skipped_grad_is_none": True, "used_grad": True}, out


def test_world1_bf16_gather_is_one_cast_copy_into_the_buffer(world1):
    out = entry(world1, "gather_in_place_and_foreach_clip")
    assert out["in_place"] and out["gathered_equals_cast_master"], out


def test_foreach_clipping_matches_per_parameter_clipping_on_cuda(world1):
    out = entry(world1, "gather_in_place_and_foreach_clip")
    foreach, per_param = out["norms"]
    # CUDA's foreach norm reduces in another order than vector_norm: float32 rounding apart.
    torch.testing.assert_close(foreach, per_param, rtol=1e-6, atol=0)
    assert out["scaled_equal"], "an elementwise multiply must be bitwise the same"


def test_explicit_unshard_is_not_gathered_again_by_the_forward(world1):
    out = entry(world1, "explicit_unshard")
    assert out["groups"] >= 1 and out["by_unshard"] == out["groups"], out
    assert out["by_forward"] == 0, out
    assert out["same_output"], out


@pytest.fixture(scope="module")
def world4_gloo():
    """Hybrid 2 x 2 over gloo, four ranks sharing one GPU."""
    return run_world(hybrid_cases, 4, HYBRID_CASES, backend_name="gloo")


@pytest.fixture(scope="module")
def world4_nccl():
    """Hybrid 2 x 2 over NCCL (4 GPUs): the replica all-reduce on a stream of its own."""
    return run_world(hybrid_cases, 4, HYBRID_CASES, backend_name="nccl")


def _check_hybrid(results):
    for case, model in (("case_hybrid_llama", "llama"), ("case_hybrid_gpt2", "gpt2")):
        clip = 1.0 if case == "case_hybrid_llama" else None
        out = case_result(results, case)
        assert_matches_reference(out, reference(model, clip=clip))
        for rank in (1, 2, 3):  # replicas hold the same parameters
            assert_states_close(case_result(results, case, rank)["state"], out["state"],
                                rtol=0, atol=0)
    for rank in range(4):
        seen = case_result(results, "case_hybrid_replica_reduces_wait_for_the_end", rank)
        assert set(seen["finished_after"]) == {seen["post_backwards"]}, seen


def test_world4_hybrid_over_gloo_on_cuda_matches_reference(world4_gloo):
    assert world4_gloo[0]["replica_stream"] is False  # gloo orders no CUDA stream
    _check_hybrid(world4_gloo)


def test_world4_hybrid_over_nccl_matches_reference(world4_nccl):
    assert world4_nccl[0]["replica_stream"] is True
    _check_hybrid(world4_nccl)
