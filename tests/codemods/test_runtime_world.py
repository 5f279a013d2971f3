"""Runtime helpers that need a process group, in one spawned single-rank gloo world."""

import torch
from torch import nn

from tests.world import run_world


def _checks(rank, world_size):
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from fsdp_bridge.fsdp import FullyShardedDataParallel as FSDP
    from fsdp_bridge.migrate import runtime

    results = {}
    # fsdp_modules of a model still built by FSDP1 (a constructor the migration left) finds its
    # units (torch's FSDP1 needs an accelerator; fsdp_bridge's FSDP1 stands in for it on the CPU).
    fsdp1 = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4)), nn.Linear(4, 2)))
    results["fsdp1 units"] = runtime.fsdp1_fsdp_modules(fsdp1) == FSDP.fsdp_modules(fsdp1) != []
    results["fsdp1 roots"] = runtime.fsdp1_fsdp_modules(fsdp1, root_only=True) == [fsdp1]
    fsdp2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(fsdp2[0])
    fully_shard(fsdp2)
    results["fsdp2 units"] = [isinstance(m, FSDPModule) for m in runtime.fsdp1_fsdp_modules(fsdp2)]

    # sync_module_states: the module goes to `device_id` before the broadcast, as in FSDP1 (NCCL
    # cannot broadcast a model rank 0 built on the CPU).
    steps = []
    move, broadcast = runtime._move_to_device, runtime._broadcast_from_first_rank
    runtime._move_to_device = lambda module, device_id: (steps.append(("move", str(device_id))),
                                                         move(module, device_id))
    runtime._broadcast_from_first_rank = lambda module, mesh: (
        steps.append(("broadcast", next(module.parameters()).device.type)), broadcast(module, mesh))
    try:
        runtime.fsdp1_fully_shard(nn.Linear(4, 4), sync_module_states=True, device_id=torch.device("cpu"))
    finally:
        runtime._move_to_device, runtime._broadcast_from_first_rank = move, broadcast
    results["sync steps"] = steps
    return results


def test_runtime_helpers_in_a_process_group():
    (result,) = run_world(_checks, 1)
    assert result["fsdp1 units"] is True  # what FSDP.fsdp_modules gives, not []
    assert result["fsdp1 roots"] is True
    assert result["fsdp2 units"] == [True, True]
    assert result["sync steps"] == [("move", "cpu"), ("broadcast", "cpu")]
