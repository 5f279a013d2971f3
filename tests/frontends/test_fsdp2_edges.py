"""FSDP2 at its edges, against native `fully_shard` in the same CPU/gloo world of two ranks (see
fsdp2_edge_cases.py): parameters a step leaves without a gradient keep `.grad` None as natively
(so AdamW's momentum and weight decay skip them), and a weight tied across two `fully_shard`
calls (the root's and an inner one's, or two siblings') is refused at the first forward with
FSDP2's ValueError and words, as natively. fp32 everywhere: rtol 1e-5 / atol 1e-6 against
native and against the single-process reference on the global batch."""

from __future__ import annotations

import pytest
import torch

from tests import native_torch as native
from tests.frontends import fsdp2_edge_cases as C
from tests.frontends import tp_cases
from tests.native_torch import skip_if
from tests.world import case_result as case
from tests.world import run_world

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=1.6e-2, atol=1e-5)


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


def same_training(actual: dict, expected: dict, tol=FP32) -> None:
    torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]),
                               **tol)
    assert actual.get("with_grad") == expected.get("with_grad"), "parameters with .grad differ"
    assert list(actual["state"]) == list(expected["state"])
    for name, value in expected["state"].items():
        torch.testing.assert_close(actual["state"][name], value, msg=lambda m: f"{name}: {m}",
                                   **tol)


@pytest.mark.parametrize("name", ["some_steps_in_root", "some_steps_own_unit"])
def test_a_module_used_on_some_steps_keeps_grad_none_as_native(world, name):
    for rank in (0, 1):
        result = case(world, name, rank)
        # The steps that skip `aux` leave its gradient None natively: AdamW then skips it.
        assert not any(n.startswith("aux") for n in result["native"]["with_grad"][1])
        same_training(result["ours"], result["native"])
        same_training(result["ours"], result["reference"])


def test_gradient_accumulation_gives_a_gradient_to_what_any_micro_step_reached(world):
    result = case(world, "accumulation")
    aux = [any(n.startswith("aux") for n in names) for names in result["native"]["with_grad"]]
    assert aux == [True, True, False, False]
    same_training(result["ours"], result["native"])


def test_two_partial_forwards_leave_the_skipped_module_without_gradient(world):
    result = case(world, "partial_forwards")
    assert all(not any(n.startswith("aux") for n in names)
               for names in result["ours"]["with_grad"])
    assert all(any(n.startswith("side") for n in names) for names in result["ours"]["with_grad"])
    same_training(result["ours"], result["native"])


def test_a_parameter_reached_on_one_rank_has_a_gradient_on_every_rank(world):
    assert case(world, "rank_dependent", 0)["aux_has_grad"]
    assert case(world, "rank_dependent", 1)["aux_has_grad"]


@pytest.mark.parametrize("name", ["tied_across_calls", "tied_across_sibling_calls"])
def test_a_weight_tied_across_two_fully_shard_calls_is_refused_as_native(world, name):
    result = case(world, name)
    ours = result["ours"]
    assert (ours["raised"], ours["at"]) == ("ValueError", "forward"), ours
    assert "'side.weight'" in ours["message"], ours["message"]
    assert "already managed by another FSDP group" in ours["message"]
    assert "fully_shard([module_a, module_b])" in ours["message"]
    # Until the forward, each call's module holds a DTensor of its own, as natively.
    assert ours["kinds"] == ["DTensor", "DTensor"] and not ours["same"]
    skip_if(native.fsdp2_keeps_ties_across_calls())
    native_result = result["native"]
    assert (native_result["raised"], native_result["at"]) == ("ValueError", "forward")
    assert "already managed by another FSDP group" in native_result["message"]
    assert (native_result["kinds"], native_result["same"]) == (ours["kinds"], ours["same"])


def test_set_reduce_scatter_unused_params_gives_zero_gradients_as_native(world):
    skip_if(native.fsdp2_lacks_method("set_reduce_scatter_unused_params"))
    result = case(world, "unused_as_zero")
    assert all(any(n.startswith("aux") for n in names) for names in result["native"]["with_grad"])
    same_training(result["ours"], result["native"])


@pytest.mark.parametrize("layout", ["fp32_block", "output_fp32"])
def test_mixed_precision_may_differ_between_fully_shard_calls(world, layout):
    for rank in (0, 1):
        result = case(world, f"precision_{layout}", rank)
        assert result["ours"]["output_dtypes"] == result["native"]["output_dtypes"]
        same_training(result["ours"], result["native"], BF16)
    if layout == "fp32_block":
        assert result["native"]["output_dtypes"]["middle"] == "torch.float32"
    else:
        assert set(result["native"]["output_dtypes"].values()) == {"torch.float32"}


def test_a_list_call_casts_every_module_and_unshards_before_forward(world):
    result = case(world, "list_call")
    assert result["native"]["input_dtypes"] == {"first": "torch.bfloat16",
                                                "last": "torch.bfloat16"}
    assert result["ours"]["input_dtypes"] == result["native"]["input_dtypes"]
    same_training(result["ours"], result["native"], BF16)


def test_third_party_checks_and_calls_work_as_on_native(world):
    for method in C.SURFACE_METHODS:
        skip_if(native.fsdp2_lacks_method(method))
    result = case(world, "surface")
    assert result["ours"]["facts"] == result["native"]["facts"]
    assert result["ours"]["facts"]["isinstance_torch"]
    same_training(result["ours"], result["native"])


def test_parameters_split_on_other_dims_train_as_native(world):
    for rank in (0, 1):
        result = case(world, "shard_dims", rank)
        ours, native = result["ours"], result["native"]
        assert ours["layouts"] == native["layouts"]
        assert "Shard(dim=2)" in ours["layouts"]["w_in"][0]
        assert ours["uneven"] == native["uneven"] == "NotImplementedError"
        assert ours["grads_local"] == {n: shape for n, (_, shape) in native["layouts"].items()}
        same_training(ours, native)
        for name, grad in native["grads"].items():
            torch.testing.assert_close(ours["grads"][name], grad, **FP32)
        for key, value in native["state_dict_local"].items():
            torch.testing.assert_close(ours["state_dict_local"][key], value, **FP32)


def test_an_all_reduce_hook_sees_and_changes_what_native_s_does(world):
    for rank in (0, 1):
        result = case(world, "all_reduce_hook", rank)
        ours, native = result["ours"], result["native"]
        assert len(ours["seen"]) == len(native["seen"]) == C.STEPS
        for mine, theirs in zip(ours["seen"], native["seen"]):
            torch.testing.assert_close(mine, theirs, **FP32)
        same_training(ours, native)


def test_two_models_in_a_threaded_world_train_as_native(tmp_path):
    """No process-global state: two ranks as threads of one process, each training two
    independently sharded models alternately, give native FSDP2's numbers."""
    import subprocess
    import sys

    out = tmp_path / "threaded.pt"
    run = subprocess.run([sys.executable, "-m", "tests.frontends.threaded_world", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = torch.load(out)
    assert "error" not in results, results["error"]
    for rank in (0, 1):
        assert "error" not in results[rank], results[rank]["error"]
        ours, native = results[rank]["ours"], results[rank]["native"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]),
                                   **FP32)
        for mine, theirs in zip(ours["states"], native["states"]):
            for name, value in theirs.items():
                torch.testing.assert_close(mine[name], value, msg=lambda m: f"{name}: {m}",
                                           **FP32)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    return run_world(tp_cases.run_cases, 4, str(tmp_path_factory.mktemp("dcp")))


def test_fsdp_over_tensor_parallel_trains_and_checkpoints_as_native(world4):
    """2 dp x 2 tp: losses, every parameter's layout and local shard, and the full values
    equal native's; each implementation's DCP checkpoint loads into the other."""
    for rank in range(4):
        result = case(world4, "train", rank)
        ours, native = result["ours"], result["native"]
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(native["losses"]),
                                   **FP32)
        assert ours["layouts"] == native["layouts"]
        assert any("_StridedShard" in placements for placements, _ in ours["layouts"].values())
        for key, value in native["local"].items():
            torch.testing.assert_close(ours["local"][key], value, msg=lambda m: f"{key}: {m}",
                                       **FP32)
        loaded = case(world4, "load_other", rank)
        for which in ("ours", "native"):
            other = "native" if which == "ours" else "ours"
            for key, value in result[other]["full"].items():
                torch.testing.assert_close(loaded[which]["full"][key], value, **FP32)
