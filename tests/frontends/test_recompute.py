"""Activation checkpointing (Hugging Face's, torch's checkpoint wrapper, torch.utils.checkpoint;
reentrant and not; applied before or after wrapping) and two forwards before one backward,
through FSDP2, FSDP1 and YaFSDP (world 2, one spawned world, see recompute_cases.py).

FSDP2 is compared with native `fully_shard` on the same run (bit-identical: the math is the
same); FSDP1 and YaFSDP with the single-process reference on the global batch within fp32
tolerance (rtol 1e-5, atol 1e-6): native FSDP1 needs an accelerator on this CPU-only build.
"""

from __future__ import annotations

import pytest
import torch

from tests.frontends import recompute_cases as C
from tests.world import case_result as case
from tests.world import run_world

FP32 = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


@pytest.mark.parametrize("name", [
    "fsdp2_hf_reentrant_before", "fsdp2_hf_reentrant_after", "fsdp2_hf_plain_before",
    "fsdp2_hf_plain_after", "fsdp2_apply_before", "fsdp2_checkpoint_in_forward"])
def test_fsdp2_checkpointing_matches_native(world, name):
    result = case(world, name)
    assert result["ours"] == result["native"]


@pytest.mark.parametrize("name", ["fsdp1_hf_reentrant", "fsdp1_hf_plain", "fsdp1_apply_linear",
                                  "yafsdp_hf_reentrant", "yafsdp_hf_plain"])
def test_fsdp1_and_yafsdp_checkpointing_match_the_reference(world, name):
    torch.testing.assert_close(torch.tensor(case(world, name)),
                               torch.tensor(case(world, "reference")), **FP32)


def test_two_forwards_then_one_backward(world):
    torch.testing.assert_close(torch.tensor(case(world, "two_forwards_one_backward")),
                               torch.tensor(case(world, "reference_halves")), **FP32)


def test_checkpointing_lowers_peak_memory(world):
    for rank in (0, 1):
        peak = case(world, "peak_memory", rank)
        assert 0 < peak["checkpointed"] < peak["plain"], peak


def test_torch_compile_of_a_sharded_model_trains_like_native(world):
    result = case(world, "fsdp2_compiled")
    torch.testing.assert_close(torch.tensor(result["ours"]), torch.tensor(result["native"]),
                               **FP32)
    torch.testing.assert_close(torch.tensor(result["ours"]),
                               torch.tensor(case(world, "reference")), **FP32)
