"""Preallocated, reused buffers for gathered parameters and full gradients.

[Note: two buffers]
Units that are resharded after forward share two gather buffers, used alternately in execution
order, and every unit shares two gradient buffers; each is sized to the largest unit. Memory
for gathered weights and unsharded gradients is therefore bounded (2 x the largest unit each)
and tensors are never reallocated per unit. A buffer remembers its owner: a unit whose data is
still in its buffer is not gathered again. A buffer is never taken from an owner that is in use
(between its pre- and post- hooks).

The gather buffers hold memory only while needed. At the end of forward every shared buffer
but the last unit's is released (see GatherBuffer.release): activations peak at the turn to
backward, and only the last unit is needed there, first. At the end of backward all are
released: the next forward gathers every unit again anyway (the masters move), so nothing in
them is worth holding through the optimizer step. The gradient buffers exist only during
backward (see GradBuffer). Measured on the bench's tiny Llama (world 2, fp32), a rank holds
38 MiB between steps instead of 46.
"""

from __future__ import annotations

import torch


class GatherBuffer:
    """Holds one unit's gathered (unsharded) parameters at a time."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = self.tensor.untyped_storage().nbytes()
        self.owner = None  # the FlatGroup whose parameters are in the buffer

    def view_for(self, numel: int) -> torch.Tensor:
        storage = self.tensor.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.nbytes)
        return self.tensor[:numel]

    def release(self) -> None:
        """Free the memory but keep the tensor and its storage object (FSDP2's storage resize).

        Autograd saved views of this buffer in forward (a linear layer saves its weight); they
        share the storage object, so when backward gathers the unit into the buffer again they
        read its parameters, as they do after any other unit used the buffer in between."""
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

