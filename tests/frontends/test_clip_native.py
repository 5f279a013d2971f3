"""FSDP1's `clip_grad_norm_` and gradient reduction against native FSDP1, bit for bit, at world
2 on CPU/gloo (clip_native_cases.py): over four AdamW steps clipped to a small norm, in fp32 and
in bf16 mixed precision (bf16 reductions), with `use_orig_params` True and False, every step's
total norm, clipped gradients (use_orig_params=True: native gathers gradients only then) and
weights are identical to native's; at world 3 too, where FSDP1's division after each
reduction is not exact."""

from __future__ import annotations

import pytest
import torch

from tests.frontends import clip_native_cases as C
from tests.world import case_result as case
from tests.world import run_world


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2)


@pytest.fixture(scope="module")
def world3():
    """Three ranks: FSDP1 divides each reduction by 1 before and 3 after, and in bf16 the
    division after rounds to bf16 (at world 2, a division by a power of two, it is exact)."""
    return run_world(C.run_cases, 3, ["fp32_orig", "bf16_orig", "bf16_flat"])


def _same(ours, native, what):
    assert list(ours) == list(native), what
    for name, value in native.items():
        assert ours[name].dtype == value.dtype, f"{what} {name}"
        assert torch.equal(ours[name], value), (
            f"{what} {name} differs from native by {(ours[name] - value).abs().max().item()}")


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("name", ["fp32_orig", "bf16_orig", "fp32_flat", "bf16_flat"])
def test_norms_grads_and_weights_equal_native_bit_for_bit(world, name, rank):
    _same_training(case(world, name, rank))


@pytest.mark.parametrize("rank", [0, 2])
@pytest.mark.parametrize("name", ["fp32_orig", "bf16_orig", "bf16_flat"])
def test_at_world_3_too(world3, name, rank):
    _same_training(case(world3, name, rank))


def _same_training(result):
    ours, native = result["ours"], result["native"]
    for step in range(C.STEPS):
        assert ours["norms"][step].dtype == native["norms"][step].dtype
        assert torch.equal(ours["norms"][step], native["norms"][step]), (
            f"step {step}: norm {ours['norms'][step].item():.10g} vs native "
            f"{native['norms'][step].item():.10g}")
        if native["grads"]:
            _same(ours["grads"][step], native["grads"][step], f"step {step} grad")
        _same(ours["weights"][step], native["weights"][step], f"step {step} weight")
