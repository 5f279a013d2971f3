"""What the engine does differently per device: which CUDA device is current, whether the
device has streams, and when backward prefetches the next unit's gather.

[Note: backward prefetch per device]
On gloo (CPU) a collective runs on the process group's thread as soon as it is issued. The
schedule that measured best there starts the gather of the next unit backward needs in the
post-backward of the unit before it (POST_BACKWARD): that unit's weights are freed first, and
a gather in flight (which on gloo holds a full-size output of its own) never sits beside the
heaviest part of a backward.

On NCCL an `async_op=True` collective runs on NCCL's stream, which waits for the compute stream
as it stood when the collective was issued. Issued in a unit's post-backward, the next gather
starts only after every backward kernel of that unit, and the next unit's backward then waits
for it: each gather after the first sits on the critical path. Issued in the unit's
pre-backward (PRE_BACKWARD), before its backward kernels are queued, it runs beside them, as
FSDP2 and YaFSDP prefetch.
"""

from __future__ import annotations

import enum

import torch


class BackwardPrefetch(enum.Enum):
    """Where backward starts gathering the next unit it needs."""

    # In the post-backward of the unit before it, once that unit's weights are freed.
    POST_BACKWARD = "post_backward"
    # In the pre-backward of the unit before it, before that unit's backward is queued (the
    # post-backward still starts any gather the pre-backward could not).
    PRE_BACKWARD = "pre_backward"


def default_backward_prefetch(device: torch.device) -> BackwardPrefetch:
    """The schedule for `device` (see [Note: backward prefetch per device])."""
    return BackwardPrefetch.POST_BACKWARD if device.type == "cpu" else BackwardPrefetch.PRE_BACKWARD


def has_streams(device: torch.device) -> bool:
    """Whether work on `device` is queued on streams that can run beside each other."""
    return device.type == "cuda"


def select_device(device: torch.device) -> None:
    """Make a CUDA `device` the current one, as torch's FSDP expects of a training process:
    NCCL runs its collectives on the current device, and ranks whose shards live on another
    device than the current one would all talk through `cuda:0` (a duplicate-GPU error or a
    hang). Nothing to do on other devices."""
    if device.type == "cuda" and device.index is not None:
        if torch.cuda.current_device() != device.index:
            torch.cuda.set_device(device)
