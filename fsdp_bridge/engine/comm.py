"""The engine's collectives: which groups, and how each call is made.

[Note: version counters]
gloo's in-place collectives bump the autograd version counter of their output. The gathered
parameter buffers are saved for backward (as views), so every collective and copy into them goes
through `tensor.data`, an alias with a version counter of its own: the bytes change, the
autograd bookkeeping of the compute views does not.

[Note: async work]
All gathers and reductions are issued with `async_op=True` and waited on when their result is
needed. On gloo the work runs on the process group's threads, overlapping compute on the main
thread; on NCCL it runs on NCCL's own CUDA stream and `wait()` makes the compute stream wait.

[Note: pairs swap halves]
On gloo, a shard group of two ranks gathers and reduce-scatters with one `all_to_all_single`
each: a rank sends the other the half it needs, which lands straight in place (for a
reduce-scatter, in the output, to which the rank then adds its own half). gloo's all-gather
receives into a full-size temporary and copies it out, and its reduce-scatter is an all-reduce
(see [Note: gloo reduce-scatter]), which sends twice the bytes. Measured on 2 CPU cores with 4 MiB
halves, a swap took about 60 % of the CPU time of gloo's all-gather and 45 % of its all-reduce.
Larger groups keep gloo's collectives: what one rank sends there is not one contiguous range.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fsdp_bridge.engine.device import backends_of


@dataclasses.dataclass
class CollectiveStats:
    """Calls and bytes per collective kind since the last reset (for benchmarks)."""

    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    bytes: dict[str, int] = dataclasses.field(default_factory=dict)

    def record(self, kind: str, tensor: torch.Tensor, parts: int = 1) -> None:
        """One call moving `tensor`, or `parts` tensors of its size (the full tensor of a
        collective given one rank's part of it)."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        size = tensor.numel() * tensor.element_size() * parts
        self.bytes[kind] = self.bytes.get(kind, 0) + size

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class Comm:
    """The shard group (parameters are split over it) and the replicate group (gradients are
    all-reduced over it). Either may be None, meaning a group of one."""

    def __init__(
        self,
        shard_group: Optional[dist.ProcessGroup],
        replicate_group: Optional[dist.ProcessGroup],
        world_group: Optional[dist.ProcessGroup],
        device_type: str = "cpu",
    ):
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.world_group = world_group  # every rank taking part (fingerprint, broadcast)
        self.shard_size = dist.get_world_size(shard_group) if shard_group is not None else 1
        self.shard_rank = dist.get_rank(shard_group) if shard_group is not None else 0
        self.replicate_size = (
            dist.get_world_size(replicate_group) if replicate_group is not None else 1
        )
        self.stats = CollectiveStats()
        # [Note: gloo reduce-scatter] (groups of more than two) gloo's reduce_scatter_tensor
        # clones its whole input, all-reduces the clone and copies this rank's chunk out when
        # waited on (ProcessGroupGloo::reduce_scatter_tensor_coalesced). All-reducing the full
        # gradient buffer, which the engine owns and reuses anyway, in place moves the same
        # bytes without the clone, its full-size scratch memory, and the copy.
        # The backend that carries tensors of the engine's device type (a group may hold
        # one per device type: see [Note: device from the backend config]).
        on_gloo = (shard_group is not None
                   and backends_of(shard_group).get(device_type) == "gloo")
        # See [Note: pairs swap halves].
        self.swaps_halves = on_gloo and self.shard_size == 2
        self.reduce_scatter_in_place = on_gloo and not self.swaps_halves
        # [Note: gloo gather input] a gloo work object keeps its input alive until the work
        # is destroyed. Holding the work's future instead of the work lets gloo free the
        # input (under mixed precision, a cast copy of the shard) as soon as the gather
        # finishes, not when the engine waits, one unit later for a prefetch. (Measured: a
        # finished 32 MiB gather still held its input through the work, not through the
        # future.)
        self.wait_on_futures = on_gloo

    @property
    def world_rank(self) -> int:
        """This rank's index among every rank taking part (0 without a process group)."""
        return dist.get_rank(self.world_group) if self.world_group is not None else 0

    @property
    def data_parallel_size(self) -> int:
        """How many ranks contribute gradients: what the gradient sum is divided by."""
        return self.shard_size * self.replicate_size

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor):
        """Gather `shard` from every shard-group rank into `output`; returns a work handle."""
        if self.shard_size == 1:
            if output.data_ptr() != shard.data_ptr():  # else written in place already
                output.data.copy_(shard)
            return None
        self.stats.record("all_gather", output)
        if self.swaps_halves:
            mine, theirs = self._halves(output.data)
            if mine.data_ptr() != shard.data_ptr():
                mine.copy_(shard)
            return self._swap(send=mine, receive=theirs)
        work = dist.all_gather_into_tensor(
            output.data, shard, group=self.shard_group, async_op=True
        )
        return work.get_future() if self.wait_on_futures else work

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor):
        """Sum `full` over the shard group, keeping this rank's part in `output`."""
        if self.swaps_halves:
            mine, theirs = self._halves(full.data)
            return self.reduce_pair(theirs, output, lambda: output.data.add_(mine))
        self.stats.record("reduce_scatter", full)
        return dist.reduce_scatter_tensor(
            output.data, full.data, op=dist.ReduceOp.SUM, group=self.shard_group, async_op=True
        )

    def reduce_pair(self, theirs: torch.Tensor, output: torch.Tensor,
                    add_own: Callable[[], object]):
        """A pair's reduce-scatter (see [Note: pairs swap halves]): send `theirs`, this rank's
        contribution to the other rank's part, receive the other rank's contribution to this
        rank's part into `output`, then call `add_own` to add this rank's own contribution
        (on gloo's thread). Returns a future."""
        self.stats.record("reduce_scatter", theirs, parts=self.shard_size)
        swap = self._swap(send=theirs.data, receive=output.data)
        if output.device.type == "cpu":
            return swap.then(lambda _: add_own())
        return AfterWait(swap, add_own)

    def reduce_scatter_in_buffer(self, full: torch.Tensor):
        """Sum `full` in place over the shard group (gloo: see [Note: gloo reduce-scatter]);
        the caller keeps its own slice of it. Returns a future."""
        self.stats.record("all_reduce", full)
        return dist.all_reduce(
            full.data, op=dist.ReduceOp.SUM, group=self.shard_group, async_op=True
        ).get_future()

    def _halves(self, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's half, the other rank's half) of a pair's full tensor."""
        first, second = full.chunk(2)
        return (first, second) if self.shard_rank == 0 else (second, first)

    def _swap(self, send: torch.Tensor, receive: torch.Tensor):
        """Send `send` to the other rank of the pair while receiving its tensor of the same size
        into `receive`; returns a future."""
        sizes = [0, 0]
        sizes[1 - self.shard_rank] = send.numel()
        work = dist.all_to_all_single(receive, send, output_split_sizes=sizes,
                                      input_split_sizes=sizes, group=self.shard_group,
                                      async_op=True)
        return work.get_future()

    def all_reduce_replicas(self, tensor: torch.Tensor, async_op: bool = True):
        """Sum `tensor` over the replicate group (a no-op for a group of one)."""
        if self.replicate_size == 1:
            return None
        self.stats.record("all_reduce", tensor)
        return dist.all_reduce(
            tensor.data, op=dist.ReduceOp.SUM, group=self.replicate_group, async_op=async_op
        )

    def all_reduce_replicas_after(self, work, tensor: torch.Tensor, stream):
        """Sum `tensor` over the replicate group once `work` (the reduce-scatter writing it)
        is done, without holding up the compute stream: the wait and the all-reduce are issued
        from the CUDA `stream`, so only that stream waits for the reduce-scatter, and the
        compute stream waits only when the returned work is waited on (as FSDP2 runs HSDP's
        all-reduce on a stream of its own). NCCL only: there `work.wait()` makes the current
        stream wait for the reduce-scatter; a gloo future's does not."""
        with torch.cuda.stream(stream):
            work.wait()
            return self.all_reduce_replicas(tensor, async_op=True)

    def all_reduce_shards(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        """Combine per-shard partial results (e.g. squared norms) over the shard group."""
        if self.shard_size > 1:
            self.stats.record("all_reduce", tensor)
            dist.all_reduce(tensor, op=op, group=self.shard_group)

    def any_rank(self, flags: torch.Tensor) -> None:
        """Turn 0/1 `flags` into whether any rank set each one (MAX over every rank), in
        place."""
        group = self.world_group
        if group is not None and dist.get_world_size(group) > 1:
            self.stats.record("all_reduce", flags)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)

    def broadcast_from_first(self, tensor: torch.Tensor) -> None:
        """Overwrite `tensor` on every rank with the first rank's copy (sync_module_states)."""
        group = self.world_group
        if group is None or dist.get_world_size(group) == 1:
            return
        self.stats.record("broadcast", tensor)
        dist.broadcast(tensor.data, src=dist.get_global_rank(group, 0), group=group)


class AfterWait:
    """A reduction's handle whose `wait()` waits for `future`, then calls `then` on the waiting
    thread. [Note: no tensor work in gloo's callbacks on CUDA] A callback chained on a gloo
    future of CUDA tensors runs on a stream of its own, beside compute, on tensors that the
    caching allocator does not know are in use there: memory the main thread frees (autograd's
    gradients, a reduced shard) can be handed out again and overwritten before the callback's
    kernels have read it. Called on the waiting thread, `then` queues on the current stream,
    after the wait. (Found on an H100: losses drifted by 1e-3 unless CUDA_LAUNCH_BLOCKING=1.)"""

    def __init__(self, future, then: Callable[[], object]):
        self.future: Optional[Any] = future
        self.then = then

    def wait(self) -> None:
        if self.future is not None:
            self.future.wait()
            self.future = None
            self.then()
