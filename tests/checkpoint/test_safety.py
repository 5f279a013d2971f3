"""Nothing a user wrote is lost, and nothing wrong loads, without ranks: `save` refuses targets
it would destroy, `CheckpointManager(keep=...)` is checked, checksums catch a flipped bit,
concurrent saves are refused, converters refuse key collisions, and a saver killed with
SIGKILL 20 times (and once run into a full disk) always leaves the previous checkpoint, loaded
bit for bit, with its leftovers cleaned by the next save. Every test checks with SHA-256 that
the user's own files are unchanged."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fsdp_bridge import checkpoint
from fsdp_bridge.checkpoint import atomic, manifest
from fsdp_bridge.checkpoint import convert as conv
from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.cli import main as cli_main
from tests.checkpoint import user_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "fault_save.py")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _state(value=1.0):
    return {"w": torch.full((4, 3), value), "step": int(value)}


def _load(path):
    state = {"w": torch.empty(4, 3), "step": -1}
    checkpoint.load(state, path)
    return state


@pytest.fixture
def outputs(tmp_path):
    """A user's outputs directory and the digests of its files."""
    return tmp_path / "outputs", user_files.make(tmp_path / "outputs")


def test_save_refuses_a_directory_it_did_not_write(outputs):
    directory, before = outputs
    with pytest.raises(CheckpointError, match="not a checkpoint written by fsdp-bridge") as err:
        checkpoint.save(_state(), str(directory))
    assert "overwrite=True" in str(err.value) and "train.log" in str(err.value)
    assert user_files.unchanged(directory, before)
    assert sorted(os.listdir(directory)) == ["notes.txt", "plots", "train.log"]


def test_save_refuses_a_file_and_a_path_below_a_file(outputs):
    directory, before = outputs
    for target, words in ((directory / "notes.txt", "it is a file"),
                          (directory / "notes.txt" / "ckpt", "is a file, not a directory")):
        for overwrite in (False, True):
            with pytest.raises(CheckpointError, match=words):
                checkpoint.save(_state(), str(target), overwrite=overwrite)
    assert user_files.unchanged(directory, before)
    assert not atomic.leftovers(str(directory / "notes.txt"))


def test_save_replaces_its_own_checkpoints_and_overwrite_writes_into_another_directory(outputs, tmp_path):
    directory, before = outputs
    mine = tmp_path / "ckpt"
    checkpoint.save(_state(1.0), str(mine))
    checkpoint.save(_state(2.0), str(mine))  # ours: replaced without asking
    assert _load(str(mine))["step"] == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    checkpoint.save(_state(3.0), str(empty))  # an empty directory holds nothing to lose
    other = tmp_path / "other"
    theirs = user_files.make(other)
    checkpoint.save(_state(4.0), str(other), overwrite=True)  # written into, the rest kept
    assert _load(str(other))["step"] == 4 and user_files.unchanged(other, theirs)
    assert manifest.MANIFEST in os.listdir(mine)
    assert user_files.unchanged(directory, before)


@pytest.mark.parametrize("keep", [-1, 0, "2", 2.0, True])
def test_keep_is_checked_at_construction(tmp_path, keep):
    with pytest.raises(ValueError, match=r"keep=.*expected an int >= 1 .* or None"):
        checkpoint.CheckpointManager(str(tmp_path / "run"), keep=keep)
    assert not (tmp_path / "run").exists()


def test_manager_keeps_its_newest_and_never_removes_what_it_did_not_write(tmp_path):
    import torch.distributed.checkpoint as dcp

    before = user_files.make(tmp_path / "run")
    foreign = tmp_path / "run" / "step_00000000"  # a DCP checkpoint another tool wrote
    dcp.save({"w": torch.ones(2)}, checkpoint_id=str(foreign))  # no process group: local
    foreign_digests = user_files.digests(foreign)
    model = torch.nn.Linear(3, 2)
    manager = checkpoint.CheckpointManager(str(tmp_path / "run"), keep=1)
    for step in (1, 2, 3):
        manager.save(step, model)
    assert manager.steps() == [0, 3]
    assert user_files.digests(foreign) == foreign_digests
    assert user_files.unchanged(tmp_path / "run", before)
    kept_all = checkpoint.CheckpointManager(str(tmp_path / "all"), keep=None)
    for step in (1, 2, 3):
        kept_all.save(step, model)
    assert kept_all.steps() == [1, 2, 3]


def test_unpicklable_values_and_colliding_keys_are_refused_before_writing(outputs, tmp_path):
    directory, before = outputs
    target = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"state_dict\['extra'\]\['fn'\] is a function"):
        checkpoint.save({"w": torch.ones(2), "extra": {"fn": lambda x: x}}, target)
    with pytest.raises(CheckpointError, match="keys collide.*'a.b'"):
        checkpoint.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, target)
    with pytest.raises(CheckpointError, match=r"state_dict\[1\] and state_dict\['1'\]"):
        checkpoint.save({1: torch.ones(2), "1": torch.zeros(2)}, target)
    assert not os.path.exists(target) and not atomic.leftovers(target)
    assert user_files.unchanged(directory, before)


def test_a_flipped_bit_is_caught_on_load_and_by_convert(outputs, tmp_path):
    directory, before = outputs
    path = tmp_path / "ckpt"
    checkpoint.save({"w": torch.arange(1000.0)}, str(path))
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    payload = bytearray((path / data).read_bytes())
    payload[len(payload) // 2] ^= 0x01  # one bit, in the middle of the tensor bytes
    (path / data).write_bytes(bytes(payload))
    state = {"w": torch.zeros(1000)}
    with pytest.raises(CheckpointError, match=f"'{data}' does not match its SHA-256"):
        checkpoint.load(state, str(path))
    assert torch.equal(state["w"], torch.zeros(1000))  # nothing was read into it
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        conv.convert(str(path), str(tmp_path / "out.pt"), "torch")
    assert not (tmp_path / "out.pt").exists()
    assert user_files.unchanged(directory, before)


def test_a_second_save_of_one_path_is_refused_while_one_runs(outputs, tmp_path):
    directory, before = outputs
    path = str(tmp_path / "ckpt")
    checkpoint.save(_state(1.0), path)
    with atomic.lock(path):  # what a save in another process holds
        with pytest.raises(CheckpointError, match=r"another save to .* is in progress \(pid"):
            checkpoint.save(_state(2.0), path)
    assert _load(path)["step"] == 1
    checkpoint.save(_state(3.0), path)  # free again once released
    assert _load(path)["step"] == 3
    assert not os.path.exists(atomic.lock_path(path))
    assert user_files.unchanged(directory, before)


def test_the_target_is_judged_only_under_the_save_lock(outputs, tmp_path):
    """While another save holds the lock, what lies at `path` is that save's to change (between
    its two renames `path` is briefly missing): the only true refusal is "in progress", never
    a verdict on the directory read in passing. A directory we would refuse on its own is
    used here to tell the two verdicts apart."""
    directory, before = outputs
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / "notes.txt").write_text("not a checkpoint")
    with atomic.lock(str(path)):
        with pytest.raises(CheckpointError, match=r"another save to .* is in progress"):
            checkpoint.save(_state(1.0), str(path))
    with pytest.raises(CheckpointError, match="is not a checkpoint written by fsdp-bridge"):
        checkpoint.save(_state(1.0), str(path))  # lock free: the directory itself is refused
    assert os.listdir(path) == ["notes.txt"] and not atomic.leftovers(str(path))
    assert not os.path.exists(atomic.lock_path(str(path)))  # the refusal let the lock go
    assert user_files.unchanged(directory, before)


_RACER = textwrap.dedent("""
    import json, os, sys, time, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {root!r})
    import torch
    from fsdp_bridge import checkpoint
    from fsdp_bridge.checkpoint.validate import CheckpointError
    path, me, go = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    # Each racer appends a byte to its tally after every save, and marks when it is done: a
    # refused racer waits for the save that refused it to finish before it tries again, so
    # every refusal stands for one save of the other racer (refusals are instant, and would
    # otherwise all fall inside one long save under load).
    tally = os.path.join(os.path.dirname(go), f"saves-{{me}}")
    other_tally = os.path.join(os.path.dirname(go), f"saves-{{3 - me}}")
    other_done = os.path.join(os.path.dirname(go), f"done-{{3 - me}}")
    size = lambda file: os.path.getsize(file) if os.path.exists(file) else 0
    while not os.path.exists(go):
        time.sleep(0.01)
    outcome = {{"saved": 0, "refused": 0, "other": []}}
    for i in range(8):
        try:
            checkpoint.save({{"w": torch.full((1 << 16,), float(me)), "who": me}}, path)
            outcome["saved"] += 1
            with open(tally, "ab") as file:
                file.write(b".")
        except CheckpointError as exc:
            outcome["refused" if "in progress" in str(exc) else "other"] += (
                1 if "in progress" in str(exc) else [str(exc)])
            # Read after the refusal: the other racer tallies a save before it starts the next,
            # so waiting for this count to move waits at least for the save that refused us.
            other_saves = size(other_tally)
            while size(other_tally) == other_saves and not os.path.exists(other_done):
                time.sleep(0.005)
        except Exception as exc:
            outcome["other"].append(f"{{type(exc).__name__}}: {{exc}}")
    open(os.path.join(os.path.dirname(go), f"done-{{me}}"), "w").close()
    print(json.dumps(outcome))
""")


def test_two_processes_saving_one_path_never_break_each_other(outputs, tmp_path):
    directory, before = outputs
    script = tmp_path / "racer.py"
    script.write_text(_RACER.format(root=ROOT))
    path, go = str(tmp_path / "ckpt"), str(tmp_path / "go")
    racers = [subprocess.Popen([sys.executable, str(script), path, str(me), go],
                               stdout=subprocess.PIPE, text=True) for me in (1, 2)]
    (tmp_path / "go").write_text("")
    outcomes = [json.loads(racer.communicate(timeout=240)[0]) for racer in racers]
    assert all(o["other"] == [] for o in outcomes), outcomes
    # each refusal waited for the other racer's save in progress: one of them can always save
    assert sum(o["saved"] for o in outcomes) >= 8, outcomes
    state = {"w": torch.empty(1 << 16), "who": 0}
    checkpoint.load(state, path)
    assert torch.equal(state["w"], torch.full((1 << 16,), float(state["who"])))
    assert not atomic.leftovers(path) and not os.path.exists(atomic.lock_path(path))
    assert user_files.unchanged(directory, before)


def test_disk_full_and_crashes_leave_the_previous_checkpoint_bit_exact(outputs):
    """kill -9 at 20 random points of saves, then a save into a 64 KiB file-size limit."""
    directory, before = outputs
    done = subprocess.run([sys.executable, FAULTS, str(directory), "20", "15"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    rounds = result["rounds"]
    assert len(rounds) == 20
    for one in rounds:
        assert one["bit_exact"] and one["loaded"] in one["allowed"], one
        assert one["leftovers"] <= 2, one  # a crash leaves at most one .tmp- and one .old-
    assert any(one["completed"] == 0 for one in rounds), rounds  # killed inside a save
    full = result["disk_full"]
    assert "disk is full or a file-size limit" in full["message"], full
    assert full["loaded"] == full["expected"] and full["bit_exact"], full
    assert full["tmp_leftovers"] == [], full  # a failed save removes its own temporary files
    final = result["final"]
    assert final["bit_exact"] and final["loaded"] == final["expected"], final
    assert final["siblings"] == ["ckpt"], final  # the next save cleaned every leftover
    assert user_files.unchanged(directory, before)


# -- convert-checkpoint ------------------------------------------------------------------------


def _convert(capsys, *argv):
    code = cli_main(["convert-checkpoint", *map(str, argv)])
    return code, capsys.readouterr()


def test_convert_refuses_key_collisions_by_name(outputs, tmp_path, capsys):
    directory, before = outputs
    nested = tmp_path / "nested.pt"
    torch.save({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, nested)
    code, out = _convert(capsys, nested, tmp_path / "st", "--to", "safetensors")
    assert code == 2 and "['a.b'] and ['a']['b'] both become 'a.b'" in out.err
    code, out = _convert(capsys, nested, tmp_path / "d1", "--to", "dcp")
    assert code == 2 and "state_dict['a.b'] and state_dict['a']['b'] become 'a.b'" in out.err
    mixed = tmp_path / "mixed.pt"
    torch.save({1: torch.ones(2), "1": torch.zeros(2)}, mixed)
    code, out = _convert(capsys, mixed, tmp_path / "d2", "--to", "dcp")
    assert code == 2 and "state_dict[1] and state_dict['1'] become '1'" in out.err
    assert not [n for n in os.listdir(tmp_path) if n in ("st", "d1", "d2") or ".tmp-" in n]
    assert user_files.unchanged(directory, before)


def test_convert_counts_tensors_in_and_out(tmp_path, capsys):
    source = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.ones(2), "b": {"c": torch.zeros(3)}},
                "optim": {"m": torch.ones(1)}, "step": 4}, source)
    before = user_files.digests(tmp_path)  # the user's source file
    code, out = _convert(capsys, source, tmp_path / "d", "--to", "dcp")
    assert code == 0 and "3 tensors (3 in the source)" in out.out
    code, out = _convert(capsys, tmp_path / "d", tmp_path / "m.safetensors", "--to",
                         "safetensors")
    assert code == 0 and "2 tensors (3 in the source)" in out.out
    assert "kept the tensors under 'model'" in out.out
    report = conv.convert(str(tmp_path / "d"), str(tmp_path / "back.pt"), "torch")
    assert (report.tensors, report.source_tensors) == (3, 3)
    assert user_files.unchanged(tmp_path, before)


def test_convert_refuses_destinations_it_cannot_or_must_not_write(outputs, tmp_path, capsys):
    directory, before = outputs
    source = tmp_path / "s.pt"
    torch.save({"w": torch.ones(2)}, source)
    cases = [
        ((tmp_path / "missing" / "x.pt", "--to", "torch"), "does not exist. Create the directory"),
        ((directory, "--to", "torch", "--force"), "is a directory, but --to torch writes one"),
        ((directory, "--to", "dcp", "--force"), "is a directory that is not a checkpoint"),
        ((directory / "notes.txt", "--to", "dcp", "--force"), "is a file, but --to dcp writes"),
        ((directory / "notes.txt", "--to", "torch"), "exists; pass --force"),
        ((directory / "notes.txt" / "x.pt", "--to", "torch"), "is a file"),
    ]
    for argv, words in cases:
        code, out = _convert(capsys, source, *argv)
        assert code == 2 and words in out.err, (argv, out.err)
        assert "Traceback" not in out.err
    assert not (tmp_path / "missing").exists()
    assert user_files.unchanged(directory, before)
    assert sorted(os.listdir(directory)) == ["notes.txt", "plots", "train.log"]
    # --force onto a checkpoint of the same kind replaces it.
    assert _convert(capsys, source, tmp_path / "d", "--to", "dcp")[0] == 0
    assert _convert(capsys, source, tmp_path / "d", "--to", "dcp", "--force")[0] == 0


def test_convert_says_in_one_line_what_a_source_is_not(tmp_path, capsys):
    import numpy as np

    pickled = tmp_path / "arrays.pt"
    torch.save({"model": {"w": np.ones(3)}}, pickled)  # a numpy array: pickled code to run
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    cases = [(pickled, "holds Python objects that are not tensors or plain values (one is a "
                       "numpy"),
             (empty, "is not a checkpoint: it is an empty file"),
             (tmp_path, "is a directory but neither a DCP checkpoint")]
    for source, words in cases:
        code, out = _convert(capsys, source, tmp_path / "out", "--to", "dcp")
        assert code == 2 and words in out.err, out.err
        assert len(out.err.strip().splitlines()) == 1 and "weights_only" not in out.err
    assert not (tmp_path / "out").exists()
