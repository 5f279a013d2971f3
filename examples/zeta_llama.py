"""Zeta's `fsdp()` on fsdp_bridge's engine: the call of Zeta's wrapper, with the import of
`zeta.training` changed to `fsdp_bridge.zeta`. Zeta's own traps are fixed with clear errors
(`shard_strat="SHARD_GRAD_OP"` is accepted, `auto_wrap=True` needs the block class). Run it on
2 CPU ranks from the repository's root:

    torchrun --standalone --nproc_per_node 2 examples/zeta_llama.py
"""

from common import run
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from fsdp_bridge.zeta import fsdp  # was: from zeta.training import fsdp


def shard(model):
    return fsdp(model, auto_wrap=True, mp="fp32", shard_strat="FULL_SHARD",
                TransformerBlock=LlamaDecoderLayer)


if __name__ == "__main__":
    run(shard, __file__)
