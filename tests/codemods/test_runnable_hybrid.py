"""FSDP1's HYBRID_SHARD over a 2-D device mesh the script builds becomes `fully_shard(model,
mesh=mesh)` under `--to fsdp2` (no runtime helper). Run in a 2-rank gloo world: on a (1, 2) mesh
(two shards, one replica) the losses equal native FSDP1's; on a (2, 1) mesh (two replicas of one
shard), where native FSDP1 switches itself to NO_SHARD inside each replica, they equal the
runtime helper's, which the rewrite used to call."""

import pathlib

from fsdp_bridge.migrate.driver import transform_source
from tests.codemods.runnable_loader import load_fixture as _load
from tests.world import run_world

FIXTURE = pathlib.Path(__file__).parent / "runnable" / "fsdp1_hybrid_mesh.py"


def _run(rank, world_size, paths):
    return {(name, shape): _load(path).train(rank, shape) for name, path in paths.items()
            for shape in ((1, 2), (2, 1)) if (name, shape) != ("fsdp1", (2, 1))}


def test_hybrid_over_a_given_mesh_is_fully_shard_on_that_mesh(tmp_path):
    source, sites = transform_source(FIXTURE.read_text(), "fsdp2")
    assert "model = fully_shard(model, mesh=mesh)" in source and "fsdp_bridge" not in source
    assert [(s["rule"], s["status"]) for s in sites] == [("FB100", "translated in place")]
    helper = source.replace("from torch.distributed.fsdp import fully_shard",
                            "from fsdp_bridge.migrate.runtime import fsdp1_fully_shard\n"
                            "from torch.distributed.fsdp import ShardingStrategy")
    helper = helper.replace("fully_shard(model, mesh=mesh)", "fsdp1_fully_shard(model, device_mesh=mesh, "
                            "sharding_strategy=ShardingStrategy.HYBRID_SHARD)")
    paths = {"fsdp1": str(FIXTURE)}
    for name, text in (("fsdp2", source), ("helper", helper)):
        (tmp_path / f"{name}.py").write_text(text)
        paths[name] = str(tmp_path / f"{name}.py")
    for result in run_world(_run, 2, paths, timeout=180):
        assert len(result["fsdp1", (1, 2)]) == 3
        assert result["fsdp2", (1, 2)] == result["fsdp1", (1, 2)] == result["helper", (1, 2)]
        assert result["fsdp2", (2, 1)] == result["helper", (2, 1)]
