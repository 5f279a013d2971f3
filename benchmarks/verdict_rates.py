"""How often is the harness's verdict wrong? False-positive and false-negative rates, measured.

Trains the tiny Llama (the `compare` recipe) for 200 steps under a baseline and under a set of
variants, in one process, and asks every verdict path whether each variant is equivalent to the
baseline:

- equivalent variants (must be called equivalent): a second run of the baseline, the gradient
  reduction summed in the reverse order, and world sizes 2 and 8 instead of 4;
- changed variants (must not be): learning rate +1 % and -1 %, weight decay 0.01 -> 0.02, the
  gradient clip dropped (the baseline clips at max_norm 0.5, below every step's gradient norm,
  so it bites at every step), and gradients reduced in bf16 instead of fp32.

Data parallelism is simulated exactly as it rounds: the global batch is split into `world`
shards, each shard's gradient is computed on its own and the shards' gradients are summed in a
given order (in the given reduce dtype), then divided by the world size, as an all-reduce does.

Each run is judged on three paths: "compare" (loss, gradient norm and parameter digest per step,
plus the final state dict: what `compare` sees), "scripts" (the same without the state dict:
what `compare-scripts` sees) and "loss only" (what `compare-scripts` sees when no torch optimizer
step could be hooked), in fp32 and in bf16 compute (autocast), each with its dtype's default
tolerance. Verdicts:
"old" is the per-step check with the tolerance growing linearly from step 1 (the previous
default; within tolerance was "equivalent"), "new" is the current default: growth "window" and
"inconclusive" when a 1 % learning-rate change could not have been seen
(fsdp_bridge/harness/resolution.py). Wrong = a false positive (equivalent called different) or a
false negative (a change called equivalent); "inconclusive" is neither and is counted apart.

    .venv/bin/python benchmarks/verdict_rates.py [--seeds 3] [--steps 200] [--cache FILE]

60 runs of 200 steps (10 setups x 2 dtypes x 3 seeds): about 7 s a run on one core of an idle
machine, so about 7 minutes; `--compute fp32` and `--compute bf16` in two processes with one
`--cache` each use both cores (the table is then printed from a cache holding both).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from fsdp_bridge.harness.compare import (  # noqa: E402
    DIFFERENT,
    EQUIVALENT,
    INCONCLUSIVE,
    STRICT_STEPS,
    Comparison,
    compare_state_dicts,
    compare_steps,
    tolerance_for,
)
from fsdp_bridge.harness.digest import Digest, global_digest  # noqa: E402
from fsdp_bridge.harness.recipes import builtin_recipe  # noqa: E402
from fsdp_bridge.harness.runner import StepRecord  # noqa: E402

PATHS = ("compare", "scripts", "loss only")


@dataclasses.dataclass(frozen=True)
class Setup:
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_norm: float | None = 0.5
    world: int = 4
    reverse: bool = False  # sum the shards' gradients last to first
    reduce_dtype: str = "fp32"


BASELINE = Setup()
SAME = {
    "repeat": BASELINE,
    "reduction reversed": Setup(reverse=True),
    "world 2": Setup(world=2),
    "world 8": Setup(world=8),
}
CHANGED_SETUPS = {
    "lr +1%": Setup(lr=1.01e-3),
    "lr -1%": Setup(lr=0.99e-3),
    "weight decay x2": Setup(weight_decay=0.02),
    "clip dropped": Setup(max_norm=None),
    "bf16 reduce": Setup(reduce_dtype="bf16"),
}


def train(setup: Setup, compute: str, seed: int, steps: int) -> dict:
    """Per step: loss, and the digest after the update; at the end the state dict."""
    recipe = builtin_recipe("tiny-llama", steps=steps, seed=seed)
    model = recipe.build_model()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=setup.lr, weight_decay=setup.weight_decay)
    reduce_dtype = torch.bfloat16 if setup.reduce_dtype == "bf16" else torch.float32
    rows = recipe.global_batch // setup.world
    losses, digests = [], []
    for step in range(1, steps + 1):
        batch = recipe.batch(step)
        shard_grads, shard_losses = [], []
        for shard in range(setup.world):
            with torch.autocast("cpu", torch.bfloat16, enabled=compute == "bf16"):
                loss = recipe.loss_fn(model, batch[shard * rows:(shard + 1) * rows])
            shard_grads.append(torch.autograd.grad(loss, params))
            shard_losses.append(float(loss.detach()))
        order = shard_grads[::-1] if setup.reverse else shard_grads
        for index, param in enumerate(params):
            total = order[0][index].to(reduce_dtype)
            for grads in order[1:]:
                total = total + grads[index].to(reduce_dtype)
            param.grad = (total / setup.world).to(param.dtype)
        if setup.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, setup.max_norm)
        optimizer.step()
        digests.append(global_digest(params, distributed=False).as_dict())
        optimizer.zero_grad()
        losses.append(sum(shard_losses) / setup.world)
    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    return {"losses": losses, "digests": digests, "state": state}


def records(run: dict, with_digest: bool) -> list[StepRecord]:
    out = []
    for step, (loss, row) in enumerate(zip(run["losses"], run["digests"]), start=1):
        digest = Digest(**row) if with_digest else None
        out.append(StepRecord(step, loss, digest.grad_norm if digest else None, digest))
    return out


def verdict(base: dict, cand: dict, compute: str, path: str, growth: str) -> str:
    """The outcome under `growth` ("window": the default; "linear": the previous default, which
    had no "inconclusive": within tolerance was "equivalent")."""
    tol = tolerance_for(compute, growth=growth)
    comparison = Comparison("baseline", "candidate")
    with_digest = path != "loss only"
    compare_steps(records(base, with_digest), records(cand, with_digest), tol, comparison)
    if path == "compare":
        compare_state_dicts(base["state"], cand["state"], tol.at_step(len(base["losses"])),
                            comparison)
    if growth == "linear":
        return EQUIVALENT if comparison.ok else DIFFERENT
    return comparison.outcome


def collect(computes: list[str], seeds: int, steps: int, cache: str | None) -> dict:
    """Every run, reusing those already in `cache` (saved after each run)."""
    runs = torch.load(cache) if cache and os.path.exists(cache) else {}
    variants = {"baseline": BASELINE, **SAME, **CHANGED_SETUPS}
    for compute in computes:
        for seed in range(seeds):
            for name, setup in variants.items():
                if (compute, seed, name) in runs:
                    continue
                started = time.perf_counter()
                runs[(compute, seed, name)] = train(setup, compute, seed, steps)
                print(f"  {compute} seed {seed} {name}: {time.perf_counter() - started:.1f} s",
                      file=sys.stderr, flush=True)
                if cache:
                    torch.save(runs, cache)
    return runs


def _wrong(expected: str, outcome: str) -> bool:
    """A false positive (equivalent called different) or a false negative (a change called
    equivalent); "inconclusive" is neither, and counted apart."""
    return outcome != INCONCLUSIVE and outcome != expected


def table(runs: dict) -> list[str]:
    """One row per (compute dtype, path, variant): how many seeds each verdict got wrong, then
    the rates per (compute dtype, path)."""
    lines = [f"{'compute':8}{'path':10}{'variant':20}{'expected':12}{'old wrong':>10}"
             f"{'new wrong':>10}  new outcomes (d: different, e: equivalent, ?: inconclusive)"]
    totals: dict[tuple, list[int]] = {}
    for compute in sorted({key[0] for key in runs}, reverse=True):
        seeds = sorted({key[1] for key in runs if key[0] == compute})
        for path in PATHS:
            for name in [*SAME, *CHANGED_SETUPS]:
                expected = EQUIVALENT if name in SAME else DIFFERENT
                pairs = [(runs[(compute, seed, "baseline")], runs[(compute, seed, name)])
                         for seed in seeds if (compute, seed, name) in runs]
                old = [verdict(*pair, compute, path, "linear") for pair in pairs]
                new = [verdict(*pair, compute, path, "window") for pair in pairs]
                counts = totals.setdefault((compute, path, expected), [0, 0, 0, 0])
                counts[0] += sum(_wrong(expected, outcome) for outcome in old)
                counts[1] += sum(_wrong(expected, outcome) for outcome in new)
                counts[2] += len(pairs)
                counts[3] += new.count(INCONCLUSIVE)
                marks = "".join({DIFFERENT: "d", EQUIVALENT: "e"}.get(o, "?") for o in new)
                lines.append(f"{compute:8}{path:10}{name:20}{expected:12}"
                             f"{sum(_wrong(expected, o) for o in old):>7}/{len(pairs)}"
                             f"{sum(_wrong(expected, o) for o in new):>7}/{len(pairs)}  {marks}")
    lines += ["", f"{'compute':8}{'path':10}{'rate':16}{'old':>8}{'new':>8}  new inconclusive"]
    for (compute, path, expected), (old, new, n, unsure) in totals.items():
        rate = "false positive" if expected == EQUIVALENT else "false negative"
        lines.append(f"{compute:8}{path:10}{rate:16}{old:>5}/{n}{new:>5}/{n}  {unsure}/{n}")
    return lines


def _ratios(base: dict, cand: dict, compute: str, path: str) -> list[float]:
    """Per step: deviation / one-step tolerance (no growth), the worst of the compared values."""
    comparison = Comparison("baseline", "candidate")
    compare_steps(records(base, path != "loss only"), records(cand, path != "loss only"),
                  tolerance_for(compute, growth="none"), comparison)
    return [check.ratio for check in comparison.steps]


def _step(step: float) -> str:
    return "never" if math.isinf(step) else f"step {step}"


def margins(runs: dict) -> list[str]:
    """What the strict window (STRICT_STEPS) rests on: how far below the one-step tolerance
    equivalent runs stay in it, when they first leave it, and when each change is first seen."""
    lines = ["", f"strict window: {STRICT_STEPS} steps"]
    for compute in sorted({key[0] for key in runs}, reverse=True):
        seeds = sorted({key[1] for key in runs if key[0] == compute})
        for path in ("scripts", "loss only"):
            same, first_out, caught = 0.0, math.inf, {}
            for seed in seeds:
                base = runs[(compute, seed, "baseline")]
                for name in [*SAME, *CHANGED_SETUPS]:
                    if (compute, seed, name) not in runs:
                        continue
                    ratios = _ratios(base, runs[(compute, seed, name)], compute, path)
                    out = next((k for k, r in enumerate(ratios, start=1) if r > 1), None)
                    if name in SAME:
                        same = max(same, max(ratios[:STRICT_STEPS]))
                        first_out = min(first_out, out or math.inf)
                    else:
                        caught[name] = max(caught.get(name, 0), out or math.inf)
            seen = ", ".join(f"{name} {_step(step)}" for name, step in caught.items())
            lines.append(f"{compute} {path}: equivalent runs reach {same:.2g} of the one-step "
                         f"tolerance in the window and first leave it: {_step(first_out)}; "
                         f"changes first leave it (worst seed): {seen}")
    return lines


def predictions(runs: dict) -> list[str]:
    """The resolution's prediction (what a 1 % learning-rate change would reach, from the
    baseline alone) beside what lr +1 % and -1 % actually reached: the prediction must not be
    larger, or "equivalent" would be said where a 1 % change could pass unseen."""
    lines = ["", "predicted reach of a 1 % learning-rate change vs reached (worst step, "
                 "deviation / allowance):"]
    for compute in sorted({key[0] for key in runs}, reverse=True):
        for path in ("scripts", "loss only"):
            cells = []
            for seed in sorted({key[1] for key in runs if key[0] == compute}):
                base = runs[(compute, seed, "baseline")]
                reached = []
                for name in ("lr +1%", "lr -1%"):
                    comparison = Comparison("baseline", name)
                    compare_steps(records(base, path != "loss only"),
                                  records(runs[(compute, seed, name)], path != "loss only"),
                                  tolerance_for(compute), comparison)
                    reached.append(max(check.ratio for check in comparison.steps))
                cells.append(f"{comparison.sensitivity:.2g} vs {min(reached):.2g}")
            lines.append(f"{compute} {path}: " + "; ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compute", default="fp32,bf16",
                        help="compute dtypes to train in, comma-separated (default fp32,bf16)")
    parser.add_argument("--cache", help="save the runs here, and reuse the runs already in it")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runs = collect(args.compute.split(","), args.seeds, args.steps, args.cache)
    print("\n".join(table(runs) + margins(runs) + predictions(runs)))


if __name__ == "__main__":
    main()
