"""Ctrl-C ends every command with one line and exit 130, also before any work starts (while
torch or libcst loads): never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fsdp_bridge import cli

FSDP1 = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\nmodel = FSDP(model)\n"


def test_an_interrupt_while_a_subcommand_loads_is_one_line(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.importlib, "import_module", interrupted)
    assert cli.main(["bench", "--steps", "1"]) == cli.EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "fsdp-bridge bench: interrupted (Ctrl-C).\n"


def test_an_interrupt_while_a_subcommand_runs_is_one_line(monkeypatch, capsys):
    from fsdp_bridge.migrate import cli as migrate_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(migrate_cli, "walk", interrupted)
    assert cli.main(["migrate", ".", "--to", "fsdp2"]) == 130
    assert capsys.readouterr().err == "fsdp-bridge migrate: interrupted (Ctrl-C).\n"


def _loaded(pid: int, library: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as handle:
            return library in handle.read()
    except OSError:
        return False


@pytest.mark.parametrize("argv, library", [
    (["bench", "--steps", "1"], "libtorch"),
    (["demo", "--only", "yafsdp"], "libtorch"),
    (["compare", "--recipe", "mlp", "--steps", "1"], "libtorch"),
    (["migrate", "{tree}", "--to", "fsdp2", "-j", "1"], "libcst"),
])
def test_ctrl_c_before_work_starts_is_one_line_and_exit_130(tmp_path, argv, library):
    tree = tmp_path / "tree"
    tree.mkdir()
    for index in range(300):  # enough files that migrate is still at them when interrupted
        (tree / f"train_{index}.py").write_text(FSDP1)
    argv = [arg.replace("{tree}", str(tree)) for arg in argv]
    command = subprocess.Popen([sys.executable, "-m", "fsdp_bridge", *argv], cwd=tmp_path,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"),
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _loaded(command.pid, library) and command.poll() is None:
            assert time.monotonic() < deadline, f"{library} never loaded"
            time.sleep(0.05)
        command.send_signal(signal.SIGINT)
        _, err = command.communicate(timeout=120)
    finally:
        if command.poll() is None:
            os.killpg(command.pid, signal.SIGKILL)
    assert command.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"fsdp-bridge {argv[0]}: interrupted"), err
