"""Buffers for gathered parameters (one per group, memory only while gathered) and full
gradients (two, reused).

[Note: gather buffers]
Every flat group gathers into a buffer of its own, one tensor whose storage holds memory only
while the group is gathered (FSDP2's storage resize). Autograd saves views of the gathered
parameters in forward (a linear layer saves its weight); they share that storage object, so
when backward gathers the group again into the same storage they read its parameters. A
storage object per group is what makes any order right: units used twice in one forward, a
backward that visits units out of forward order (an encoder-decoder), nested units; buffers
shared between groups would make two of them need one storage at once.

Memory follows the schedule instead: a unit that reshards after forward frees its weights at
its post-forward hook (except the last one, which backward starts with) and again once its
backward has run; every such buffer is freed at the end of backward, since the next forward
gathers again anyway (the masters move). So at most the running unit and the one being
prefetched hold gathered weights, in forward and in backward. Units that stay gathered (the
root, ZeRO-2, units with units inside them, frozen groups) hold theirs from construction. The
gradient buffers exist only during backward (see GradBuffer).
"""

from __future__ import annotations

import torch


class GatherBuffer:
    """Holds one group's gathered (unsharded) parameters."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = self.tensor.untyped_storage().nbytes()
        self.owner = None  # the FlatGroup whose parameters are in the buffer

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


class GradBuffer:
    """Holds one unit's full gradient, in the reduce dtype, while it is being reduced.

    Allocated at its first use in a backward and released at the end of that backward: kept,
    it would sit idle through forward, where activations peak. (CUDA's caching allocator
    hands the same block back next time; on CPU the cost is a fresh allocation per backward.)
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.tensor = None
        self.pending = None  # the reduction still reading this buffer, if any

    def view_for(self, numel: int) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self.tensor[:numel]


class GradBufferPool:
    """Two gradient buffers, used alternately; a buffer is handed out only once the
    reduction still reading it has finished."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device, count: int = 2):
        self.buffers = [GradBuffer(numel, dtype, device) for _ in range(count)]
        self._next = 0

    def acquire(self, finish_pending) -> GradBuffer:
        buffer = self.buffers[self._next]
        self._next = (self._next + 1) % len(self.buffers)
        if buffer.pending is not None:
            finish_pending(buffer.pending)
        return buffer

    def release(self) -> None:
        """End of backward: every reduction has finished; free the memory until the next."""
        for buffer in self.buffers:
            assert buffer.pending is None, "a reduction still reads this gradient buffer"
            buffer.tensor = None

