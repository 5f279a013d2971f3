"""Runtime helpers that need a process group, in one spawned single-rank gloo world."""

import copy

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
    runtime._move_to_device = lambda region, device_id: (steps.append(("move", str(device_id))),
                                                         move(region, device_id))
    runtime._broadcast_from_first_rank = lambda region, mesh: (
        steps.append(("broadcast", next(region[0].parameters()).device.type)), broadcast(region, mesh))
    try:
        runtime.fsdp1_fully_shard(nn.Linear(4, 4), sync_module_states=True, device_id=torch.device("cpu"))
    finally:
        runtime._move_to_device, runtime._broadcast_from_first_rank = move, broadcast
    results["sync steps"] = steps
    results["unsharded at each init"] = _unsharded_while_initialising(runtime)
    results["to_load leaves the optimizer"] = _to_load_leaves_the_optimizer(runtime)
    return results


def _to_load_leaves_the_optimizer(runtime) -> dict:
    """fsdp1_optim_state_dict_to_load gives the state to load and changes nothing, as FSDP1's
    call: an optimizer with state keeps it, a fresh one stays without; loading the result gives
    the saved state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        optim.zero_grad()

    def exp_avg():
        return optim.state[model.weight]["exp_avg"].to_local()

    step()
    # A copy: at world 1 torch's full state dict shares the optimizer's tensors.
    saved = copy.deepcopy(get_optimizer_state_dict(model, optim,
                                                   options=StateDictOptions(full_state_dict=True)))
    saved_exp_avg = exp_avg().clone()
    step()
    before = exp_avg().clone()
    to_load = runtime.fsdp1_optim_state_dict_to_load(model, optim, saved)
    out = {"kept": torch.equal(exp_avg(), before)}
    optim.load_state_dict(to_load)
    out["loads the saved"] = torch.equal(exp_avg(), saved_exp_avg)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    runtime.fsdp1_optim_state_dict_to_load(model, fresh, saved)
    out["fresh stays fresh"] = len(fresh.state) == 0
    return out


def _unsharded_while_initialising(runtime):
    """A model built on meta, synced with sync_module_states and a param_init_fn, under a wrap
    policy of three blocks: how many of its parameters are materialised and not yet sharded each
    time param_init_fn runs. FSDP1 does one unit at a time, so never more than one block's."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3)])
    counts = []

    def init(module):
        module.to_empty(device=torch.device("cpu"), recurse=False)
        counts.append(sum(not p.is_meta and type(p) is nn.Parameter for p in model.parameters()))

    runtime.fsdp1_fully_shard(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), sync_module_states=True,
                              param_init_fn=init, device_id=torch.device("cpu"))
    return counts


def test_runtime_helpers_in_a_process_group():
    (result,) = run_world(_checks, 1)
    assert result["fsdp1 units"] is True  # what FSDP.fsdp_modules gives, not []
    assert result["fsdp1 roots"] is True
    assert result["fsdp2 units"] == [True, True]
    assert result["sync steps"] == [("move", "cpu"), ("broadcast", "cpu")]
    # Four parameters per block (two Linear layers): the second block is materialised after the
    # first is sharded (its parameters are DTensors then), and so on. param_init_fn is called on
    # every module of a unit, the block's container first (as FSDP1 does).
    assert result["unsharded at each init"] == [0, 2, 4, 0, 2, 4, 0, 2, 4]
    assert result["to_load leaves the optimizer"] == {"kept": True, "loads the saved": True,
                                                      "fresh stays fresh": True}
