"""`fsdp1_to_yafsdp` (the `--to yafsdp` runtime helper) with FSDP1's low-memory recipe: a model
on meta, `sync_module_states=True` and a `param_init_fn`. FSDP1 materialises, broadcasts and
shards one unit of the wrap policy at a time, so a model larger than one device fits; the helper
must not do the whole model first. Counted in a 2-rank world: how many parameters are
materialised and not yet sharded each time param_init_fn runs."""

import torch
from torch import nn

from tests.world import run_world


def _unsharded_while_initialising(rank, world_size):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from fsdp_bridge.migrate import runtime

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3)])
    counts = []

    def whole(p: nn.Parameter) -> bool:  # materialised in its own storage: not a view of a shard
        return not p.is_meta and p.untyped_storage().nbytes() == p.numel() * p.element_size()

    def init(module):
        module.to_empty(device=torch.device("cpu"), recurse=False)
        counts.append(sum(whole(p) for p in model.parameters()))

    runtime.fsdp1_to_yafsdp(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), sync_module_states=True,
                            param_init_fn=init, device_id=torch.device("cpu"))
    return counts, sum(whole(p) for p in model.parameters())


def test_yafsdp_helper_initialises_one_unit_at_a_time():
    for counts, left_whole in run_world(_unsharded_while_initialising, 2):
        # Four parameters per block: each block is materialised after the one before is sharded
        # (its container first, then its two Linear layers), and none is left whole at the end.
        assert counts == [0, 2, 4, 0, 2, 4, 0, 2, 4]
        assert left_whole == 0
