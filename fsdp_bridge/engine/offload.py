"""Reduced gradient shards on their way to host memory under CPU offload (see [Note: CPU
offload] in flat_group.py).

[Note: gradients to the host without blocking]
On CUDA a reduced shard is cast to the master's dtype on the device (a cross-dtype copy
between devices would be cast on the CPU, through a pageable temporary), then copied into
pinned host memory with `non_blocking=True` on a stream of its own, so neither the host nor
the compute stream waits for the copy. The copies land together at the end of backward with
one synchronize, before any host code (the gradient accumulation, the optimizer step) reads
them, as FSDP2's CPUOffloadPolicy does. Elsewhere (the CPU, or a master on the device) a
shard joins its gradient at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from fsdp_bridge.engine.device import has_streams

if TYPE_CHECKING:
    from fsdp_bridge.engine.flat_group import FlatGroup


class GradOffload:
    """Queues reduced shards' copies to the host and lands them at the end of backward."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = None  # made on first use: offload only
        self.in_flight: list[tuple["FlatGroup", torch.Tensor]] = []

    def accumulate(self, group: "FlatGroup", reduced: torch.Tensor) -> None:
        """Add `reduced` into `group`'s gradient: now, or once its copy to the host landed."""
        if (not has_streams(self.device) or group.master.device.type != "cpu"
                or reduced.device.type != "cuda"):
            group.accumulate(reduced)
            return
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        on_device = reduced.to(group.master.dtype)  # no copy when the dtypes agree
        host = torch.empty(reduced.shape, dtype=group.master.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(reduced.device))
        with torch.cuda.stream(self.stream):
            host.copy_(on_device, non_blocking=True)
        # The compute stream may reuse the shard's memory only once the copy has read it.
        on_device.record_stream(self.stream)
        self.in_flight.append((group, host))

    def land(self) -> None:
        """Wait once for every copy queued, then add each shard into its group's gradient
        (in the order they were queued)."""
        if not self.in_flight:
            return
        assert self.stream is not None
        self.stream.synchronize()
        for group, host in self.in_flight:
            group.accumulate(host)
        self.in_flight.clear()
