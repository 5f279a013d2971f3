"""FSDP2 edges against native `fully_shard`, both run in one CPU/gloo world of four ranks
(fsdp2_round3_cases.py):

- tensor parallelism split unevenly (a weight of 9 rows over 2 tensor-parallel ranks: local
  shapes (5, 6) and (4, 6)) trains as natively, bit for bit: the ranks' agreement check compares
  a tensor-parallel parameter's global shape and placements, not its local shape;
- a parameter whose tensor defines FSDP2's all-gather extension (`fsdp_pre_all_gather` /
  `fsdp_post_all_gather`, the float8 path; here a subclass gathered in bf16) runs its hooks and
  trains as natively, bit for bit, on a 1-D and a 2-D mesh (the hooks change the numbers);
- a forward on parameters still on meta (never materialised nor loaded) raises a RuntimeError
  naming them, as natively; initialised afterwards, ours trains as the native recipe does;
- a tied embedding / output weight built on meta and loaded with `load_state_dict(...,
  assign=True)` (which unties it) is tied again at the first forward, as natively: the
  embedding's gradient and every weight equal native's, bit for bit, over three steps;
- a module of a list call (`fully_shard([norm, head])`) that the forward skips, called on its
  own for each chunk of a chunked loss (so after a backward), trains as natively;
- `fully_shard`-ed layers inside torch's composable `replicate()` train as natively (replicate
  skips the modules fully_shard manages: ours are marked as FSDP2 marks its own);
- fp16 gradients are divided before and after their reduction as natively (a power of two
  before, the rest after, in fp16), so ten fp16 steps end on native's weights bit for bit, on a
  1-D mesh (each pair of ranks swaps halves on gloo) and on a 2-D HSDP mesh, and with an
  all-reduce hook on a unit in fp16 and in fp32;
- a torchtitan-shaped training on a (dp 2, tp 2) mesh, in torchtitan's order: torchao float8
  training with float8 all-gather, tensor parallelism on each block (torchao's float8 plans),
  each block compiled in place with `fullgraph=True` (aot_eager), fully_shard over dp, scales
  precomputed after each step: three AdamW steps on native's losses and weights, bit for bit;
- torchao float8 all-gather under HSDP + TP (a (dp_replicate 1, dp_shard 2, tp 2) mesh, float8
  tensor-parallel plans, fully_shard over (dp_replicate, dp_shard)), and an all-gather
  extension under `dp_mesh_dims` naming the dimensions of a (dp_replicate 2, dp_shard 2) SPMD
  mesh: the pre-all-gather hook is given the shard dimension's 1-D mesh, as natively, and
  training matches native bit for bit;
- `dp_mesh_dims` on a (dp 2, tp 2) SPMD mesh (torch >= 2.12): parameters that are DTensors on
  the whole mesh (column-wise then row-wise on tp) get native's placements and train as natively,
  bit for bit;
- a unit gathered for compute (inside its forward, kept gathered until its backward with
  `reshard_after_forward=False` or as the root, after `unshard()`) holds plain `nn.Parameter`s
  as natively, and its sharded DTensors again after backward; a loss term reading such a weight
  between forward and backward trains it as natively; a state dict taken after a forward
  without gradients is one of sharded DTensors and loads back; a registered forward method
  that runs the forward (as `generate` does) ends with the sharded parameters registered;
- expert parallelism beside data parallelism, torchtitan's MoE recipe (fsdp2_expert_cases.py,
  torch >= 2.12): experts split over ep and, through a `shard_placement_fn` returning
  `ShardPlacementResult`s, sharded over the expert-data-parallel mesh while the rest is sharded
  over all four ranks, train as natively bit for bit (losses, gradients, placements,
  torchtitan's per-mesh clipping norms, state dicts), with FSDP2's gradient averaging and with
  division turned off, and experts sharded instead over a 2-D (replicate, shard) mesh of their
  own (HSDP); DCP checkpoints load both ways; per-module collectives and hooks over several
  meshes are refused with FSDP2's ValueError;
- `set_all_reduce_hook(hook, stream=...)` runs the hook inside the stream, and is refused under
  HSDP with FSDP2's ValueError, as natively.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp

from tests.frontends import fsdp2_round3_cases as C
from tests.world import case_result as case
from tests.world import run_world

needs_dp_mesh_dims = pytest.mark.skipif(
    not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"), reason=f"torch "
    f"{torch.__version__} has no DataParallelMeshDims (dp_mesh_dims needs torch >= 2.12)")


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 4)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_uneven_tensor_parallel_trains_as_native(world, rank):
    result = case(world, "uneven_tensor_parallel", rank)
    native, ours = result["native"], result["ours"]
    assert native["local_shapes"] == ours["local_shapes"]
    assert ours["losses"] == native["losses"]
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


def test_uneven_tensor_parallel_shards_differ_between_tensor_parallel_peers(world):
    shapes = [case(world, "uneven_tensor_parallel", rank)["ours"]["local_shapes"]["0.weight"]
              for rank in range(4)]
    # Rank r is (dp, tp) = (r // 2, r % 2): tp rank 0 holds 5 of the 9 rows, tp rank 1 holds 4;
    # each dp rank then keeps half of them (rounded up on dp rank 0).
    assert shapes[0] != shapes[1], shapes


@pytest.mark.parametrize("mesh", ["extension_1d", "extension_2d"])
def test_all_gather_extension_runs_its_hooks_and_trains_as_native(world, mesh):
    plain = case(world, "plain_output", 0)
    result = case(world, mesh, 0)
    native, ours = result["native"], result["ours"]
    assert native["calls"] == ["post", "pre"], "native must run both hooks"
    assert not torch.allclose(native["output"], plain, rtol=0, atol=1e-6), (
        "the hooks must change the numbers, or this case shows nothing")
    assert ours["calls"] == native["calls"]
    assert ours["local_type"] == native["local_type"] == "GathersInBf16"
    assert torch.equal(ours["output"], native["output"])
    assert ours["losses"] == native["losses"]
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


@pytest.mark.parametrize("rank", [0, 3])
def test_a_forward_on_meta_parameters_raises_as_native(world, rank):
    result = case(world, "meta_never_loaded", rank)
    native, ours = result["native"], result["ours"]
    assert native["error"] is not None and "meta" in native["error"]
    assert ours["error"] is not None
    # As natively: the parameters of the first fully_shard call, root first, that has any.
    for expected in ("meta device", "['2.weight', '2.bias']", "to_empty"):
        assert expected in ours["error"], ours["error"]
        assert expected in native["error"] or expected == "to_empty", native["error"]
    # Initialised after the error, ours trains as the recipe does natively.
    expected = case(world, "meta_initialised", rank)["native"]["losses"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(expected),
                               rtol=1e-5, atol=1e-6)


def test_meta_init_recipe_trains_as_native(world):
    result = case(world, "meta_initialised", 0)
    torch.testing.assert_close(torch.tensor(result["ours"]["losses"]),
                               torch.tensor(result["native"]["losses"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tie_broken_by_an_assign_load_is_restored_as_native(world, rank):
    result = case(world, "tied_after_assign_load", rank)
    native, ours = result["native"], result["ours"]
    assert native["tied"] and ours["tied"]
    for step, (mine, theirs) in enumerate(zip(ours["grads"], native["grads"])):
        assert torch.equal(mine, theirs), f"embedding gradient differs at step {step}"
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


@pytest.mark.parametrize("rank", [0, 2])
def test_a_list_call_module_run_on_its_own_after_a_backward_trains_as_native(world, rank):
    result = case(world, "list_call_member_alone", rank)
    native, ours = result["native"], result["ours"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]),
                               rtol=1e-5, atol=1e-6)
    for name, value in native["full"].items():
        torch.testing.assert_close(ours["full"][name], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rank", [0, 3])
def test_fully_shard_inside_replicate_trains_as_native(world, rank):
    result = case(world, "inside_replicate", rank)
    native, ours = result["native"], result["ours"]
    assert ours["types"] == native["types"]
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]),
                               rtol=1e-5, atol=1e-6)
    for index, (mine, theirs) in enumerate(zip(ours["weights"], native["weights"])):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"parameter {index}: {m}")



@pytest.mark.parametrize("mesh", ["fp16_reduction_1d", "fp16_reduction_2d"])
def test_fp16_reduction_divides_as_native_bit_for_bit(world, mesh):
    result = case(world, mesh, 0)
    for name, value in result["native"]["full"].items():
        assert torch.equal(result["ours"]["full"][name], value), name


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_an_all_reduce_hook_with_a_reduce_dtype_trains_as_native_bit_for_bit(world, dtype):
    result = case(world, f"{dtype}_reduction_hook", 0)
    for name, value in result["native"]["full"].items():
        assert torch.equal(result["ours"]["full"][name], value), name
    if dtype == "fp16":  # the hook (halving model[0]'s reduced gradient) changed the numbers
        unhooked = case(world, "fp16_reduction_1d", 0)["native"]["full"]["0.weight"]
        assert not torch.equal(result["native"]["full"]["0.weight"], unhooked)


@pytest.mark.parametrize("rank", [0, 3])
def test_gathered_units_expose_plain_parameters_as_native(world, rank):
    result = case(world, "unsharded_parameters_exposed", rank)
    native, ours = result["native"], result["ours"]
    for moment in ("inside_forward", "after_forward", "after_unshard", "after_backward"):
        assert ours[moment] == native[moment], moment
    # What native shows, so that the comparison above means something: layers[0] (kept
    # gathered) and the root hold plain Parameters between forward and backward.
    assert native["after_forward"]["attr:layers.0.weight"] == "Parameter+Parameter(8, 6)"
    assert native["after_forward"]["layers.2.weight"].startswith("DTensor")
    # The loss term reading layers[0].weight after the forward trains it as natively.
    assert ours["losses"] == native["losses"]
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


@pytest.mark.parametrize("rank", [0, 3])
def test_a_state_dict_taken_while_gathered_is_sharded_as_native(world, rank):
    result = case(world, "state_dict_after_eval_forward", rank)
    native, ours = result["native"], result["ours"]
    for moment in ("after_eval", "state_dict", "after_state_dict"):
        assert ours[moment] == native[moment], moment
    assert all(kind.startswith("DTensor") for kind in ours["state_dict"].values())
    assert ours["losses"] == native["losses"]
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


@pytest.mark.parametrize("rank", [0, 3])
def test_a_forward_method_ends_with_sharded_parameters_as_native(world, rank):
    result = case(world, "after_forward_methods", rank)
    native, ours = result["native"], result["ours"]
    for moment, seen in native.items():
        assert ours[moment] == seen, moment
    # Registered with ours, the same as with torch's.
    assert ours["ours: after method"] == native["torch: after method"]
    assert ours["ours: after forward"] == native["torch: after forward"]
    assert native["torch: after method"]["scale"].startswith("DTensor")
    assert native["torch: after forward"]["scale"] == "Parameter+Parameter(4,)"


@pytest.mark.parametrize("rank", [0, 3])
def test_a_torchtitan_shaped_training_matches_native_bit_for_bit(world, rank):
    result = case(world, "torchtitan_shaped", rank)
    native, ours = result["native"], result["ours"]
    assert native["up"] == ("(_StridedShard(dim=0, sf=2), Shard(dim=0))",
                            "WeightWithDynamicFloat8CastTensor")
    assert ours["up"] == native["up"]
    assert ours["losses"] == native["losses"]
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


@needs_dp_mesh_dims
@pytest.mark.parametrize("rank", [0, 3])
def test_dp_mesh_dims_with_tensor_parallelism_trains_as_native(world, rank):
    result = case(world, "spmd_tensor_parallel", rank)
    native, ours = result["native"], result["ours"]
    assert native["placements"]["0.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert ours["placements"] == native["placements"]
    assert ours["losses"] == native["losses"]
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


def _has_placement_result() -> bool:
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: F401
            ShardPlacementResult,
        )
    except ImportError:
        return False
    return True


needs_placement_result = pytest.mark.skipif(
    not _has_placement_result(), reason=f"torch {torch.__version__} has no ShardPlacementResult "
    "(a shard_placement_fn naming a mesh of its own needs torch >= 2.12)")


EXPERT_PLACEMENTS = {
    # The experts: DTensors on the (efsdp, ep) mesh, split over both.
    "expert_parallel": ("('efsdp', 'ep')", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
    "expert_parallel_undivided": ("('efsdp', 'ep')", "(_StridedShard(dim=0, sf=2), Shard(dim=0))"),
    # No expert parallelism: HSDP over a (replicate, shard) mesh of their own.
    "experts_over_hsdp_mesh": ("('replicate', 'shard')", "(Replicate(), Shard(dim=0))"),
}


@needs_placement_result
@pytest.mark.parametrize("variant", sorted(EXPERT_PLACEMENTS))
@pytest.mark.parametrize("rank", [0, 3])
def test_experts_sharded_over_their_own_mesh_train_as_native(world, variant, rank):
    result = case(world, variant, rank)
    native, ours = result["native"], result["ours"]
    assert native["placements"]["layers.0.experts.w1"] == EXPERT_PLACEMENTS[variant]
    # The rest over dp (all four ranks).
    assert native["placements"]["layers.0.router.weight"] == ("('dp',)", "(Shard(dim=0),)")
    assert ours["placements"] == native["placements"]
    assert ours["losses"] == native["losses"]
    for name, (placements, grad) in native["grads"].items():
        assert ours["grads"][name][0] == placements, name
        assert torch.equal(ours["grads"][name][1], grad), name
    # torchtitan's clipping (a norm per mesh, combined) gives native's norms bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(ours["norms"], native["norms"]))
    # torch's clip_grad_norm_ over parameters of both meshes at once: the same outcome.
    assert ours["all_at_once"].keys() == native["all_at_once"].keys()
    assert ours["all_at_once"].get("raised") == native["all_at_once"].get("raised")
    for name, value in native["full"].items():
        assert torch.equal(ours["full"][name], value), name


@needs_placement_result
@pytest.mark.parametrize("rank", [0, 3])
def test_expert_checkpoints_load_across_native_and_ours(world, rank):
    result = case(world, "expert_checkpoints", rank)
    saved = result["saved"]
    for name, value in saved["native"].items():  # one step, on both sides alike
        assert torch.equal(saved["ours"][name], value), name
    for pair in ("native->ours", "ours->native"):
        source = saved[pair.split("->")[0]]
        for name, value in source.items():
            assert torch.equal(result["loaded"][pair][name], value), (pair, name)


@needs_placement_result
def test_per_module_collectives_over_several_meshes_are_refused_as_native(world):
    result = case(world, "expert_per_module_comms", 0)
    assert all(value is not None for value in result["native"].values())
    assert result["ours"] == result["native"]


def test_an_all_reduce_hook_runs_inside_its_stream_as_native(world):
    result = case(world, "all_reduce_hook_stream", 0)
    assert result["native"] == {"refused": "stream cannot be set when using native HSDP",
                                "inside_stream": [True]}
    assert result["ours"] == result["native"]


def _assert_trains_as_native(result: dict) -> None:
    """Losses, the last step's gradients (placements, local and full values), the parameters'
    meshes, placements and local values, and the full state dict: bit for bit."""
    native, ours = result["native"], result["ours"]
    assert ours["losses"] == native["losses"]
    for kind in ("grads", "params"):
        assert ours[kind].keys() == native[kind].keys(), kind
        for name, (*described, local) in native[kind].items():
            *our_described, our_local = ours[kind][name]
            assert our_described == described, (kind, name)
            assert torch.equal(our_local, local), (kind, name)
    for kind in ("full_grads", "full"):
        assert ours[kind].keys() == native[kind].keys(), kind
        for name, value in native[kind].items():
            assert torch.equal(ours[kind][name], value), (kind, name)


@pytest.mark.parametrize("shape", ["replicas", "shards"])
@pytest.mark.parametrize("rank", [0, 3])
def test_hsdp_with_tensor_parallelism_trains_as_native(world, shape, rank):
    result = case(world, f"hsdp_tp_{shape}", rank)
    placements = {name: described[1] for name, described in result["native"]["params"].items()}
    assert placements["0.weight"] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"
    assert placements["2.weight"] == "(Replicate(), Shard(dim=0), Shard(dim=1))"
    _assert_trains_as_native(result)


# FSDP2 hands an all-gather extension's pre-all-gather hook the 1-D mesh of the shard
# dimension (two ranks here), not the replicate one before it.
SHARD_MESH = [(1, ("dp_shard",), 2)]


@pytest.mark.parametrize("name", [
    "hsdp_tp_float8",  # torchao's float8 all-gather under HSDP + TP through mesh=
    pytest.param("spmd_hsdp_extension", marks=needs_dp_mesh_dims),  # HSDP by dp_mesh_dims
])
@pytest.mark.parametrize("rank", [0, 3])
def test_an_all_gather_extension_is_handed_the_shard_mesh_and_trains_as_native(world, name,
                                                                                 rank):
    result = case(world, name, rank)
    assert result["native"]["hook_meshes"] == SHARD_MESH
    assert result["ours"]["hook_meshes"] == SHARD_MESH
    _assert_trains_as_native(result)


SPMD_PLACEMENTS = {
    # HSDP beside tensor parallelism.
    "spmd_hsdp_tp": ("('dp_replicate', 'dp_shard', 'tp')",
                     "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))"),
    # HSDP with the shard names (dp_shard, cp) flattened after dp_replicate.
    "spmd_hsdp_two_shard_names": ("('dp_replicate', 'dp_shard_cp')",
                                  "(Replicate(), Shard(dim=0))"),
    # Two shard names flattened into one dimension of four ranks.
    "spmd_two_shard_names": ("('dp_shard_cp',)", "(Shard(dim=0),)"),
    # Replication alone (DDP): the parameter keeps its placements.
    "spmd_replicate_only": ("('dp_replicate', 'tp')", "(Replicate(), Shard(dim=0))"),
}


@needs_dp_mesh_dims
@pytest.mark.parametrize("variant", list(SPMD_PLACEMENTS))
@pytest.mark.parametrize("rank", [0, 3])
def test_dp_mesh_dims_layouts_train_as_native(world, variant, rank):
    result = case(world, variant, rank)
    assert result["native"]["params"]["0.weight"][:2] == SPMD_PLACEMENTS[variant]
    _assert_trains_as_native(result)


@needs_placement_result
@needs_dp_mesh_dims
@pytest.mark.parametrize("rank", [0, 3])
def test_a_parameter_given_an_spmd_mesh_of_its_own_trains_as_native(world, rank):
    result = case(world, "spmd_experts", rank)
    params = result["native"]["params"]
    assert params["experts"][:2] == ("('efsdp', 'ep')",
                                     "(_StridedShard(dim=0, sf=2), Shard(dim=0))")
    assert params["inp.weight"][:2] == ("('dp',)", "(Shard(dim=0),)")
    _assert_trains_as_native(result)


DP_MESH_DIMS_REFUSALS = {
    "placement_fn": ("ValueError", "Per-param mesh via shard_placement_fn is not supported with "
                     "DDPMeshInfo"),
    "reshard_int": ("NotImplementedError", "reshard_after_forward as int is not yet supported "
                    "with SPMD mesh (dp_mesh_dims)"),
}


@needs_dp_mesh_dims
@pytest.mark.parametrize("refusal", sorted(DP_MESH_DIMS_REFUSALS))
def test_dp_mesh_dims_refusals_raise_as_native(world, refusal):
    result = case(world, "refused_with_dp_mesh_dims", 0)
    native, ours = result["native"][refusal], result["ours"][refusal]
    kind, words = DP_MESH_DIMS_REFUSALS[refusal]
    assert native["types"][0] == kind and words in native["message"], native
    assert kind in ours["types"] and words in ours["message"], ours
