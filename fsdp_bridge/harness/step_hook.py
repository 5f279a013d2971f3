"""The optimizer step hook that `compare-scripts` injects (see _site/sitecustomize.py).

After every optimizer step, every rank takes part in one small all-gather (the digest's), and
rank 0 appends {"step", "sum", "sumsq", "sum4", "grad_norm", "numel"} to digests.jsonl. The
script's ranks must step their optimizers in lockstep, as data-parallel training does.

At the first step rank 0 also writes fsdp.json: how many live modules each FSDP implementation
wrapped (and DDP's, which shards nothing), so that the report can say what actually ran: a
launcher may fall back from FSDP to DDP without a word (accelerate does on CPU).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from fsdp_bridge.harness.digest import global_digest

FILE_NAME = "digests.jsonl"
WRAPPERS_FILE = "fsdp.json"
NOT_SHARDED = "DistributedDataParallel"  # a data-parallel wrapper that shards nothing

# (name in the report, module defining the class, class). A module counts for the first match;
# only modules the script imported are looked at. A wrapper of ours holding a whole model counts
# the units of its plan (the modules it wraps, as native FSDP1 nests one instance per unit).
WRAPPER_CLASSES = (
    ("fsdp-bridge fully_shard", "fsdp_bridge.fsdp._fully_shard", "FSDPModule"),
    ("fsdp-bridge YaFSDP", "fsdp_bridge.ya_fsdp.ya_fsdp", "YaFSDP"),
    ("fsdp-bridge (FSDP1 / Zeta / TorchAcc front-end)", "fsdp_bridge.wrapper", "ShardedWrapper"),
    ("torch FSDP1", "torch.distributed.fsdp", "FullyShardedDataParallel"),
    ("torch FSDP2", "torch.distributed.fsdp", "FSDPModule"),
    (NOT_SHARDED, "torch.nn.parallel", "DistributedDataParallel"),
)


def wrapped_modules() -> dict[str, int]:
    """How many live modules each implementation of WRAPPER_CLASSES wrapped."""
    classes = [(name, getattr(sys.modules[module], cls)) for name, module, cls in WRAPPER_CLASSES
               if module in sys.modules and hasattr(sys.modules[module], cls)]
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Module):
            for name, cls in classes:
                if isinstance(obj, cls):
                    counts[name] = counts.get(name, 0) + _units(obj)
                    break
    return counts


def _units(module) -> int:
    plan = getattr(getattr(module, "_sharded", None), "plan", None)
    return len(plan.units) if plan is not None else 1


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
            if steps[0] == 1:
                with open(os.path.join(out_dir, WRAPPERS_FILE), "w") as handle:
                    json.dump(wrapped_modules(), handle)

    register_optimizer_step_post_hook(after_step)
