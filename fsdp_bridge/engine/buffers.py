"""Preallocated, reused buffers for gathered parameters and full gradients.

[Note: two buffers]
Units that are resharded after forward share two gather buffers, used alternately in execution
order, and every unit shares two gradient buffers; each is sized to the largest unit. Peak
memory for gathered weights and unsharded gradients is therefore fixed (2 x the largest unit
each) and the allocator never churns on gathers. The gradient buffers exist only during
backward (see GradBuffer). A buffer remembers its owner: a unit whose data is still
in its buffer is not gathered again (the last layers of forward are the first of backward).
A buffer is never taken from an owner that is in use (between its pre- and post- hooks).
"""

from __future__ import annotations

import torch


class GatherBuffer:
    """Holds one unit's gathered (unsharded) parameters at a time."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.owner = None  # the FlatGroup whose parameters are in the buffer

    def view_for(self, numel: int) -> torch.Tensor:
        return self.tensor[:numel]


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

