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
- `cpu_offload`: fp32 master shards kept on the CPU in pinned memory.

On the CPU (the default) every test here is skipped: the same cases run at world 2 and 4 on
gloo in test_engine_parity.py, and the rest has no meaning without a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests import engine_cases as C
from tests import models as M
from tests.test_engine_parity import BF16, assert_matches_reference, assert_states_close, reference
from tests.world import device, device_type, run_world

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


def world1_cases(rank, world, names):
    out = C.run_cases(rank, world, names)
    out["memory_over_steps"] = memory_over_steps(rank, world)
    out["device_id_forms"] = device_id_forms(rank, world)
    out["offload"] = offload_placement(rank, world)
    return out


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world1():
    return run_world(world1_cases, 1, [case.__name__ for case in WORLD1_CASES])[0]


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
    assert_matches_reference(world1[case], reference(model))


def test_world1_clip_and_frozen(world1):
    losses, norms, state = reference("llama", clip=0.5)
    torch.testing.assert_close(torch.tensor(world1["case_clip"]["norms"]), torch.tensor(norms),
                               rtol=1e-5, atol=1e-6)
    assert_matches_reference(world1["case_clip"], (losses, norms, state))
    assert_matches_reference(world1["case_frozen_embedding"], reference("llama", frozen=True))


def test_world1_bf16_gathers_match_native_fsdp2(world1):
    ours, native = world1["case_bf16_vs_fsdp2"]["ours"], world1["case_bf16_vs_fsdp2"]["native"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]), **BF16)
    assert_states_close(ours["state"], native["state"], **BF16)
    assert ours["losses"] != reference("llama")[0], "bf16 must really run in low precision"


def test_memory_is_flat_over_50_steps(world1):
    allocated = world1["memory_over_steps"]
    assert len(allocated) == MEMORY_STEPS
    # After the first steps (optimizer state, buffers), every step ends with the same bytes.
    settled = allocated[3:]
    assert max(settled) == min(settled), f"GPU memory grows over steps: {settled}"


@pytest.mark.parametrize("form", ["int", "torch.device", "None"])
def test_device_id_forms_put_parameters_on_the_gpu(world1, form):
    out = world1["device_id_forms"]
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
    out = world1["offload"]
    assert out["placement"] == {"devices": ["cpu"], "pinned": True}
    assert_matches_reference(out, reference("llama"))
