"""FSDP2 (`fully_shard`) on fsdp_bridge's engine: torch's FSDP2 code, with the import of
`torch.distributed.fsdp` changed to `fsdp_bridge.fsdp`. The parameters become DTensors sharded
by rows, as natively. Run it on 2 CPU ranks from the repository's root:

    torchrun --standalone --nproc_per_node 2 examples/fsdp2_llama.py
"""

from common import run

from fsdp_bridge.fsdp import fully_shard  # was: from torch.distributed.fsdp import fully_shard


def shard(model):
    for layer in model.model.layers:  # bottom-up: each decoder layer, then the root
        fully_shard(layer)
    fully_shard(model)
    return model


if __name__ == "__main__":
    run(shard, __file__)
