"""The command line starts without torch: `fsdp-bridge --help` imports no subcommand;
`migrate --help`, `compare --help` and `compare-scripts --help` import only their command, and
none imports torch (which takes seconds); the overview still lists every subcommand; argument
errors, and `convert-checkpoint`'s wrong paths, are one line before torch loads. Imports are
read from `-X importtime`."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fsdp_bridge.cli import SUBCOMMANDS


def _run(*argv: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -X importtime ARGV`; the process and every module it imported."""
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True,
                          text=True, timeout=120)
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")}
    return done, imported


def _torch_modules(imported: set[str]) -> list[str]:
    return sorted(name for name in imported if name == "torch" or name.startswith("torch."))


def test_help_lists_every_subcommand_without_importing_torch():
    done, imported = _run("-m", "fsdp_bridge", "--help")
    assert done.returncode == 0, done.stderr[-2000:]
    assert _torch_modules(imported) == []
    listed = done.stdout.split()
    assert [name for name in SUBCOMMANDS if name not in listed] == []
    # No subcommand's module is imported just to show its line.
    assert sorted(module for module, _ in SUBCOMMANDS.values() if module in imported) == []


@pytest.mark.parametrize("argv", [["-m", "fsdp_bridge", "migrate", "--help"],
                                  ["-m", "fsdp_bridge", "compare", "--help"],
                                  ["-m", "fsdp_bridge", "compare-scripts", "--help"],
                                  ["-m", "fsdp_bridge", "convert-checkpoint", "--help"],
                                  ["-m", "fsdp_bridge", "explain", "--help"],
                                  ["-m", "fsdp_bridge", "bench", "--help"],
                                  ["-m", "fsdp_bridge", "demo", "--help"],
                                  ["-m", "fsdp_bridge", "--version"],
                                  ["-c", "import fsdp_bridge"]])
def test_help_of_light_commands_and_the_package_import_no_torch(argv):
    done, imported = _run(*argv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _torch_modules(imported) == []


@pytest.mark.parametrize("argv, said", [
    (["compare-scripts", "a.py", "b.py", "c.py"], "takes exactly two scripts, A.py and B.py; also got c.py"),
    (["compare", "--bogus"], "unrecognized arguments: --bogus"),
    (["migrate", "src", "--to", "fsdp2", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_subcommand_usage_error_shows_the_subcommand_usage(argv, said):
    done = subprocess.run([sys.executable, "-m", "fsdp_bridge", *argv], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith(f"usage: fsdp-bridge {argv[0]} "), done.stderr
    assert f"fsdp-bridge {argv[0]}: error: {said}" in done.stderr, done.stderr


@pytest.mark.parametrize("argv, said", [
    (["compare", "--backends", "reference,torch-fsdp3"], "backend 'torch-fsdp3' is unknown"),
    (["compare", "--steps", "0"], "--steps 0: expected an int >= 1"),
    (["compare", "--plot", "out.txt"], "its suffix '.txt' is not an image format"),
    (["explain", "build_model"], "expected MODULE:FUNCTION"),
])
def test_argument_errors_come_before_torch_and_transformers_load(argv, said):
    done, imported = _run("-m", "fsdp_bridge", *argv)
    assert done.returncode == 2, done.stderr[-2000:]
    assert said in done.stderr
    assert _torch_modules(imported) == [] and "transformers" not in imported


@pytest.mark.parametrize("case, said", [
    ("missing source", "SRC '{d}/missing.pt' does not exist"),
    ("text source", "SRC '{d}/notes.txt' is not a checkpoint: it is a text file"),
    ("existing destination", "'{d}/exists.pt' exists; pass --force"),
    ("missing parent", "DST '{d}/nowhere/x.pt': its parent directory '{d}/nowhere' does not "
                       "exist"),
])
def test_convert_checkpoint_refuses_wrong_paths_in_one_line_before_torch_loads(tmp_path, case,
                                                                              said):
    (tmp_path / "a.pt").write_bytes(b"PK\x03\x04" + bytes(60))  # a zip's start: torch.save's
    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "exists.pt").write_bytes(b"keep me")
    source, destination = {
        "missing source": ("missing.pt", "out"),
        "text source": ("notes.txt", "out"),
        "existing destination": ("a.pt", "exists.pt"),
        "missing parent": ("a.pt", "nowhere/x.pt"),
    }[case]
    done, imported = _run("-m", "fsdp_bridge", "convert-checkpoint", str(tmp_path / source),
                          str(tmp_path / destination), "--to", "torch")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"fsdp-bridge convert-checkpoint: error: {said.format(d=tmp_path)}")
    assert _torch_modules(imported) == []
    assert (tmp_path / "exists.pt").read_bytes() == b"keep me"
    assert sorted(os.listdir(tmp_path)) == ["a.pt", "exists.pt", "notes.txt"]


NEEDS_ARGUMENTS = "import torch\n\n\ndef build(hidden, *, layers=2):\n    return torch.nn.Linear(hidden, hidden)\n"


@pytest.mark.parametrize("argv, said", [
    (["compare-scripts", "{notes}", "{notes}"], "A.py '{notes}' is not a Python script: "),
    (["compare-scripts", "{script}", "no_such_pkg.train"], "B.py 'no_such_pkg.train' is neither a "
     "file nor a Python module found on the path"),
    (["explain", "{script}:build"], "build() takes arguments (hidden); explain calls it with none"),
    (["explain", "{notes}.py:build"], "does not parse: invalid syntax (line 1)"),
])
def test_refusals_are_one_line_at_once(tmp_path, argv, said):
    """Each refusal is one line on stderr, exit 2, within seconds of starting: before torch."""
    (tmp_path / "notes.txt").write_text("Run it with torchrun.\nThen compare.\n")
    (tmp_path / "notes.txt.py").write_text("Run it with torchrun.\n")
    (tmp_path / "model.py").write_text(NEEDS_ARGUMENTS)
    names = {"notes": str(tmp_path / "notes.txt"), "script": str(tmp_path / "model.py")}
    argv = [arg.format(**names) for arg in argv]
    started = time.perf_counter()
    done, imported = _run("-m", "fsdp_bridge", *argv)
    seconds = time.perf_counter() - started
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert lines == [f"fsdp-bridge {argv[0]}: error: " + lines[0].split(": error: ", 1)[-1]]
    assert said.format(**names) in lines[0], lines
    assert _torch_modules(imported) == [] and seconds < 5, seconds


def test_no_command_is_an_error_line_after_the_overview():
    done = subprocess.run([sys.executable, "-m", "fsdp_bridge"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: fsdp-bridge ")
    assert done.stderr.splitlines()[-1] == (
        "fsdp-bridge: error: name a command, e.g. fsdp-bridge demo (fsdp-bridge --help "
        "describes each)")
    assert [name for name in SUBCOMMANDS if name not in done.stderr] == []


def test_migrate_to_bridge_and_explain_tables_need_no_torch_and_v_logs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom torch.distributed.fsdp import FullyShardedDataParallel "
                      "as FSDP, ShardingStrategy\n\nmodel = FSDP(torch.nn.Linear(2, 2), "
                      "sharding_strategy=ShardingStrategy.FULL_SHARD)\n")
    done, imported = _run("-m", "fsdp_bridge", "-v", "migrate", str(script), "--to", "bridge")
    assert done.returncode == 1, done.stderr[-2000:]  # changes pending
    assert "+from fsdp_bridge.fsdp import FullyShardedDataParallel" in done.stdout
    assert _torch_modules(imported) == []
    # -v (before or after the command): the library's INFO records, by logger name.
    assert "[fsdp_bridge.migrate.driver] migrating 1 files to bridge" in done.stderr
    done, imported = _run("-m", "fsdp_bridge", "explain")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| `sharding_strategy` |" in done.stdout
    assert _torch_modules(imported) == []
