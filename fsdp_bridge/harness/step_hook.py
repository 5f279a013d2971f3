"""The optimizer step hook that `compare-scripts` injects (see _site/sitecustomize.py).

After every optimizer step, every rank takes part in one small all-gather (the digest's), and
rank 0 appends {"step", "sum", "sumsq", "sum4", "grad_norm", "numel"} to digests.jsonl. The
script's ranks must step their optimizers in lockstep, as data-parallel training does.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_bridge.harness.digest import global_digest

FILE_NAME = "digests.jsonl"


def install(out_dir: str) -> None:
    path = os.path.join(out_dir, FILE_NAME)
    steps = [0]

    def after_step(optimizer, args, kwargs) -> None:
        steps[0] += 1
        params = [p for group in optimizer.param_groups for p in group["params"]]
        with torch.no_grad():
            digest = global_digest(params)
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(path, "a") as handle:
                handle.write(json.dumps({"step": steps[0], **digest.as_dict()}) + "\n")

    register_optimizer_step_post_hook(after_step)
