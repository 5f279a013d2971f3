"""The harness's main entry: run a recipe under several backends and judge equivalence."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Optional, Sequence, Union

from fsdp_bridge.harness.backends import Backend
from fsdp_bridge.harness.compare import (
    Comparison,
    Tolerance,
    Verdict,
    compare_runs,
    first_nan_step,
    tolerance_for,
)
from fsdp_bridge.harness.launcher import run_backends
from fsdp_bridge.harness.recipes import Recipe
from fsdp_bridge.harness.runner import RunRecord

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Report(Verdict):
    """Everything a comparison found; rendered by report.py."""

    title: str
    settings: dict  # recipe and run settings, for the header and the JSON
    tolerance: Tolerance
    runs: list[RunRecord]
    comparisons: list[Comparison]
    seconds: float = 0.0

    def curves(self) -> dict[str, list]:
        """Per backend: [(step, loss)] (step 0 has no loss)."""
        return {run.backend: [(s.step, s.loss) for s in run.steps] for run in self.runs}

    @property
    def notes(self) -> list[str]:
        """A warning per run whose loss, gradient norm or parameters stop being finite."""
        notes = []
        for run in self.runs:
            found = first_nan_step(run.steps)
            if found is not None:
                notes.append(f"warning: {run.backend} is not finite from step {found[0]} "
                             f"({found[1]})")
        return notes

    @property
    def errors(self) -> list[str]:
        return [f"{run.backend}: {run.error}" for run in self.runs if run.error]



def recipe_settings(recipe: Recipe, nproc: int) -> dict:
    return {"recipe": recipe.name, "nproc": nproc, "steps": recipe.steps,
            "global_batch": recipe.global_batch, "micro_batches": recipe.micro_batches,
            "mp": recipe.mp, "strategy": recipe.strategy, "optimizer": recipe.optimizer,
            "lr": recipe.lr, "seed": recipe.seed}


def judge(runs: list[RunRecord], tolerance: Tolerance, baseline: int = 0) -> list[Comparison]:
    """Compare every run with runs[baseline]."""
    base = runs[baseline]
    return [compare_runs(base, run, tolerance) for i, run in enumerate(runs) if i != baseline]


def check_equivalence(recipe: Recipe, backends: Sequence[Union[str, Backend]], nproc: int = 2,
                      device: str = "auto", rtol: Optional[float] = None,
                      atol: Optional[float] = None, growth: str = "none",
                      announce: bool = False) -> Report:
    """Train `recipe` under every backend (the first is the baseline) and compare them;
    `growth`: see [Note: tolerance growth] in compare.py."""
    if len(backends) < 2:
        raise ValueError(f"backends={list(backends)!r}: name at least two backends to compare "
                         "(the first is the baseline), e.g. reference,torch-fsdp2.")
    started = time.perf_counter()
    tolerance = tolerance_for(recipe.mp, rtol, atol, growth)
    logger.info("training %s under %s in one world of %d ranks (device %s); tolerance %s",
                recipe.name, ", ".join(map(str, backends)), nproc, device, tolerance.describe())
    runs = run_backends(recipe, backends, nproc=nproc, device=device, announce=announce)
    logger.info("trained every backend in %.1f s", time.perf_counter() - started)
    return Report(title=f"{recipe.name}, {nproc} ranks, {recipe.steps} steps",
                  settings=recipe_settings(recipe, nproc), tolerance=tolerance, runs=runs,
                  comparisons=judge(runs, tolerance), seconds=time.perf_counter() - started)
