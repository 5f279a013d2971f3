"""Mixing sharding dialects in one model (inner blocks wrapped by one, the root by another), every
ordered pair in one CPU/gloo world of two ranks (mixed_dialects_cases.py). Each pair either
trains as the all-native equivalent does (losses and final weights) or is refused on every rank
with one message naming both wrappers:

- our front-end outside: refused at the wrap, before any collective, the same error on every rank;
- torch's FSDP1 outside any of ours: it leaves our parameters alone (they carry its mark of
  flattened parameters), and our first forward refuses, on every rank, finding torch's FSDP1
  forward around it;
- torch's fully_shard outside our flat-layout wrappers (FullyShardedDataParallel, YaFSDP, Zeta,
  TorchAcc): refused by our wrapper at the first forward, on every rank, by the parameters
  torch's wrapper put in place of ours;
- torch's fully_shard outside our fully_shard: torch's own wrap raises on every rank (its
  message: we cannot word it without patching torch).

No case may leave a rank waiting: the world runs with a short process-group timeout, so a rank
stuck in a collective fails its case instead of hanging the suite.
"""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_bridge.harness.world import RankSetup, WorldFailed, spawn
from tests.frontends import mixed_dialects_cases as C
from tests.world import case_result

# Long enough for a loaded machine, short enough that a hung case fails instead of stalling.
GROUP_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def world():
    try:
        return spawn(C.run_cases, 2, (), RankSetup(backend="gloo",
                                                   group_timeout_s=GROUP_TIMEOUT_S))
    except WorldFailed as failed:
        raise AssertionError("distributed run failed:\n" + "\n".join(failed.errors)) from None


def both(world, name: str) -> list[dict]:
    return [case_result(world, name, rank) for rank in (0, 1)]


TRAINS = {  # pair -> the all-native pair it trains like
    (C.OURS_FSDP1, C.OURS_FSDP1): (C.TORCH_FSDP1, C.TORCH_FSDP1),
    (C.OURS_FULLY_SHARD, C.OURS_FULLY_SHARD): (C.TORCH_FULLY_SHARD, C.TORCH_FULLY_SHARD),
}
OURS_OUTSIDE = [(inner, outer) for outer in C.OURS for inner in C.DIALECTS
                if (inner, outer) not in TRAINS]
# torch's FSDP1 around any of ours, and torch's fully_shard around our flat-layout wrappers.
TORCH_OUTSIDE_FLAT = [(inner, outer) for outer in C.TORCH for inner in C.OURS
                      if inner != C.OURS_FULLY_SHARD or outer == C.TORCH_FSDP1]
TORCH_OUTSIDE_FULLY_SHARD = [(C.OURS_FULLY_SHARD, C.TORCH_FULLY_SHARD)]


def _ids(pairs):
    return [C.case_name(*pair) for pair in pairs]


def test_every_pair_is_in_the_table_and_ran_on_both_ranks(world):
    ours_pairs = set(TRAINS) | set(OURS_OUTSIDE) | set(TORCH_OUTSIDE_FLAT) \
        | set(TORCH_OUTSIDE_FULLY_SHARD)
    every = {(inner, outer) for inner in C.DIALECTS for outer in C.DIALECTS}
    assert every - ours_pairs == {(i, o) for i in C.TORCH for o in C.TORCH}  # torch alone
    for inner, outer in every:
        for rank in (0, 1):
            assert C.case_name(inner, outer) in world[rank]


@pytest.mark.parametrize("pair", list(TRAINS), ids=_ids(TRAINS))
def test_nesting_within_our_dialect_trains_as_native(world, pair):
    native = both(world, C.case_name(*TRAINS[pair]))
    ours = both(world, C.case_name(*pair))
    for rank in (0, 1):
        assert native[rank]["phase"] == "trained", native[rank]
        assert ours[rank]["phase"] == "trained", ours[rank]
        torch.testing.assert_close(ours[rank]["losses"], native[rank]["losses"], rtol=0,
                                   atol=1e-6)
        assert list(ours[rank]["weights"]) == list(native[rank]["weights"])
        for name, value in native[rank]["weights"].items():
            torch.testing.assert_close(ours[rank]["weights"][name], value, rtol=0, atol=1e-6)


@pytest.mark.parametrize("pair", OURS_OUTSIDE, ids=_ids(OURS_OUTSIDE))
def test_our_wrapper_outside_another_is_refused_at_wrap_on_every_rank(world, pair):
    inner, outer = pair
    results = both(world, C.case_name(inner, outer))
    for result in results:
        assert result["phase"] == "wrap", result
        assert result["type"] == "ValueError", result
        assert result["message"].startswith(f"{outer}: module="), result["message"]
        assert f"is wrapped by {inner}" in result["message"], result["message"]
        if inner == outer:  # a front-end that wraps a whole model once
            assert f"Call {outer} once" in result["message"]
        else:
            assert f"Use {outer} for every layer" in result["message"]
            assert f"or {inner} for every layer" in result["message"]
    assert results[0]["message"] == results[1]["message"], "the same error on every rank"


@pytest.mark.parametrize("pair", TORCH_OUTSIDE_FLAT, ids=_ids(TORCH_OUTSIDE_FLAT))
def test_torch_outside_our_flat_wrapper_is_refused_at_first_forward_on_every_rank(world, pair):
    inner, outer = pair
    for result in both(world, C.case_name(inner, outer)):
        assert result["phase"] == "forward", result
        assert result["type"] == "RuntimeError", result
        expected = "the Block it shards runs inside" if outer == C.TORCH_FSDP1 else "parameter"
        if inner == C.OURS_FULLY_SHARD:
            expected = "the FSDPBlock it shards runs inside"
        assert result["message"].startswith(f"{inner}: {expected} "), result["message"]
        assert f"use {inner} for every layer" in result["message"], result["message"]
        assert f"or {outer} for every layer" in result["message"], result["message"]


def test_torch_fsdp1_with_orig_params_outside_ours_is_refused_at_first_forward(world):
    for result in both(world, "use_orig_params=True"):
        assert result["phase"] == "forward", result
        assert C.OURS_FSDP1 in result["message"] and C.TORCH_FSDP1 in result["message"]


def test_torch_fully_shard_outside_shards_of_unequal_sizes_is_refused_at_first_forward(world):
    """Blocks whose flat shards differ in size between ranks: torch's fully_shard gathers them
    before our forward starts, and no rank is left waiting (it aborted a rank before)."""
    for result in both(world, "odd-sized blocks in fully_shard"):
        assert result["phase"] == "forward", result
        message = result["message"]
        assert C.OURS_FSDP1 in message and C.TORCH_FULLY_SHARD in message, message


ODD_IN_TORCH_FSDP1 = [(inner, orig) for inner in C.FLAT_LAYOUT + (C.OURS_FULLY_SHARD,)
                      for orig in (False, True, "policy")]


@pytest.mark.parametrize("inner, use_orig_params", ODD_IN_TORCH_FSDP1)
def test_torch_fsdp1_outside_shards_of_unequal_sizes_is_refused_at_first_forward(
        world, inner, use_orig_params):
    """Blocks of 63 elements at world 2, so our pieces differ in size between the ranks: torch's
    FSDP1 leaves them alone (they carry its mark of flattened parameters), its gathers complete,
    and our first forward refuses on every rank; also when torch's auto-wrap policy wraps the
    blocks inside ours ("policy"). Before, torch's first all-gather met pieces
    of other sizes and aborted a rank (flat layout), or its wrap raised torch's "got mixed
    torch.Tensor and DTensor" (fully_shard)."""
    name = (C.auto_wrapped_in_torch_fsdp1(inner) if use_orig_params == "policy"
            else C.odd_in_torch_fsdp1(inner, use_orig_params))
    results = both(world, name)
    for result in results:
        assert result["phase"] == "forward", result
        message = result["message"]
        block = "FSDPOddBlock" if inner == C.OURS_FULLY_SHARD else "OddBlock"
        assert message.startswith(f"{inner}: the {block} it shards runs inside "
                                  f"{C.TORCH_FSDP1}"), message
        assert f"use {inner} for every layer" in message, message
    assert results[0]["message"] == results[1]["message"], "the same error on every rank"


@pytest.mark.parametrize("pair", TORCH_OUTSIDE_FULLY_SHARD, ids=_ids(TORCH_OUTSIDE_FULLY_SHARD))
def test_torch_outside_our_fully_shard_fails_in_torchs_wrap_on_every_rank(world, pair):
    """torch's fully_shard meets our DTensor parameters and raises its own error before any
    collective (it takes them for tensor-parallel ones): every rank stops there (none waits),
    with torch's message."""
    for result in both(world, C.case_name(*pair)):
        assert result["phase"] == "wrap", result
        assert result["type"] in ("RuntimeError", "TypeError"), result


def test_a_forward_inside_summon_full_params_is_not_a_takeover(world):
    for result in both(world, "forward_inside_summon"):
        assert result["equal"], "the summoned forward computes what the sharded one does"


def test_a_parameter_assigned_after_wrapping_is_refused_at_forward(world):
    for result in both(world, "parameter_assigned_after_wrap"):
        assert result["phase"] == "forward", result
        assert result["type"] == "RuntimeError", result
        assert "parameter 'head.weight' of the Net" in result["message"], result["message"]
        assert "assigning a new parameter after wrapping" in result["message"]


def test_a_torch_wrapper_added_after_fully_shard_is_refused_at_first_forward(world):
    results = both(world, "wrapper_added_after_fully_shard")
    for result in results:
        assert result["phase"] == "forward", result
        assert result["type"] == "ValueError", result
        assert result["message"].startswith(f"{C.OURS_FULLY_SHARD}: module="), result
        assert f"is wrapped by {C.TORCH_FSDP1}" in result["message"], result["message"]
    assert results[0]["message"] == results[1]["message"]


def test_our_inner_wrapper_applied_after_another_dialects_root_is_refused_at_wrap(world):
    results = both(world, "inner_wrapped_after_outer")
    for result in results:
        assert result["phase"] == "wrap", result
        message = result["message"]
        assert message.startswith(f"{C.OURS_FULLY_SHARD}: module=a module inside the Net that "
                                  f"{C.OURS_FSDP1} already shards"), message
        assert f"or {C.OURS_FSDP1} for every layer" in message, message
    assert results[0]["message"] == results[1]["message"]


COMPILED_CASES = [C.compiled_name(C.case_name(*pair), how)
                  for how in C.COMPILED for pair in C.COMPILED_PAIRS]


@pytest.mark.parametrize("name", COMPILED_CASES)
def test_a_pair_under_torch_compile_is_refused_at_first_forward_on_every_rank(world, name):
    """torch.compile (the whole model, or each block in place) runs the same refusal as an
    eager forward, on every rank, before any optimizer step: the check runs outside the
    compiled graph. Before, torch's fully_shard around our FSDP1 trained on other values, and
    torch's FSDP1 around it gave a wrong clip_grad_norm_."""
    inner = name.split(" in ")[0]
    results = both(world, name)
    for result in results:
        assert result["phase"] == "forward", result
        assert result["type"] == "RuntimeError", result
        assert result["message"].startswith(f"{inner}: "), result["message"]
        assert f"use {inner} for every layer" in result["message"], result["message"]
    # The same error on every rank (torch's shards in place of ours may differ in shape).
    messages = [re.sub(r"of shape \(.*?\)", "of shape ...", r["message"]) for r in results]
    assert messages[0] == messages[1], messages


@pytest.mark.parametrize("how", C.COMPILED)
def test_a_parameter_assigned_after_wrapping_is_refused_under_torch_compile(world, how):
    results = both(world, C.compiled_name("parameter_assigned_after_wrap", how))
    for result in results:
        assert result["phase"] == "forward", result
        assert "parameter 'head.weight' of the Net" in result["message"], result["message"]
    assert results[0]["message"] == results[1]["message"]


@pytest.mark.parametrize("how", C.COMPILED)
def test_a_torch_wrapper_added_after_fully_shard_is_refused_under_torch_compile(world, how):
    results = both(world, C.compiled_name("wrapper_added_after_fully_shard", how))
    for result in results:
        assert result["phase"] == "forward", result
        assert result["type"] == "ValueError", result
        assert f"is wrapped by {C.TORCH_FSDP1}" in result["message"], result["message"]
    assert results[0]["message"] == results[1]["message"]
