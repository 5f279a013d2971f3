"""Train one recipe under one backend on this rank, recording what the comparison needs.

Per step: the global mean loss (before the update), the global gradient norm and the parameter
digest (after the update, with this step's gradients still in place). Step 0 holds the digest of
the initial weights. At the end: the full state dict.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
from typing import Optional

import torch
import torch.distributed as dist

from fsdp_bridge.harness.backends import Backend, RankEnv
from fsdp_bridge.harness.digest import Digest, global_digest
from fsdp_bridge.harness.recipes import Recipe, micro_batches, reference_micro_batches


@dataclasses.dataclass
class StepRecord:
    step: int
    loss: Optional[float]  # None at step 0
    grad_norm: Optional[float]
    digest: Digest
    # One unit of the last digit the loss was printed with (compare-scripts reads printed
    # losses; two roundings to it differ by up to one unit); 0.0: the exact value.
    loss_quantum: float = 0.0
    # The total norm clip_grad_norm_ returned before clipping (None: the recipe does not clip).
    clip_norm: Optional[float] = None


@dataclasses.dataclass
class RunRecord:
    """One backend's run, as seen by rank 0."""

    backend: str
    world_size: int
    steps: list[StepRecord] = dataclasses.field(default_factory=list)
    state_dict: dict = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    error: Optional[str] = None


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _to_device(batch, device: torch.device):
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def _local_micro_batches(backend: Backend, recipe: Recipe, env: RankEnv, step: int) -> list:
    batch = recipe.batch(step)
    if backend.distributed:
        parts = micro_batches(recipe, batch, env.rank, env.world_size)
    elif recipe.mp != "fp32":  # [Note: the reference under mixed precision] in backends.py
        parts = [part for rank in range(env.world_size)
                 for part in micro_batches(recipe, batch, rank, env.world_size)]
    else:
        parts = reference_micro_batches(recipe, batch, env.world_size)
    return [_to_device(part, env.device) for part in parts]


def _train_step(backend: Backend, recipe: Recipe, env: RankEnv, model, optimizer,
                step: int) -> StepRecord:
    backend.before_step(model, step, env)
    parts = _local_micro_batches(backend, recipe, env, step)
    scale = 1.0 / len(parts)
    total = torch.zeros((), dtype=torch.float64, device=env.device)
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        with contextlib.nullcontext() if last else backend.no_sync(model):
            loss = recipe.loss_fn(model, part)
            (loss * scale if backend.user_divides_loss else loss).backward()
        total += loss.detach().to(torch.float64) * scale
    clip_norm = None
    if recipe.max_grad_norm is not None:
        clip_norm = _as_float(backend.clip_grad_norm(model, recipe.max_grad_norm))
    optimizer.step()
    digest = global_digest(model.parameters(), distributed=backend.distributed)
    backend.zero_grad(optimizer)
    if backend.distributed and env.world_size > 1:
        dist.all_reduce(total)
        total /= env.world_size
    return StepRecord(step, float(total), digest.grad_norm, digest, clip_norm=clip_norm)


def _as_float(norm) -> float:
    """A returned norm as a float (FSDP2's is a DTensor: its full value)."""
    full_tensor = getattr(norm, "full_tensor", None)
    return float(full_tensor() if full_tensor is not None else norm)


def train(backend: Backend, recipe: Recipe, env: RankEnv) -> RunRecord:
    """Train `recipe` under `backend` on this rank (every rank calls it; rank 0 alone for a
    non-distributed backend). Errors are recorded in the result, not raised."""
    record = RunRecord(backend.name, env.world_size if backend.distributed else 1)
    started = time.perf_counter()
    try:
        model = backend.wrap(backend.build_model(recipe, env), recipe, env)
        optimizer = backend.build_optimizer(model, recipe, env)
        initial = global_digest(model.parameters(), distributed=backend.distributed)
        record.steps.append(StepRecord(0, None, None, initial))
        for step in range(1, recipe.steps + 1):
            record.steps.append(_train_step(backend, recipe, env, model, optimizer, step))
            model, optimizer = backend.after_step(model, optimizer, recipe, env, step)
        record.state_dict = backend.full_state_dict(model)
    except Exception:  # noqa: BLE001 - reported per backend, the others still run
        record.error = traceback.format_exc()
    record.seconds = time.perf_counter() - started
    return record
