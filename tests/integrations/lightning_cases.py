"""Rank-side cases of test_lightning.py: a Lightning Trainer with `ModelParallelStrategy` whose
LightningModule shards in `configure_model`, with torch's `fully_shard` and with ours."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests import models as M
from tests.frontends.parity_cases import dialect
from tests.integrations.common import engine_of, full_state
from tests.world import run_case_table

STEPS = 3
PER_DEVICE = 4


def as_torchrun_rank() -> None:
    """Describe this spawned rank as torchrun does: Lightning then joins the process group
    that is already there instead of launching processes of its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", GROUP_RANK="0")


def lightning_module(which):
    import lightning as L

    class TinyLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = M.tiny_llama()
            self.losses = []

        def configure_model(self):
            fsdp = dialect(which)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fsdp.fully_shard(layer, mesh=mesh)
            fsdp.fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(M.global_mean(loss.item()))
            return loss

        def configure_optimizers(self):
            return M.make_adamw(self.model.parameters())

    return TinyLlama()


def model_parallel_strategy(rank, world, folder):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    as_torchrun_rank()
    data = M.global_batches(STEPS, PER_DEVICE * world).reshape(-1, M.SEQ)
    out = {}
    for which in ("native", "ours"):
        module = lightning_module(which)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(),
                            max_steps=STEPS, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        loader = torch.utils.data.DataLoader(list(data), batch_size=PER_DEVICE)
        trainer.fit(module, loader)
        path = os.path.join(folder, which)
        trainer.save_checkpoint(path)
        out[which] = {"losses": module.losses, "state": full_state(module.model),
                      "engine": engine_of(module.model), "saved": os.path.isdir(path)}
    return out


CASES = {"model_parallel_strategy": model_parallel_strategy}


def run_cases(rank, world, names, folder):
    table = {name: (lambda fn: lambda r, w: fn(r, w, folder))(CASES[name]) for name in names}
    return run_case_table(table)
