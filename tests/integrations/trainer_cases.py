"""Rank-side cases of test_transformers_trainer.py: one HF Trainer script run with
`transformers.Trainer` (native FSDP2 through accelerate) and with
`fsdp_bridge.integrations.transformers.Trainer` (our engine), on the CPU through the test-only
FSDP switch (accelerate_cpu.py). Each case returns {"native": ..., "ours": ...}."""

from __future__ import annotations

import os

import torch

from tests import models as M
from tests.integrations.accelerate_cpu import fresh_accelerate_state, trainer_on_cpu_fsdp
from tests.integrations.common import engine_of, full_state
from tests.world import run_case_table

STEPS = 4
PER_DEVICE = 4
WHICH = ("native", "ours")


def trainer_class(which):
    if which == "native":
        from transformers import Trainer
    else:
        from fsdp_bridge.integrations.transformers import Trainer
    return trainer_on_cpu_fsdp(Trainer)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, world):
        self.ids = M.global_batches(STEPS, PER_DEVICE * world).reshape(-1, M.SEQ)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def make_trainer(which, world, folder, bf16, model=None):
    from transformers import TrainingArguments

    fresh_accelerate_state()
    args = TrainingArguments(
        output_dir=folder, max_steps=STEPS, per_device_train_batch_size=PER_DEVICE,
        learning_rate=1e-3, adam_epsilon=1e-5, weight_decay=0.1, max_grad_norm=1.0,
        lr_scheduler_type="constant", logging_steps=1, save_steps=2, save_strategy="steps",
        report_to=[], seed=0, bf16=bf16, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True,
        fsdp="full_shard", fsdp_config={"version": 2,
                                        "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    model = M.tiny_llama() if model is None else model
    return trainer_class(which)(model=model, args=args, train_dataset=Tokens(world))


def _logged(trainer, after_step=0):
    history = [entry for entry in trainer.state.log_history
               if "loss" in entry and entry["step"] > after_step]
    return [entry["loss"] for entry in history], [entry["grad_norm"] for entry in history]


def train_generate_resume(rank, world, folder, bf16):
    out = {}
    prompt = M.global_batches(1, 2)[0][:, :5]
    for which in WHICH:
        run_folder = os.path.join(folder, f"{which}-{'bf16' if bf16 else 'fp32'}")
        trainer = make_trainer(which, world, run_folder, bf16)
        trainer.train()
        losses, norms = _logged(trainer)
        with torch.no_grad():
            tokens = trainer.model.generate(prompt, max_new_tokens=3, do_sample=False,
                                            pad_token_id=0)
        out[which] = {"losses": losses, "norms": norms, "state": full_state(trainer.model),
                      "tokens": tokens, "root": type(trainer.model).__name__,
                      "processes": trainer.accelerator.num_processes,
                      "engine": engine_of(trainer.model)}
    for which, source in (("native", "native"), ("ours", "ours"), ("ours_from_native", "native")):
        dialect = "ours" if which.startswith("ours") else "native"
        checkpoint = os.path.join(folder, f"{source}-{'bf16' if bf16 else 'fp32'}",
                                  "checkpoint-2")
        trainer = make_trainer(dialect, world, os.path.join(folder, f"resume-{which}"), bf16,
                               model=M.tiny_llama(seed=1))
        trainer.train(resume_from_checkpoint=checkpoint)
        out.setdefault(which, {})["resumed"] = _logged(trainer, after_step=2)[0]
    return out


CASES = {
    "fp32": lambda rank, world, folder: train_generate_resume(rank, world, folder, False),
    "bf16": lambda rank, world, folder: train_generate_resume(rank, world, folder, True),
}


def run_cases(rank, world, names, folder):
    table = {name: (lambda fn: lambda r, w: fn(r, w, folder))(CASES[name]) for name in names}
    return run_case_table(table)
