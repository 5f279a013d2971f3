"""`migrate --to bridge` on a file whose model accelerate builds, run before and after in one
2-rank CPU world (runnable/framework_accelerate_sync.py): migrated, the Accelerator is
fsdp_bridge's, the model is on our engine, its `isinstance(model, FSDPModule)` branch still runs
and the losses equal the original's. What migrate did before (the FSDP import swapped, the
Accelerator left as it was) is run too: torch's wrapper, and the branch silently skipped."""

import importlib.util
import pathlib

import pytest

from fsdp_bridge.migrate.driver import transform_source
from tests.world import run_world

pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")

FIXTURE = pathlib.Path(__file__).parent / "runnable" / "framework_accelerate_sync.py"
SWAP = ("from torch.distributed.fsdp import FSDPModule", "from fsdp_bridge.fsdp import FSDPModule")


def _variants(rank, world_size, paths):
    from tests.integrations.accelerate_cpu import fresh_accelerate_state

    out = {}
    for name, path in paths.items():
        fresh_accelerate_state()
        spec = importlib.util.spec_from_file_location(f"variant_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        out[name] = module.train(rank)
    return out


def test_accelerate_file_migrated_to_bridge_trains_on_our_engine_and_keeps_its_branch(tmp_path):
    source = FIXTURE.read_text()
    migrated, sites = transform_source(source, "bridge")
    assert "from fsdp_bridge.integrations.accelerate import Accelerator" in migrated
    assert SWAP[1] in migrated and "TODO" not in migrated
    assert {site["rule"] for site in sites} == {"FB001", "FB006"}
    paths = {"original": FIXTURE, "migrated": tmp_path / "migrated.py", "import_only": tmp_path / "swap.py"}
    paths["migrated"].write_text(migrated)
    assert SWAP[0] in source
    paths["import_only"].write_text(source.replace(*SWAP))
    results = run_world(_variants, 2, {name: str(path) for name, path in paths.items()})
    for out in results:
        assert (out["original"]["engine"], out["migrated"]["engine"]) == ("torch", "fsdp_bridge")
        assert out["original"]["synced"] and out["migrated"]["synced"]
        assert out["migrated"]["losses"] == out["original"]["losses"]
        # the import swapped alone: torch's wrapper, and the sync branch silently skipped
        assert out["import_only"]["engine"] == "torch" and not out["import_only"]["synced"]
