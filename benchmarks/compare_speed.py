"""Speed of `fsdp-bridge compare` against the same trainings run back to back by hand.

The target: comparing 3 backends for 5 steps on the tiny Llama at world 2 takes at most
1.3x the time of the three trainings run one after the other by hand. "By hand" is what a user
would type: `python train.py` for the single-process reference, then `torchrun --nproc_per_node 2`
for FSDP1 and for FSDP2, each a plain training loop (this file, `--hand BACKEND`) with no
digests or comparison. Both sides are timed end to end as subprocesses (interpreter start,
imports, process spawn included), side by side in one run, alternating for --repeats rounds.

    .venv/bin/python benchmarks/compare_speed.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("reference", "torch-fsdp1", "torch-fsdp2")
STEPS = 5


def hand_training(backend_name: str) -> None:
    """A plain training loop, the way a user writes it (run under torchrun for FSDP)."""
    import torch
    import torch.distributed as dist

    from fsdp_bridge.harness.backends import RankEnv, get_backend
    from fsdp_bridge.harness.recipes import builtin_recipe, micro_batches
    from fsdp_bridge.harness.teardown import leave_world

    recipe = builtin_recipe("tiny-llama", steps=STEPS)
    backend = get_backend(backend_name)
    world, rank = 1, 0
    if backend.distributed:
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    env = RankEnv(rank, world, torch.device("cpu"))
    model = backend.wrap(recipe.build_model(), recipe, env)
    optimizer = recipe.build_optimizer(model.parameters())
    for step in range(1, STEPS + 1):
        (batch,) = micro_batches(recipe, recipe.batch(step), rank, world)
        loss = recipe.loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}")
    if backend.distributed:
        leave_world()  # [Note: gloo teardown abort] in fsdp_bridge/harness/teardown.py


def _timed(command: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=ROOT)
    started = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return time.perf_counter() - started


def by_hand() -> float:
    total = 0.0
    for backend in BACKENDS:
        command = [sys.executable, __file__, "--hand", backend]
        if backend != "reference":
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node=2", __file__, "--hand", backend]
        total += _timed(command)
    return total


def with_harness() -> float:
    return _timed([sys.executable, "-m", "fsdp_bridge", "compare", "--recipe", "tiny-llama",
                   "--backends", ",".join(BACKENDS), "--nproc", "2", "--steps", str(STEPS)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hand", choices=BACKENDS, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.hand:
        with contextlib.redirect_stderr(open(os.devnull, "w")):
            hand_training(args.hand)
        return 0
    hand, harness = [], []
    for round_ in range(args.repeats):
        hand.append(by_hand())
        harness.append(with_harness())
        print(f"round {round_ + 1}: by hand {hand[-1]:.1f} s, harness {harness[-1]:.1f} s, "
              f"ratio {harness[-1] / hand[-1]:.2f}", flush=True)
    ratio = statistics.median(harness) / statistics.median(hand)
    print(f"median: by hand {statistics.median(hand):.1f} s, harness "
          f"{statistics.median(harness):.1f} s -> ratio {ratio:.2f} (target <= 1.30)")
    return 0 if ratio <= 1.3 else 1


if __name__ == "__main__":
    sys.exit(main())
