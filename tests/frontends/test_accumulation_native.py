"""Gradient accumulation matches native torch bit for bit (accumulation_cases.py): per-step
losses, grad norms and every value of the final full state dict are equal, for each front-end
against its native reference, over param / reduce dtypes, 1 to 4 micro-steps, sharding
strategies and CPU offload, in one spawned world of two ranks. (The hybrid cases run in
test_parity_native.py's world of four.)"""

from __future__ import annotations

import pytest

from tests.frontends import accumulation_cases as C
from tests.world import case_result, run_world


@pytest.fixture(scope="module")
def world():
    return run_world(C.run_cases, 2, list(C.WORLD2))


@pytest.mark.parametrize("case", list(C.WORLD2))
def test_accumulation_matches_native_bit_for_bit(world, case):
    for rank in (0, 1):
        problems = C.differences(case, case_result(world, case, rank))
        assert not problems, "\n".join(problems)
