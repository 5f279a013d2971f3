"""FSDP1 and FSDP2 front-ends against native torch on CPU/gloo: the same script with
`torch.distributed.fsdp` and with `fsdp_bridge.fsdp` (see parity_cases.py) gives the same per-step
losses, grad norms and final full state dict (fp32: rtol 1e-5 / atol 1e-6, and both also match
the single-process reference; bf16: torch's bf16 tolerance). Settings native torch cannot run on
a CPU-only build are compared with the single-process reference.

Three spawned worlds in all (FSDP1 world 2, FSDP2 world 2, hybrid world 4; the last also runs
the hybrid cases of accumulation_cases.py, asserted bit for bit).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests import models as M
from tests.frontends import accumulation_cases as A
from tests.frontends import parity_cases as C
from tests.native_torch import skip_native
from tests.world import case_result, run_world

FP32 = dict(rtol=1e-5, atol=1e-6)
BF16 = dict(rtol=1.6e-2, atol=1e-5)


@pytest.fixture(scope="module")
def fsdp1_world2():
    return run_world(C.run_cases, 2, "FSDP1_ALL", list(C.FSDP1_ALL))


@pytest.fixture(scope="module")
def fsdp2_world2():
    return run_world(C.run_cases, 2, "FSDP2_WORLD2", list(C.FSDP2_WORLD2))


@pytest.fixture(scope="module")
def world4():
    return run_world(C.run_world4_cases, 4, list(C.WORLD4), list(A.WORLD4))


@functools.lru_cache(maxsize=None)
def reference(model_name, micro_steps=1, clip=None):
    model = M.tiny_llama() if model_name.startswith("llama") else M.tiny_gpt2()
    batches = M.global_batches(C.STEPS, C.GLOBAL_BATCH)
    losses, norms = M.train_reference(model, batches, micro_steps=micro_steps, clip=clip)
    return {"losses": losses, "norms": norms,
            "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}}


def max_diff(a, b) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def assert_same(actual, expected, tol):
    torch.testing.assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]),
                               **tol)
    if expected["norms"] and actual["norms"]:
        torch.testing.assert_close(torch.tensor(actual["norms"]),
                                   torch.tensor(expected["norms"]), **tol)
    assert list(actual["state"]) == list(expected["state"]), "state dict keys differ"
    for key in expected["state"]:
        torch.testing.assert_close(actual["state"][key].float(), expected["state"][key].float(),
                                   msg=lambda m: f"{key}: {m}", **tol)


def _ref_kwargs(case: str):
    micro = 2 if ("no_sync" in case or "reshard_false" in case) else 1
    clip = 0.5 if ("clip" in case or case in ("fsdp1_full_transformer_orig", "fsdp2_default")) \
        else None
    if case == "fsdp1_hybrid_mesh":
        clip = 1.0
    return micro, clip


def check_case(out: dict, case: str, model: str) -> dict:
    micro, clip = _ref_kwargs(case)
    figures = {}
    if "native" in out:
        tol = BF16 if model.endswith("bf16") else FP32
        assert_same(out["ours"], out["native"], tol)
        figures["vs_native"] = max_diff(out["ours"]["state"], out["native"]["state"])
        if model.endswith("bf16"):  # bf16 really ran in low precision
            assert out["ours"]["losses"] != reference("llama")["losses"]
    if not model.endswith("bf16"):
        ref = reference(model, micro, clip)
        assert_same(out["ours"], ref, FP32)
        figures["vs_reference"] = max_diff(out["ours"]["state"], ref["state"])
    elif "native" not in out:  # bf16 really ran in low precision
        assert out["ours"]["losses"] != reference("llama")["losses"]
    skip_native(out)
    return figures


FSDP1_CASES = C.FSDP1_ALL


@pytest.mark.parametrize("case", list(FSDP1_CASES))
def test_fsdp1_matches_native(fsdp1_world2, case):
    figures = check_case(fsdp1_world2[0][case], case, FSDP1_CASES[case][1])
    print(case, figures)


@pytest.mark.parametrize("case", list(C.FSDP2_WORLD2))
def test_fsdp2_matches_native(fsdp2_world2, case):
    out = fsdp2_world2[0][case]
    ours = out["ours"]
    assert ours["is_fsdp_module"] and ours["state_dict_has_full_tensor"]
    figures = check_case(out, case, C.FSDP2_WORLD2[case][1])
    assert ours["class_name"] == out["native"]["class_name"]
    print(case, figures)


@pytest.mark.parametrize("case", list(C.WORLD4))
def test_world4_hybrid(world4, case):
    for rank in (1, 2, 3):  # replicas agree
        for key, value in world4[0][case]["ours"]["state"].items():
            assert torch.equal(world4[rank][case]["ours"]["state"][key], value), key
    figures = check_case(world4[0][case], case, C.WORLD4[case][1])
    print(case, figures)


@pytest.mark.parametrize("case", list(A.WORLD4))
def test_world4_hybrid_accumulation_matches_native_bit_for_bit(world4, case):
    for rank in range(4):
        problems = A.differences(case, case_result(world4, case, rank))
        assert not problems, "\n".join(problems)
