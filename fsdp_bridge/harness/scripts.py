"""Compare training scripts run unmodified under torchrun (`fsdp-bridge compare-scripts`).

Two sources per run:
- losses, read from the scripts' output with a pattern (named groups `step` and `loss`);
- parameter digests after every optimizer step, recorded by a hook injected into the children
  through PYTHONPATH (`_site/sitecustomize.py` -> `step_hook.py`); the script is not modified.

Row k of the comparison holds the loss printed as step k and the digest after the k-th
optimizer step (digests count from 1); for a script that numbers its steps from 0, row k holds
the loss it printed as step k - 1.

[Note: losses per rank]
Scripts may print their loss on every rank (TorchAcc's example loop does), and each rank's
value can differ (the loss of its own slice of the batch). torchrun is run with `--tee 3`, which
prefixes every line of a worker with its local rank (`[default1]:step 3 loss ...`), so losses
are read per rank and a run's losses are those of its lowest printing rank (rank 0 when it
prints): lines of different ranks are never mixed, whichever arrives first.

[Note: determinism]
Comparing two scripts step by step only means something if each script is deterministic: same
seed for the weights and the data on every run, no data-order randomness left unseeded. The
first script is therefore run twice; if the two runs differ beyond the tolerance, the
comparison is refused (exit 2) and the report says where the repeat diverged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Sequence

from fsdp_bridge.harness import arguments, step_hook
from fsdp_bridge.harness.compare import (
    Comparison,
    Tolerance,
    Verdict,
    compare_steps,
    first_nan_step,
)
from fsdp_bridge.harness.digest import Digest
from fsdp_bridge.harness.names import DEFAULT_LOSS_PATTERN, HF_TRAINER_LOSS_PATTERN
from fsdp_bridge.harness.runner import StepRecord
from fsdp_bridge.harness.torchrun import run_torchrun

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTPUT_TAIL = 3000


@dataclasses.dataclass
class ScriptRun:
    label: str
    script: str
    returncode: int
    output: str  # stdout and stderr, interleaved
    losses: dict[int, float]
    digests: list[Digest]
    seconds: float
    wrappers: dict[str, int] = dataclasses.field(default_factory=dict)  # see step_hook
    retried: bool = False  # run again after torch's gloo exit abort
    pattern: str = DEFAULT_LOSS_PATTERN  # the one its losses were read with
    loss_rank: Optional[int] = 0  # whose losses `losses` holds; None: lines without a rank

    @property
    def error(self) -> Optional[str]:
        if self.returncode == 124:
            return (f"{self.label} ({self.script}) did not finish within --timeout "
                    f"{self.seconds:.0f} s (a rank hung?); torchrun and all of its ranks were "
                    f"stopped. Output ends:\n{self.output[-OUTPUT_TAIL:]}")
        if self.returncode != 0:
            return (f"{self.label} ({self.script}) exited with {self.returncode}; output "
                    f"ends:\n{self.output[-OUTPUT_TAIL:]}")
        if not self.losses and not self.digests:
            return (f"{self.label} ({self.script}) printed no loss line matching the pattern "
                    "and stepped no torch optimizer: nothing to compare")
        return None

    @property
    def counts_from_zero(self) -> bool:
        """Whether the script numbers its steps from 0 (its first loss line is step 0)."""
        return bool(self.losses) and min(self.losses) == 0

    def step_losses(self) -> dict[int, float]:
        """Loss by optimizer step counted from 1, as digests count: a script that numbers its
        steps from 0 printed step k's loss as k - 1."""
        shift = 1 if self.counts_from_zero else 0
        return {step + shift: loss for step, loss in self.losses.items()}

    def records(self) -> list[StepRecord]:
        """Rows keyed by step: the loss of optimizer step k and the digest after it."""
        losses = self.step_losses()
        keys = sorted(set(losses) | set(range(1, len(self.digests) + 1)))
        quantum = printed_quantum(losses.values())
        rows = []
        for key in keys:
            digest = self.digests[key - 1] if 1 <= key <= len(self.digests) else None
            rows.append(StepRecord(key, losses.get(key),
                                   digest.grad_norm if digest else None, digest, quantum))
        return rows


def printed_quantum(values) -> float:
    """One unit of the last digit the values were printed with: the finest over all of them
    (a value printed as 4.8100 reads back as 4.81, but the others show the 4 decimals)."""
    quanta = [_last_digit(value) for value in values if math.isfinite(value)]
    return min(quanta, default=0.0)


def _last_digit(value: float) -> float:
    mantissa, _, exponent = repr(value).partition("e")
    decimals = len(mantissa.partition(".")[2].rstrip("0"))
    return 10.0 ** (int(exponent or 0) - decimals)


def parse_losses(output: str, pattern: str) -> dict[int, float]:
    """Step -> loss from the output; the first line per step wins (ranks may repeat it)."""
    regex = re.compile(pattern, re.IGNORECASE | re.MULTILINE)
    if "loss" not in regex.groupindex:
        raise ValueError(f"loss pattern {pattern!r} has no named group 'loss': write it like "
                         f"{DEFAULT_LOSS_PATTERN!r}.")
    losses: dict[int, float] = {}
    for line in output.splitlines():
        match = regex.search(line)
        if not match:
            continue
        step = int(match.group("step")) if "step" in regex.groupindex else len(losses) + 1
        losses.setdefault(step, float(match.group("loss")))
    return losses


# torchrun --tee's prefix of a worker's line: `[default0]:` (role name, then local rank).
_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*(\d+)\]:")


def lines_by_rank(output: str) -> dict[Optional[int], str]:
    """The output split by the local rank that printed each line (None: lines without a rank
    prefix, torchrun's own)."""
    lines: dict[Optional[int], list[str]] = {}
    for line in output.splitlines():
        match = _RANK_PREFIX.match(line)
        rank = int(match.group(1)) if match else None
        lines.setdefault(rank, []).append(line[match.end():] if match else line)
    return {rank: "\n".join(text) for rank, text in lines.items()}


def read_losses(output: str, pattern: str) -> tuple[dict[int, float], str, Optional[int]]:
    """(step -> loss, the pattern that read them, the rank that printed them): see
    [Note: losses per rank]. The default pattern falls back to the Hugging Face Trainer's log
    lines when it matches nothing."""
    patterns = [pattern] + ([HF_TRAINER_LOSS_PATTERN] if pattern == DEFAULT_LOSS_PATTERN else [])
    by_rank = lines_by_rank(output)
    ranks = sorted(rank for rank in by_rank if rank is not None)
    for used in patterns:
        for rank in ranks + [None]:  # unprefixed lines only when no rank printed a loss
            losses = parse_losses(by_rank.get(rank, ""), used)
            if losses:
                return losses, used, rank
    return {}, pattern, None


def _read_wrappers(out_dir: str) -> dict[str, int]:
    path = os.path.join(out_dir, step_hook.WRAPPERS_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        return json.load(handle)


def _read_digests(out_dir: str) -> list[Digest]:
    path = os.path.join(out_dir, step_hook.FILE_NAME)
    if not os.path.exists(path):
        return []
    with open(path) as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return [Digest(**{k: v for k, v in row.items() if k != "step"}) for row in rows]


def child_env(out_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [SITE_DIR, PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["FSDP_BRIDGE_HARNESS_OUT"] = out_dir
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run_script(label: str, script: str, nproc: int, args: Sequence[str], pattern: str,
               timeout: float) -> ScriptRun:
    """Run `script` under torchrun on `nproc` local ranks with the step hook injected. On a
    timeout or Ctrl-C, torchrun and every rank it started are stopped."""
    target = arguments.script("script", script)  # a path, or -m and a module's name
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--tee", "3",
               f"--nproc_per_node={nproc}", *target, *args]
    with tempfile.TemporaryDirectory(prefix="fsdp-bridge-script-") as out_dir:
        started = time.perf_counter()
        retried = False
        try:
            returncode, output, retried = run_torchrun(command, child_env(out_dir), timeout,
                                                       before_retry=lambda: _clear(out_dir))
        except subprocess.TimeoutExpired as exc:
            returncode = 124
            output = (f"{exc.output or ''}\n[timed out after {timeout:g} s: torchrun and all "
                      "of its ranks were stopped]")
        losses, used, rank = read_losses(output, pattern)
        return ScriptRun(label, script, returncode, output, losses, _read_digests(out_dir),
                         time.perf_counter() - started, _read_wrappers(out_dir), retried, used,
                         rank)


def _clear(folder: str) -> None:
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def compare_script_runs(baseline: ScriptRun, candidate: ScriptRun,
                        tolerance: Tolerance) -> Comparison:
    comparison = Comparison(baseline.label, candidate.label)
    compare_steps(baseline.records(), candidate.records(), tolerance, comparison)
    return comparison


@dataclasses.dataclass
class ScriptReport(Verdict):
    title: str
    settings: dict
    tolerance: Tolerance
    runs: list[ScriptRun]
    comparisons: list[Comparison]
    notes: list[str]
    errors: list[str]


    def curves(self) -> dict[str, list]:
        return {run.label: sorted(run.step_losses().items()) for run in self.runs}


DETERMINISM = ("requirement: each script seeds everything it draws (weights, data order, "
               "dropout) so that two runs print the same numbers; the first script is run "
               "twice to check it")


def _determinism_check(first: ScriptRun, repeat: ScriptRun, tolerance: Tolerance,
                       notes: list[str], errors: list[str]) -> None:
    check = compare_script_runs(first, repeat, tolerance)
    if not check.ok:
        errors.append(f"{first.script} is not deterministic: two runs of it differ from step "
                      f"{check.first_diverging_step}; seed torch, numpy and random, and the "
                      "data order, then compare again")
    # repr: exact for floats, and NaN repeats as NaN.
    elif repr((first.losses, first.digests)) != repr((repeat.losses, repeat.digests)):
        worst = max([c.ratio for c in check.steps] + [0.0])
        notes.append(f"{first.script} repeats within tolerance but not bit for bit "
                     f"(worst {worst:.2g} of tolerance)")
    else:
        notes.append(f"{first.script} is deterministic: a second run repeats it bit for bit")


def _nan_notes(runs: Sequence[ScriptRun]) -> list[str]:
    notes = []
    for run in runs:
        found = first_nan_step(run.records())
        if found is not None:
            notes.append(f"warning: {run.label} ({run.script}) is not finite from step "
                         f"{found[0]} ({found[1]})")
    return notes


def _wrapper_note(run: ScriptRun) -> str:
    if not run.digests:
        return f"{run.label}: took no optimizer step, so which FSDP it used is unknown"
    found = ", ".join(f"{name} wrapped {count} module{'s' * (count != 1)}"
                      for name, count in sorted(run.wrappers.items()))
    return f"{run.label}: {found or 'no FSDP or DDP module found'}"


def _run_notes(runs: Sequence[ScriptRun]) -> list[str]:
    """What each run used (FSDP implementation, loss pattern) and any re-run it needed."""
    notes = [_wrapper_note(run) for run in runs]
    for run in runs:
        if run.pattern == HF_TRAINER_LOSS_PATTERN:
            notes.append(f"{run.label}: losses read from the Hugging Face Trainer's log lines "
                         "({'loss': ...}); the k-th line is taken as step k, which holds for "
                         "logging_steps=1")
        if run.counts_from_zero:
            notes.append(f"{run.label}: numbers its steps from 0; its step k is row k + 1 (the "
                         "k + 1-th optimizer step)")
        if run.retried:
            notes.append(f"{run.label} was run again: a previous run printed everything, then "
                         "exited with torch's gloo teardown abort (a known race at exit, not a "
                         "failure of the script)")
    return notes


def _unproven(runs: Sequence[ScriptRun], require_fsdp: bool, require_loss: bool,
              pattern: str) -> list[str]:
    """Why these runs cannot be called equivalent even if every number agrees."""
    errors = []
    for run in runs:
        sharded = {name for name in run.wrappers if name != step_hook.NOT_SHARDED}
        if require_fsdp and run.digests and not sharded:
            errors.append(
                f"{run.label} ({run.script}) engaged no FSDP: {_wrapper_note(run)}. Agreement "
                "of runs that shard nothing says nothing about FSDP; check the script's FSDP "
                "settings (a launcher may fall back to DDP, as accelerate does on CPU), or pass "
                "--allow-no-fsdp to compare them anyway")
        if require_loss and not run.losses:
            also = (" (nor the Hugging Face Trainer's log lines)"
                    if pattern == DEFAULT_LOSS_PATTERN else "")
            errors.append(
                f"{run.label} ({run.script}): no line of its output matched the loss pattern "
                f"{pattern!r}{also}; pass --loss-pattern for its format, or --allow-no-loss to "
                "compare parameter digests alone")
    return errors


def compare_scripts(baseline: str, candidates: Sequence[str], nproc: int = 2,
                    args: Sequence[str] = (), tolerance: Optional[Tolerance] = None,
                    pattern: str = DEFAULT_LOSS_PATTERN, check_determinism: bool = True,
                    timeout: float = 600.0,
                    on_run: Callable[[ScriptRun], None] = lambda run: None,
                    require_fsdp: bool = True, require_loss: bool = True) -> ScriptReport:
    """Run `baseline` (twice, unless check_determinism=False) and each candidate; compare.
    Candidates are not run when the baseline failed, shards nothing or prints no loss (see
    below), or does not repeat: there is nothing to compare them with.
    `on_run` is called after each run (progress). Runs in which no FSDP module was found
    (`require_fsdp`) or no loss was read (`require_loss`) are an error, not "equivalent"."""
    from fsdp_bridge.harness.compare import tolerance_for

    def run_one(*run_args) -> ScriptRun:
        done = run_script(*run_args)
        on_run(done)
        return done

    tolerance = tolerance or tolerance_for("fp32")
    arguments.scripts(baseline, candidates, nproc, pattern, timeout)
    first = run_one("A", baseline, nproc, args, pattern, timeout)
    runs, notes, errors = [first], [DETERMINISM], []
    # A baseline that shards nothing or prints no loss cannot be proven equivalent to anything:
    # say so now rather than after every other run.
    errors += [] if first.error else _unproven([first], require_fsdp, require_loss, pattern)
    if check_determinism and not first.error and not errors:
        repeat = run_one("A (repeat)", baseline, nproc, args, pattern, timeout)
        if repeat.error:
            errors.append(repeat.error)
        else:
            _determinism_check(first, repeat, tolerance, notes, errors)
    if first.error or errors:
        notes.append("the other scripts were not run: A failed, cannot be proven (above) or "
                     "does not repeat, so there is nothing to compare them with")
    for index, script in enumerate(candidates if not errors and not first.error else ()):
        runs.append(run_one(chr(ord("B") + index), script, nproc, args, pattern, timeout))
    errors = [run.error for run in runs if run.error] + errors
    errors += [] if errors else _unproven(runs[1:], require_fsdp, require_loss, pattern)
    comparisons = [] if errors else [compare_script_runs(first, run, tolerance)
                                     for run in runs[1:]]
    notes += _run_notes(runs) + _nan_notes(runs)
    for run in runs:
        printed_by = "" if run.loss_rank is None else f" (rank {run.loss_rank}'s)"
        notes.append(f"{run.label} = {run.script}: {len(run.losses)} loss lines{printed_by}, "
                     f"{len(run.digests)} optimizer steps, {run.seconds:.1f} s")
    settings = {"nproc": nproc, "args": " ".join(args) or "-", "loss pattern": pattern}
    title = f"compare-scripts {os.path.basename(baseline)} vs " + ", ".join(
        os.path.basename(c) for c in candidates)
    return ScriptReport(title, settings, tolerance, runs, comparisons, notes, errors)
