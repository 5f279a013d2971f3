"""What a stranger installs: the sdist holds what `make test` needs and builds the wheel; the
wheel, installed into a fresh virtual environment beside the torch already installed here (no
download), runs `fsdp-bridge --version`, `migrate`, libcst's runner and `demo` from outside the
repository.

The fresh environment sees this interpreter's packages through a `.pth` file naming a folder of
links to them, leaving out `transformers` (the `hf` extra) and fsdp-bridge itself: so `demo`
must say which extra is missing, and every other command runs on the installed wheel alone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

from fsdp_bridge import __version__

ROOT = Path(__file__).resolve().parents[1]
# Build outputs and caches: not sources, never in the sdist.
NOT_SOURCES = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
               ".hypothesis", "out")
# Left out of the fresh environment: the extra whose absence `demo` must report, and the
# editable install of this checkout (the wheel must stand alone).
LEFT_OUT = ("transformers", "fsdp_bridge", "__editable__", "_distutils_hack")

FSDP1_SCRIPT = """\
import torch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def wrap(model):
    return FSDP(model)
"""


def _build(backend_call: str, source: Path, out: Path) -> Path:
    """Build with setuptools' PEP 517 backend (what `python -m build` calls), no isolation."""
    out.mkdir(exist_ok=True)
    code = f"import setuptools.build_meta as b; print(b.{backend_call}({str(out)!r}))"
    done = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


def _sources(root: Path) -> set[str]:
    found = set()
    for directory, folders, files in os.walk(root):
        folders[:] = [f for f in folders if not shutil.ignore_patterns(*NOT_SOURCES)("", [f])]
        found |= {str((Path(directory) / f).relative_to(root)) for f in files
                  if not f.endswith((".pyc", ".pyo"))}
    return found


def _fresh_venv(path: Path, deps: Path) -> Path:
    """A venv without pip whose only extra packages are links to this interpreter's, less
    LEFT_OUT; returns its python."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True)
    deps.mkdir()
    here = Path(sysconfig.get_paths()["purelib"])
    for entry in here.iterdir():
        if not entry.name.startswith(LEFT_OUT) and entry.suffix != ".pth":
            (deps / entry.name).symlink_to(entry)
    (Path(site.stdout.strip()) / "installed_beside.pth").write_text(f"{deps}\n")
    return python


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("packaging")
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES), symlinks=True)
    sdist = _build("build_sdist", source, tmp / "dist")
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp / "unpacked", filter="data")
    unpacked = next((tmp / "unpacked").iterdir())
    wheel = _build("build_wheel", unpacked, tmp / "dist")  # the wheel comes from the sdist
    return {"tmp": tmp, "source": source, "unpacked": unpacked, "wheel": wheel}


def test_the_sdist_holds_what_make_test_needs(built):
    in_sdist = _sources(built["unpacked"])
    wanted = {f for f in _sources(built["source"]) if f.split(os.sep)[0] in
              ("tests", "fsdp_bridge", "codemods", "docs", "benchmarks", "examples", ".ci")}
    wanted |= {"LICENSE", "README.md", "CHANGELOG.md", "Makefile", "pyproject.toml",
               ".libcst.codemod.yaml", "requirements-test.txt"}
    assert sorted(wanted - in_sdist) == []
    assert (built["unpacked"] / "LICENSE").read_text().startswith(
        (ROOT / "LICENSE").read_text()[:200])


def test_the_wheel_holds_the_license_and_the_examples(built):
    wheel = zipfile.ZipFile(built["wheel"])
    names = wheel.namelist()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), names
    assert "fsdp_bridge/examples/yafsdp_llama.py" in names
    assert "fsdp_bridge/examples/fsdp1_train_llama.py" in names
    assert "fsdp_bridge/frontends.md" in names  # what `fsdp-bridge explain` prints
    assert not any(name.startswith(("tests/", "codemods/", "examples/")) for name in names)
    # The metadata a package index shows: Python versions, the extras a user installs, and no
    # extra of the test suite's own tools.
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Classifier: Programming Language :: Python :: 3.11" in metadata
    extras = sorted(line.split(": ", 1)[1] for line in metadata.splitlines()
                    if line.startswith("Provides-Extra: "))
    assert extras == ["hf", "lightning", "plot"], extras


def test_the_installed_wheel_runs_outside_the_repository(built):
    tmp = built["tmp"]
    python = _fresh_venv(tmp / "venv", tmp / "deps")
    work = tmp / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # From outside the repository: pip would take its fsdp_bridge.egg-info for an installed copy.
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                              "--no-deps", "--no-index", "--quiet", str(built["wheel"])],
                             cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert install.returncode == 0, install.stdout + install.stderr

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], cwd=work, env=env, capture_output=True,
                              text=True, timeout=180)

    cli = python.parent / "fsdp-bridge"
    version = run(cli, "--version")
    assert version.returncode == 0 and version.stdout.split() == ["fsdp-bridge", __version__], version
    where = run(python, "-c", "import fsdp_bridge.demo as d, fsdp_bridge.harness.demo_flow as f;"
                "print(d.__file__); print(d.EXAMPLE.is_file(), os.path.isfile(f.EXAMPLE))"
                .replace("import", "import os,", 1))
    assert where.stdout.split()[1:] == ["True", "True"], where
    assert where.stdout.startswith(str(tmp / "venv")), where.stdout  # the wheel, not the repo

    script = work / "train.py"
    script.write_text(FSDP1_SCRIPT)
    migrated = run(cli, "migrate", script, "--to", "fsdp2")
    assert migrated.returncode == 1, migrated.stdout + migrated.stderr  # 1: changes pending
    assert "+    return fully_shard(model)" in migrated.stdout, migrated.stdout

    runner = run(python, "-m", "libcst.tool", "codemod", "-x",
                 "fsdp_bridge.codemods.to_fsdp2.ToFsdp2Command", "--no-format", "-j", "1", script)
    assert runner.returncode == 0, runner.stdout + runner.stderr
    assert "fully_shard(model)" in script.read_text()

    demo = run(cli, "demo")
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert "Traceback" not in demo.stderr
    assert "needs transformers" in demo.stderr and "pip install 'fsdp-bridge[hf]'" in demo.stderr


def test_libcst_runner_lists_the_three_commands_of_the_codemods_folder():
    # .libcst.codemod.yaml points libcst's runner at codemods/: one module per target.
    done = subprocess.run([sys.executable, "-m", "libcst.tool", "list"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    names = [line.split(" - ")[0] for line in done.stdout.splitlines()]
    assert names == ["to_bridge.ToBridgeCommand", "to_fsdp2.ToFsdp2Command",
                     "to_yafsdp.ToYafsdpCommand"], done.stdout
    assert all(" - No description." not in line for line in done.stdout.splitlines())
