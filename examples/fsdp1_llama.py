"""FSDP1 (`FullyShardedDataParallel`) on fsdp_bridge's engine: torch's FSDP1 code, with the
imports of `torch.distributed.fsdp` changed to `fsdp_bridge.fsdp`. Run it on 2 CPU ranks from
the repository's root:

    torchrun --standalone --nproc_per_node 2 examples/fsdp1_llama.py

Each decoder layer is a unit (torch's transformer_auto_wrap_policy), the rest is the root's.
`fsdp_bridge/examples/fsdp1_train_llama.py` is a longer FSDP1 script: the one `fsdp-bridge demo`
migrates.
"""

import functools

from common import run
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_bridge.fsdp import FullyShardedDataParallel as FSDP  # was: torch.distributed.fsdp
from fsdp_bridge.fsdp import ShardingStrategy  # was: torch.distributed.fsdp
from fsdp_bridge.fsdp.wrap import transformer_auto_wrap_policy  # was: torch.distributed.fsdp.wrap


def shard(model):
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={LlamaDecoderLayer})
    return FSDP(model, auto_wrap_policy=policy, sharding_strategy=ShardingStrategy.FULL_SHARD,
                use_orig_params=True)


if __name__ == "__main__":
    run(shard, __file__)
