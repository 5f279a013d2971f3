"""A command that needs an optional dependency which is not installed says so in one line on
stderr, naming the extra to install, and exits 2: no traceback, and no rank is spawned to fail."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Runs the command line with the named top-level modules made unimportable, as if not installed.
HIDE_AND_RUN = """
import sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

HIDDEN = set(sys.argv[1].split(","))
sys.meta_path.insert(0, NotInstalled())
from fsdp_bridge.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _run_without(hidden: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", HIDE_AND_RUN, hidden, *argv],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [
    ["bench", "--steps", "1"],
    ["explain", "--demo"],
    ["compare", "--steps", "1"],
    ["demo", "--only", "yafsdp"],
])
def test_missing_transformers_is_one_line_naming_the_extra(argv):
    done = _run_without("transformers", *argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"fsdp-bridge {argv[0]}")
    assert "needs transformers" in lines[0] and "pip install 'fsdp-bridge[hf]'" in lines[0]


def test_missing_matplotlib_for_the_demo_names_the_plot_extra():
    done = _run_without("matplotlib", "demo")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs matplotlib" in done.stderr and "fsdp-bridge[plot]" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_import_of_an_extra_that_fails_late_is_still_one_line():
    # convert-checkpoint reads safetensors only once it meets such a file.
    from fsdp_bridge.extras import as_missing_extra

    exc = ModuleNotFoundError("No module named 'safetensors.torch'", name="safetensors.torch")
    assert "pip install 'fsdp-bridge[hf]'" in str(as_missing_extra(exc))
    assert as_missing_extra(ModuleNotFoundError("x", name="numpy")) is None
