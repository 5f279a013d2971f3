"""What the installed torch's own FSDP2 can run on the test device, for the tests that compare
ours with it.

Older torch releases cannot run some native runs the tests compare against (torch 2.6's FSDP2
does not run on the CPU at all). Where native cannot run, a rank case runs our side alone and
says why (`unavailable` in its result), the test still checks our side against what it can
(the single-process reference), then skips the native comparison with that reason, which names
the torch version and the missing feature.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from tests.world import device_type

UNSET = object()


def fsdp2_unavailable(reshard_after_forward=UNSET) -> Optional[str]:
    """Why torch's `fully_shard` cannot run here (with this `reshard_after_forward`), or None."""
    if device_type() == "cpu" and not hasattr(torch.cpu.Stream, "record_event"):
        return (f"torch {torch.__version__}'s native FSDP2 cannot run on the CPU: its "
                "collectives call torch.cpu.Stream.record_event, which this torch lacks")
    if reshard_after_forward is None and _refuses_none_reshard():
        return (f"torch {torch.__version__}'s fully_shard refuses reshard_after_forward=None "
                "(newer torch takes None as its default)")
    return None


def _refuses_none_reshard() -> bool:
    from torch.distributed.fsdp import fully_shard

    default = inspect.signature(fully_shard).parameters["reshard_after_forward"].default
    return default is not None


def skip_native(result: dict) -> None:
    """Skip the rest of a test whose rank case could not run native (its `unavailable`)."""
    skip_if(result.get("unavailable"))


def fsdp2_case(run):
    """A rank case comparing ours with torch's FSDP2: where torch's FSDP2 cannot run here, it
    returns {"unavailable": why} without running (`case_result` then skips the test, naming
    why)."""
    def guarded(rank, world):
        why = fsdp2_unavailable()
        return {"unavailable": why} if why else run(rank, world)
    return guarded


def fsdp2_lacks_method(name: str) -> Optional[str]:
    """Why torch's FSDPModule cannot be compared on method `name` (it has none), or None."""
    from torch.distributed.fsdp import FSDPModule

    if hasattr(FSDPModule, name):
        return None
    return f"torch {torch.__version__}'s FSDPModule has no {name} (torch 2.13 has it)"


def fsdp2_keeps_ties_across_calls() -> Optional[str]:
    """Why torch's fully_shard cannot be compared on a parameter tied across two calls, or None:
    before 2.12 it does not refuse one."""
    if torch.torch_version.TorchVersion(torch.__version__) >= "2.12":
        return None
    return (f"torch {torch.__version__}'s fully_shard does not refuse a parameter tied across "
            "two fully_shard calls (torch 2.12 added the check)")


def skip_if(why: Optional[str]) -> None:
    import pytest

    if why:
        pytest.skip(f"native comparison not run: {why}")
