"""Hugging Face's Trainer training a tiny Llama with FSDP2, on fsdp_bridge's engine: the one
change from the same script on torch's FSDP2 (`hf_trainer_llama_native.py`) is the Trainer's
import. Random weights and random tokens, nothing downloaded. Run it on 2 CPU ranks:

    python -m torch.distributed.run --nproc_per_node 2 -m fsdp_bridge.examples.hf_trainer_llama

The Trainer logs `{'loss': ..., 'grad_norm': ...}` after every step (rank 0). With `--out DIR`
it saves a checkpoint every 2 steps (`DIR/checkpoint-2`, ...); `--resume DIR/checkpoint-2`
continues from one (`resume_from_checkpoint`) to `--steps`. `--generate` prints a few
greedily generated tokens at the end, and the devices of the parameters.
"""

import tempfile

import torch

from fsdp_bridge.examples import frameworks as F
from transformers import Trainer


class Tokens(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


def main():
    args = F.parse_args(__doc__.splitlines()[0])
    F.require_torchrun(__file__)
    # Without --out nothing is saved: the Trainer's output folder is a temporary one.
    with tempfile.TemporaryDirectory(prefix="hf_trainer_llama-") as scratch:
        train(args, args.out or scratch)


def train(args, output_dir: str):
    from transformers import TrainingArguments

    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps,
        per_device_train_batch_size=F.PER_DEVICE, learning_rate=1e-3, max_grad_norm=1.0,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=0, bf16=args.bf16,
        save_strategy="steps" if args.out else "no", save_steps=F.SAVE_STEP, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True,
                                "transformer_layer_cls_to_wrap": [F.LLAMA_LAYER]})
    trainer = F.on_this_machine(Trainer)(model=F.tiny_llama(), args=training,
                                         train_dataset=Tokens(F.token_rows(args.steps)))
    trainer.train(resume_from_checkpoint=args.resume)
    if args.generate:
        tokens = F.generate(trainer.model, F.prompt(trainer.args.device))
        F.print_generated(tokens, trainer.model)


if __name__ == "__main__":
    main()
