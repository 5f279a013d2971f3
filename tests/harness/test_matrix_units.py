"""The conformance matrix without processes: the covering array, the front-ends' valid axes,
the verdicts from given runs, the table's exit status, and `compare --matrix` arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fsdp_bridge.harness.digest import Digest
from fsdp_bridge.harness.matrix import axes, table, verdict
from fsdp_bridge.harness.runner import RunRecord, StepRecord


def test_the_covering_array_holds_every_value_and_every_feasible_pair():
    space = {"frontend": ("fsdp1", "yafsdp"), "world": (2, 4), "compile": ("off",),
             "ac": ("off", "after"), "init": ("real", "rank0")}
    cells = axes.covering_cells(space, seed=0)
    assert not axes.uncovered(cells, space)
    assert all(axes.invalid(cell.as_dict()) is None for cell in cells)
    held = {(axis, value) for cell in cells for axis, value in cell.settings}
    for axis, values in axes.check_space(space).items():
        assert {(axis, value) for value in values} <= held
    other = axes.covering_cells(space, seed=1)
    assert not axes.uncovered(other, space) and other != cells


def test_each_front_end_gets_only_its_own_axes():
    assert axes.invalid({"frontend": "fsdp2", "orig_params": False})
    assert axes.invalid({"frontend": "yafsdp", "accumulate": "sync"})
    assert axes.invalid({"frontend": "zeta", "init": "meta"})
    assert axes.invalid({"strategy": "hybrid", "world": 3})
    assert axes.invalid({"accumulate": "skip", "micro": 1})
    assert axes.invalid({"outer": "torch-fsdp1", "offload": True})
    assert axes.invalid({"frontend": "fsdp1", "orig_params": True, "compile": "whole"}) is None


def test_what_native_cannot_run_on_a_cpu_only_torch_is_known():
    offload = axes.Cell.of(frontend="fsdp1", offload=True)
    assert "CPUOffload" in axes.native_limit(offload)
    assert axes.native_limit(offload, "cuda") is None
    assert axes.native_limit(axes.Cell.of(frontend="fsdp2", offload=True)) is None
    stand_in = axes.native_stand_in(axes.Cell.of(frontend="fsdp1", offload=True, init="rank0"))
    assert not stand_in.offload and stand_in.init == "real"


def _run(losses, weights=1.0, error=None, state=None):
    steps = [StepRecord(0, None, None, Digest(weights, weights, weights, 0.0, 10))]
    steps += [StepRecord(i, loss, 0.5, Digest(weights + i, weights, weights, 0.5, 10))
              for i, loss in enumerate(losses, start=1)]
    return RunRecord("run", 2, steps=steps, state_dict=state or {"w": torch.ones(3)},
                     error=error)


def test_verdicts_from_runs():
    cell = axes.Cell.of(frontend="fsdp2", clip=True)
    same = verdict.judge(cell, {"native": _run([1.0, 0.5]), "ours": _run([1.0, 0.5])}, None)
    assert (same.status, same.basis, same.conforming) == ("equal", "bit for bit", True)
    # a deterministic native and ours one ulp off at step 2
    off = verdict.judge(cell, {"native": _run([1.0, 0.5]), "ours": _run([1.0, 0.5000001]),
                               "native-again": _run([1.0, 0.5])}, None)
    assert off.status == "differs" and "step 2: loss" in off.detail and not off.conforming
    tensor = verdict.judge(cell, {"native": _run([1.0]), "ours": _run(
        [1.0], state={"w": torch.tensor([1.0, 1.0, 2.0])}), "native-again": _run([1.0])}, None)
    assert "final state dict: w" in tensor.detail
    # a native that is not deterministic: its own spread (twice) is the allowance
    loose = verdict.judge(cell, {"native": _run([1.0, 0.5]), "ours": _run([1.0, 0.5000001]),
                                 "native-again": _run([1.0, 0.5000002])}, None)
    assert loose.status == "equal" and "run-to-run" in loose.basis


def test_refusals_and_crashes():
    cell = axes.Cell.of(frontend="fsdp1", orig_params=False, frozen=True)
    named = "Traceback\nValueError: use_orig_params=False needs uniform requires_grad"
    both = verdict.judge(cell, {"native": _run([], error=named), "ours": _run([], error=named)},
                         None)
    assert both.status == "refused" and both.conforming
    alone = verdict.judge(axes.Cell.of(frontend="fsdp2", offload=True), {
        "native": _run([1.0]), "ours": _run([], error="x\nValueError: offload_policy nope")},
        None)
    assert alone.status == "refused" and not alone.conforming
    crash = verdict.judge(axes.Cell.of(frontend="fsdp2"), {
        "native": _run([1.0]), "ours": _run([], error="x\nKeyError: 'w'")}, None)
    assert crash.status == "crash" and not crash.conforming
    listed = verdict.judge(axes.Cell.of(frontend="fsdp1", outer="torch-fsdp1"), {
        "native": _run([1.0]),
        "ours": _run([], error="x\nRuntimeError: runs inside torch.distributed.fsdp."
                               "FullyShardedDataParallel")}, None)
    assert listed.status == "refused" and listed.conforming and "README" in listed.basis
    odd = axes.Cell.of(frontend="fsdp1", resume="full", odd_args=True)
    trains = verdict.judge(odd, {"native": _run([], error="x\nRuntimeError: Expected "
                                                          "state_dict_config of type F"),
                                 "ours": _run([1.0])}, None)
    assert trains.status == "differs" and "native refuses" in trains.detail
    fails = verdict.judge(axes.Cell.of(frontend="fsdp1", resume="sharded"), {
        "native": _run([], error="x\nRuntimeError: Missing optimizer state"),
        "ours": _run([1.0])}, None)
    assert fails.status == "no reference" and fails.conforming


def test_cells_native_cannot_run_and_known_differences_are_reported_apart():
    cell = axes.Cell.of(frontend="fsdp1", offload=True)
    outcome = verdict.judge(cell, {"native": _run([1.0]), "ours": _run([1.0])},
                            axes.native_limit(cell))
    assert outcome.status == "no reference" and outcome.conforming
    known_cell = axes.Cell.of(frontend="fsdp2", compile="whole", param="bf16")
    known = verdict.judge(known_cell, {"native": _run([1.0]), "ours": _run([1.5]),
                                       "native-again": _run([1.0])}, None)
    assert known.status == "differs" and known.known == "fully_shard compiled whole in low precision"
    assert table.exit_code([known]) == table.EXIT_CONFORMS
    assert table.exit_code([known, verdict.not_run(cell, "budget")]) == table.EXIT_INCOMPLETE
    plain = verdict.judge(axes.Cell.of(frontend="fsdp2"), {
        "native": _run([1.0]), "ours": _run([1.5]), "native-again": _run([1.0])}, None)
    assert table.exit_code([known, plain]) == table.EXIT_DIFFERS
    text = table.render([plain, known], 1.0)
    assert "known differences" in text and "RESULT: NOT conforming" in text


def test_layout_rounding_beyond_two_ranks_is_judged_by_the_tolerance_and_said():
    cell = axes.Cell.of(frontend="fsdp1", world=3)
    near = verdict.judge(cell, {"native": _run([1.0, 0.5]), "ours": _run([1.0, 0.5000001]),
                                "native-again": _run([1.0, 0.5])}, None)
    assert near.status == "equal" and "not bit for bit" in near.basis
    far = verdict.judge(cell, {"native": _run([1.0, 0.5]), "ours": _run([1.0, 0.51]),
                               "native-again": _run([1.0, 0.5])}, None)
    assert far.status == "differs"


def test_matrix_arguments_are_checked_before_torch_and_list_prints_cells():
    ok = subprocess.run([sys.executable, "-m", "fsdp_bridge", "compare", "--matrix", "--axes",
                         "frontend=yafsdp", "world=2", "compile=off", "--list"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.strip().splitlines()[-1].endswith("cells")
    assert all("yafsdp w2" in line for line in ok.stdout.splitlines()[:-1])
    bad = subprocess.run([sys.executable, "-m", "fsdp_bridge", "compare", "--matrix", "--axes",
                          "world=5"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'5' is not a value of world" in bad.stderr


@pytest.mark.parametrize("items, message", [(["nosuch=1"], "AXIS=V1,V2"),
                                            (["frontend"], "AXIS=V1,V2")])
def test_bad_axes_name_the_item(items, message):
    with pytest.raises(ValueError, match=message):
        table.parse_axes(items, sample=False)
