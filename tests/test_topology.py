"""The topology resolver without a process group: which groups each mode keeps, the errors that
name the argument and the dialect, and that it stays below the front-ends. (Groups built from
meshes and nodes are exercised by the spawned front-end parity cases.)"""

import ast
import inspect

import pytest
from torch import nn

from fsdp_bridge import topology
from fsdp_bridge.plan import ShardingMode
from fsdp_bridge.topology import resolve_topology, topology_of_groups

# Stand-ins for process groups: choosing among given groups calls nothing on them.
SHARD, REPLICATE = object(), object()


def test_each_mode_keeps_only_its_groups():
    sharded = topology_of_groups(ShardingMode.SHARD, SHARD)
    assert (sharded.shard_group, sharded.replicate_group) == (SHARD, None)
    # FSDP1 passes NO_SHARD's one group as process_group: it is where the replicas live.
    replicated = topology_of_groups(ShardingMode.REPLICATE, SHARD)
    assert (replicated.shard_group, replicated.replicate_group) == (None, SHARD)
    hybrid = topology_of_groups(ShardingMode.HYBRID, SHARD, REPLICATE)
    assert (hybrid.shard_group, hybrid.replicate_group) == (SHARD, REPLICATE)
    assert hybrid.world_group is None  # no process group in this process


def test_hybrid_needs_both_groups():
    with pytest.raises(ValueError, match="hybrid sharding needs both a shard group"):
        topology_of_groups(ShardingMode.HYBRID, SHARD, None)


@pytest.mark.parametrize("mode, kwargs, argument, accepted", [
    (ShardingMode.SHARD, dict(process_group="pg", device_mesh="mesh"), "device_mesh",
     "only one of process_group and device_mesh"),
    (ShardingMode.SHARD, dict(device_mesh="mesh"), "device_mesh", "a DeviceMesh"),
    (ShardingMode.SHARD, dict(process_group=("a", "b")), "process_group",
     "None or one ProcessGroup for FULL"),
    (ShardingMode.HYBRID, dict(process_group="pg"), "process_group",
     "a tuple (shard_group, replicate_group) for FULL"),
])
def test_errors_name_the_dialect_and_the_argument(mode, kwargs, argument, accepted):
    with pytest.raises((TypeError, ValueError)) as info:
        resolve_topology(mode, frontend="Dialect", setting="FULL", **kwargs)
    message = str(info.value)
    assert message.startswith(f"Dialect: {argument}=") and accepted in message, message


def test_the_resolver_imports_no_front_end():
    tree = ast.parse(inspect.getsource(topology))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    ours = {name for name in imported if name.startswith("fsdp_bridge")}
    assert ours <= {"fsdp_bridge.plan", "fsdp_bridge.translation", "fsdp_bridge.engine.topology"}, ours


def test_shared_wrapper_errors_name_the_wrapping_dialect():
    from fsdp_bridge.zeta import fsdp

    model = fsdp(nn.Sequential(nn.Linear(4, 4)), shard_strat="FULL_SHARD")
    with pytest.raises(ValueError, match=r"^zeta\.fsdp: state_dict_type="):
        type(model).set_state_dict_type(model, "LOCAL_STATE_DICT")
    with pytest.raises(ValueError, match=r"^zeta\.fsdp: writeback="):
        with type(model).summon_full_params(model, rank0_only=True):
            pass


def test_a_launched_rank_without_a_process_group_is_refused_by_name(monkeypatch):
    # torchrun sets these; forgetting init_process_group must not train a world of one per rank.
    from fsdp_bridge.fsdp import FullyShardedDataParallel

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"init_process_group\(\.\.\.\)") as caught:
        FullyShardedDataParallel(nn.Linear(4, 4))
    assert "RANK=1 WORLD_SIZE=2 LOCAL_RANK=1" in str(caught.value)
    with pytest.raises(ValueError, match="init_process_group"):
        topology_of_groups(ShardingMode.SHARD)


def test_a_single_process_or_a_launched_world_of_one_needs_no_group(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert topology_of_groups(ShardingMode.SHARD).world_group is None
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert topology_of_groups(ShardingMode.SHARD).world_group is None
