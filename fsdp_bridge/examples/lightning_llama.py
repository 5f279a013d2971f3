"""A Lightning Trainer training a tiny Llama with an FSDP strategy, on fsdp_bridge's engine:
the one change from the same script on Lightning's FSDPStrategy (torch's FSDP1,
`lightning_llama_native.py`) is the strategy's import. (Passing the strategy by name, the
change is `strategy="fsdp"` -> `strategy="fsdp_bridge"` after importing
`fsdp_bridge.integrations.lightning`.) Random weights and random tokens, nothing downloaded.
Run it on 2 CPU ranks:

    python -m torch.distributed.run --nproc_per_node 2 -m fsdp_bridge.examples.lightning_llama

Rank 0 prints `step N loss X` (the mean over the global batch) after each optimizer step. With
`--out DIR` it saves a checkpoint after step 2 (`DIR/last.ckpt`, through Lightning's
ModelCheckpoint); `--resume DIR/last.ckpt` continues from it (`ckpt_path`) to `--steps`. Each
step takes the batch of its global step, so a resumed run sees the batches an uninterrupted one
would (Lightning restarts a plain DataLoader from its first batch when resuming mid-epoch).
`--generate` prints a few greedily generated tokens at the end (through the wrapped model's
forward so that a sharded root gathers its parameters) and the devices of
the parameters.
"""

import os

import torch

from fsdp_bridge.examples import frameworks as F
from fsdp_bridge.integrations.lightning import FSDPStrategy


def lightning_module(steps):
    import lightning as L

    class TinyLlama(L.LightningModule):
        def __init__(self, steps):
            super().__init__()
            self.model = F.tiny_llama()
            self.batches = F.token_rows(steps).view(steps, F.world_size(), F.PER_DEVICE, F.SEQ)

        def forward(self, ids):
            return F.generate(self.model, ids)

        def training_step(self, unused, index):
            ids = self.batches[self.global_step, self.global_rank].to(self.device)
            loss = self.model(input_ids=ids, labels=ids).loss
            mean = F.global_mean(loss)
            if self.global_rank == 0:
                print(f"step {self.global_step + 1} loss {mean:.6f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-3)

    return TinyLlama(steps)


def main():
    args = F.parse_args(__doc__.splitlines()[0])
    F.require_torchrun(__file__)
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy = F.on_this_machine(FSDPStrategy)(auto_wrap_policy={LlamaDecoderLayer})
    gpu = torch.cuda.is_available()
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu",
                        devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                        max_steps=args.steps,
                        precision="bf16-mixed" if args.bf16 else "32-true", logger=False,
                        enable_checkpointing=bool(args.out), callbacks=[ModelCheckpoint(
                            dirpath=args.out, every_n_train_steps=F.SAVE_STEP, save_top_k=0,
                            save_last=True)] if args.out else [],
                        enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False)
    module = lightning_module(args.steps)
    steps = torch.utils.data.DataLoader(range(args.steps), batch_size=None)  # see training_step
    trainer.fit(module, steps, ckpt_path=args.resume)
    if args.generate:
        with torch.no_grad():
            tokens = trainer.strategy.model(F.prompt(module.device))
        F.print_generated(tokens, trainer.strategy.model)


if __name__ == "__main__":
    main()
