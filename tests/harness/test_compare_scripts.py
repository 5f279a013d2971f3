"""`fsdp-bridge compare-scripts` on tiny scripts: identical -> 0, changed learning rate -> 1
naming step 1, an unseeded script -> 2 (not deterministic), a script that shards nothing (DDP)
-> 2 unless --allow-no-fsdp; the report names the FSDP each run used."""

from __future__ import annotations

import os

from fsdp_bridge.cli import main

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "train_tiny.py")


def _variant(tmp_path, name, old, new):
    with open(SCRIPT) as handle:
        text = handle.read()
    assert old in text
    path = tmp_path / name
    path.write_text(text.replace(old, new))
    return str(path)


def test_changed_learning_rate_differs_from_step_1(tmp_path, capsys):
    other = _variant(tmp_path, "train_lr.py", "LR = 1e-2", "LR = 2e-2")
    code = main(["compare-scripts", SCRIPT, other, "--nproc", "2", "--json",
                 str(tmp_path / "r.json"), "--", "--steps", "3"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "first diverging step 1" in out
    assert "is deterministic" in out
    assert "3 optimizer steps" in out  # digests came from the injected hook
    assert "A: torch FSDP2 wrapped 1 module" in out and "B: torch FSDP2 wrapped 1 module" in out
    assert (tmp_path / "r.json").exists()


def test_identical_scripts_agree(tmp_path, capsys):
    same = _variant(tmp_path, "same.py", "SEED = 0", "SEED = 0  # the same script")
    code = main(["compare-scripts", SCRIPT, same, "--no-determinism-check", "--", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "RESULT: equivalent" in out


def test_unseeded_script_is_refused(tmp_path, capsys):
    unseeded = _variant(tmp_path, "unseeded.py", "torch.manual_seed(SEED)",
                        "torch.manual_seed(__import__('time').time_ns() % 1000003)")
    code = main(["compare-scripts", unseeded, SCRIPT, "--nproc", "1", "--", "--steps", "1"])
    captured = capsys.readouterr()
    assert code == 2, captured.out
    assert "is not deterministic" in captured.err


def test_a_script_that_shards_nothing_is_not_called_equivalent(tmp_path, capsys):
    ddp = _variant(tmp_path, "ddp.py", "fully_shard(model)",
                   "model = torch.nn.parallel.DistributedDataParallel(model)")
    argv = ["compare-scripts", ddp, ddp, "--no-determinism-check", "--", "--steps", "2"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "A (" in captured.err and "engaged no FSDP: A: DistributedDataParallel wrapped 1 " \
        "module" in captured.err, captured.err
    # Known from A's run alone: B is not run for nothing.
    assert "the other scripts were not run" in captured.out + captured.err
    assert "B = " not in captured.out + captured.err
    assert main([*argv[:4], "--allow-no-fsdp", *argv[4:]]) == 0
    assert "RESULT: equivalent" in capsys.readouterr().out


def test_a_script_printing_on_every_rank_is_read_per_rank(tmp_path, capsys):
    # Each rank prints its own slice's loss, and which rank prints first alternates between
    # runs (a counter file): read first-line-wins, the repeat of A would differ from A (exit 2).
    order = tmp_path / "order"
    every_rank = f"""    runs = [int(open({str(order)!r}).read()) if os.path.exists({str(order)!r}) else 0]
    first = runs[0] % world
    for turn in range(world):
        if rank == (first + turn) % world:
            print(f"step {{step}} loss {{loss.item():.6f}}", flush=True)
        dist.barrier()
    if rank == 0 and step == args.steps:
        open({str(order)!r}, "w").write(str(runs[0] + 1))
"""
    script = _variant(tmp_path, "every_rank.py", """    if rank == 0:
        print(f"step {step} loss {mean.item() / world:.6f}", flush=True)
""", every_rank)
    with open(script) as handle:
        text = handle.read().replace("import argparse\n", "import argparse\nimport os\n")
    with open(script, "w") as handle:
        handle.write(text)
    code = main(["compare-scripts", script, script, "--nproc", "2", "--", "--steps", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "is deterministic" in out and "2 loss lines (rank 0's)" in out
