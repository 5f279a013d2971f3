"""Type checks are settled over the whole tree: `isinstance(x, FullyShardedDataParallel)` is only
narrowed to the new class when no file of the run keeps an FSDP1 constructor, whatever the
worker split (`-j`), and the report names the files that keep one."""

import json
import os
import pathlib

import pytest

from fsdp_bridge.cli import main

# A constructor no codemod can translate (the class is applied later, through a partial).
KEPT = '''import functools

from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy


def build(model):
    # The wrapper class is applied later: no codemod can translate this call.
    wrap = functools.partial(FSDP, sharding_strategy=ShardingStrategy.FULL_SHARD)
    return wrap(model)
'''
TRANSLATED = '''from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def build(model):
    return FSDP(model)
'''
CHECKS = '''from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


def is_sharded(model):
    return isinstance(model, FSDP) or issubclass(type(model), FSDP)
'''
NEW_CLASS = {"fsdp2": "FSDPModule", "yafsdp": "YaFSDP"}


def _tree(root: pathlib.Path, builder: str) -> pathlib.Path:
    root.mkdir()
    (root / "a_build.py").write_text(builder)
    (root / "z_checks.py").write_text(CHECKS)
    return root


def _migrate(root: pathlib.Path, target: str, jobs: int, *extra: str) -> dict:
    report = root.parent / f"{root.name}-report.json"
    main(["migrate", str(root), "--to", target, "-j", str(jobs), "--report", str(report), *extra])
    return {pathlib.Path(f["path"]).name: f for f in json.loads(report.read_text())["files"]}


@pytest.mark.parametrize("jobs", [1, 2])
@pytest.mark.parametrize("target", ["fsdp2", "yafsdp"])
def test_checks_accept_both_when_another_file_keeps_fsdp1(tmp_path, target, jobs):
    root = _tree(tmp_path / "tree", KEPT)
    files = _migrate(root, target, jobs, "--write")
    checks = (root / "z_checks.py").read_text()
    new = NEW_CLASS[target]
    assert f"isinstance(model, ({new}, FSDP))" in checks
    assert f"issubclass(type(model), ({new}, FSDP))" in checks
    imports = ("import FSDPModule\n", "import FullyShardedDataParallel as FSDP\n")
    assert all(line in checks for line in imports) or target == "yafsdp"
    assert "TODO(fsdp-bridge FB202)" in (root / "a_build.py").read_text()
    reasons = [s["reason"] for s in files["z_checks.py"]["sites"]]
    assert len(reasons) == 2 and all("still accepted" in r for r in reasons)
    if target == "fsdp2":  # the report says where the FSDP1 constructor stays
        assert all("a_build.py line 8 (FB202)" in r for r in reasons), reasons
    # A second run changes nothing.
    assert main(["migrate", str(root), "--to", target, "--check", "-j", str(jobs)]) == 0


@pytest.mark.parametrize("jobs", [1, 2])
def test_checks_are_narrowed_when_every_constructor_is_translated(tmp_path, jobs):
    root = _tree(tmp_path / "tree", TRANSLATED)
    _migrate(root, "fsdp2", jobs, "--write")
    checks = (root / "z_checks.py").read_text()
    assert "isinstance(model, FSDPModule)" in checks and "FSDP)" not in checks
    assert "fully_shard(model)" in (root / "a_build.py").read_text()


def test_a_file_that_cannot_be_written_leaves_the_whole_tree_unwritten(tmp_path):
    root = _tree(tmp_path / "tree", TRANSLATED)
    build = root / "a_build.py"
    checks_before = (root / "z_checks.py").read_text()
    os.chmod(build, 0o444)
    try:
        files = _migrate(root, "fsdp2", 2, "--write")
    finally:
        os.chmod(build, 0o644)
    assert build.read_text() == TRANSLATED  # refused, with an error in the report
    assert "read-only" in files["a_build.py"]["error"]
    # The checks that depend on it are not narrowed on disk either: nothing is written.
    assert (root / "z_checks.py").read_text() == checks_before


def test_a_file_that_does_not_parse_counts_as_keeping_fsdp1(tmp_path):
    root = _tree(tmp_path / "tree", "from torch.distributed.fsdp import FullyShardedDataParallel\ndef f(:\n")
    files = _migrate(root, "fsdp2", 1)
    assert files["a_build.py"]["error"]
    assert "(not migrated" in files["z_checks.py"]["sites"][0]["reason"]
