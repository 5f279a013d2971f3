"""Buffers for gathered parameters: one per group, holding memory only while gathered.

[Note: gather buffers]
Every flat group gathers into a buffer of its own, one tensor whose storage holds memory only
while the group is gathered (FSDP2's storage resize). Autograd saves views of the gathered
parameters in forward (a linear layer saves its weight); they share that storage object, so
when backward gathers the group again into the same storage they read its parameters. A
storage object per group is what makes any order right: units used twice in one forward, a
backward that visits units out of forward order (an encoder-decoder), nested units; buffers
shared between groups would make two of them need one storage at once.

Memory follows the schedule instead: a unit that reshards after forward frees its weights at
its post-forward hook and again once its backward has run. So at most the running unit and
the one being prefetched hold gathered weights, in forward and in backward. Units that stay
gathered through a step (the root, ZeRO-2, units with units inside them, frozen groups) hold
theirs from their first gather. Every buffer
is freed at the end of backward, since the next forward gathers again anyway (the masters
move): between steps a rank holds only shards, as with FSDP2.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class GatherBuffer:
    """Holds one group's gathered (unsharded) parameters."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = self.tensor.untyped_storage().nbytes()
        self.owner: Optional[Any] = None  # the FlatGroup whose parameters are in the buffer

    @property
    def holds_memory(self) -> bool:
        return self.tensor.untyped_storage().nbytes() > 0

    def view_for(self, numel: int) -> torch.Tensor:
        storage = self.tensor.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.nbytes)
        return self.tensor[:numel]

    def release(self) -> None:
        """Free the memory but keep the tensor and its storage object (see [Note: gather
        buffers])."""
        if self.owner is not None:
            self.owner.invalidate()  # waits: never free memory a gather is writing into
        self.tensor.untyped_storage().resize_(0)
