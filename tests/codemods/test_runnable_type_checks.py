"""`isinstance(x, FSDP)` after `--to fsdp2`, run: in a file whose model a framework wraps in
torch's FSDP1 (runnable/fsdp1_framework_branch.py), the FSDP1-only branch must still run after
the rewrite, in a 2-rank gloo world. The same file without its framework import is narrowed to
FSDPModule, and the branch is then skipped for an FSDP1 wrapper: that is what the widening
prevents, and it shows the comparison can fail."""

import pathlib

from fsdp_bridge.migrate.driver import transform_source
from tests.codemods.runnable_loader import load_fixture as _load
from tests.world import run_world

FIXTURE = pathlib.Path(__file__).parent / "runnable" / "fsdp1_framework_branch.py"
FRAMEWORK_IMPORT = "import accelerate  # noqa: F401  (the framework that wraps the model)\n"


def _framework_prepare(module):
    """What accelerate's FSDP1 plugin does with the model: torch's own FSDP1 wrapper."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel(module, device_id=torch.device("cpu"))


def _run_all(rank, world_size, paths):
    return {name: _load(path).train(rank, _framework_prepare) for name, path in paths.items()}


def test_fsdp1_branch_still_runs_for_a_framework_built_wrapper(tmp_path):
    source = FIXTURE.read_text()
    assert FRAMEWORK_IMPORT in source
    widened, _ = transform_source(source, "fsdp2")
    narrowed, _ = transform_source(source.replace(FRAMEWORK_IMPORT, ""), "fsdp2")
    assert "isinstance(model, (FSDPModule, FSDP))" in widened
    assert "isinstance(model, FSDPModule)" in narrowed
    paths = {"fsdp1": str(FIXTURE)}
    for name, text in (("widened", widened), ("narrowed", narrowed)):
        (tmp_path / f"{name}.py").write_text(text)
        paths[name] = str(tmp_path / f"{name}.py")
    for result in run_world(_run_all, 2, paths, timeout=180):
        assert result["fsdp1"] and set(result["fsdp1"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
        assert result["widened"] == result["fsdp1"]
        assert result["narrowed"] is None  # the weight sync would silently stop
