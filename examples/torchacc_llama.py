"""TorchAcc's `Config` and `accelerate` on fsdp_bridge's engine: TorchAcc's code, with
`import torchacc` changed to `import fsdp_bridge.torchacc`. Run it on 2 CPU ranks from the
repository's root:

    torchrun --standalone --nproc_per_node 2 examples/torchacc_llama.py
"""

import torch.distributed as dist
from common import run

import fsdp_bridge.torchacc as ta  # was: import torchacc as ta


def shard(model):
    config = ta.Config()
    config.dist.fsdp.size = dist.get_world_size()  # FSDP over every rank
    config.dist.fsdp.wrap_layer_cls = {"LlamaDecoderLayer"}  # class names, as TorchAcc takes them
    return ta.accelerate(model, config=config)


if __name__ == "__main__":
    run(shard, __file__)
