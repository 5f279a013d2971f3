"""A Lightning Trainer training a tiny Llama with an FSDP strategy, on fsdp_bridge's engine:
the one change from the same script on Lightning's FSDPStrategy (torch's FSDP1,
`lightning_llama_native.py`) is the strategy's import. (Passing the strategy by name, the
change is `strategy="fsdp"` -> `strategy="fsdp_bridge"` after importing
`fsdp_bridge.integrations.lightning`.) Random weights and random tokens, nothing downloaded.
Run it on 2 CPU ranks:

    python -m torch.distributed.run --nproc_per_node 2 -m fsdp_bridge.examples.lightning_llama

Rank 0 prints `step N loss X` (the mean over the global batch) after each optimizer step. With
`--out DIR` it saves a full checkpoint at the end (`DIR/last.ckpt`).
"""

import os

import torch

from fsdp_bridge.examples import frameworks as F
from fsdp_bridge.integrations.lightning import FSDPStrategy


def lightning_module():
    import lightning as L

    class TinyLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = F.tiny_llama()

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch, labels=batch).loss
            mean = F.global_mean(loss)
            if self.global_rank == 0:
                print(f"step {self.global_step + 1} loss {mean:.6f}", flush=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.trainer.model.parameters(), lr=1e-3)

    return TinyLlama()


def main():
    args = F.parse_args(__doc__.splitlines()[0])
    F.require_torchrun(__file__)
    import lightning as L
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    strategy = F.on_this_machine(FSDPStrategy)(auto_wrap_policy={LlamaDecoderLayer})
    gpu = torch.cuda.is_available()
    trainer = L.Trainer(accelerator="gpu" if gpu else "cpu",
                        devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy, max_steps=args.steps,
                        precision="bf16-mixed" if args.bf16 else "32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    rows = F.token_rows(args.steps)
    loader = torch.utils.data.DataLoader(list(rows), batch_size=F.PER_DEVICE)
    trainer.fit(lightning_module(), loader)
    if args.out:
        trainer.save_checkpoint(os.path.join(args.out, "last.ckpt"))


if __name__ == "__main__":
    main()
