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
import torch.distributed as dist


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


# [Note: device from the backend config] A process group's backend name alone does not say
# which devices it talks on: `init_process_group()` with no backend names itself "undefined",
# a mixed one "cpu:gloo,cuda:nccl". Its backend config maps each device type to the backend
# that serves it ("cuda:nccl", "cpu:gloo,cuda:gloo" for gloo, which also takes CUDA tensors).


def parse_backend_config(config: str) -> dict[str, str]:
    """{device type: backend} from a backend config string such as "cpu:gloo,cuda:nccl"; a
    plain backend name (what torch before `get_backend_config` reports) maps to the devices
    that backend serves."""
    config = config.strip().lower()
    if ":" not in config:
        # "undefined": no backend named, torch's default pair.
        known = {"nccl": {"cuda": "nccl"}, "gloo": {"cpu": "gloo", "cuda": "gloo"},
                 "undefined": {"cpu": "gloo", "cuda": "nccl"}}
        return dict(known.get(config, {}))
    found = {}
    for entry in config.split(","):
        device_type, _, backend = entry.partition(":")
        found[device_type.strip()] = backend.strip()
    return found


def backends_of(group) -> dict[str, str]:
    """{device type: backend} for a process group (None: the default group)."""
    get_config = getattr(dist, "get_backend_config", None)  # guarded: not in every torch
    return parse_backend_config(get_config(group) if get_config is not None
                                else str(dist.get_backend(group)))


def device_for_backends(backends: dict[str, str], module_device=None,
                        cuda_available: bool = False, current_cuda: int = 0) -> torch.device:
    """The compute device for a group with `backends` ({device type: backend}): the current
    CUDA device where the group has a CUDA backend of its own (NCCL, or a mixed config, as
    torch's FSDP prefers CUDA) and CUDA is available; else the CUDA device the module lives on
    where the group can talk there (gloo takes CUDA tensors too: a model on a GPU is not moved
    off it), or the current CUDA device for a model on meta (`module_device` "meta"), which
    native FSDP1 materialises there whatever the backend; else the CPU. Refuses a group that
    talks on neither."""
    cuda_backend = backends.get("cuda")
    if cuda_available and cuda_backend is not None and cuda_backend != "gloo":
        return torch.device("cuda", current_cuda)
    if (module_device is not None and module_device.type == "meta" and cuda_available
            and cuda_backend is not None):
        return torch.device("cuda", current_cuda)
    if module_device is not None and module_device.type == "cuda" and cuda_backend is not None:
        return module_device
    if "cpu" in backends:
        return torch.device("cpu")
    config = ",".join(f"{d}:{b}" for d, b in backends.items()) or "none"
    raise ValueError(
        f"fsdp_bridge: the process group's backends ({config}) talk on no device this process "
        f"can compute on (CUDA available: {cuda_available}); accepted: a group with a CPU "
        "backend (gloo), or a CUDA backend on a machine with CUDA. Initialise the process group "
        "with a backend for this machine, or pass device_id.")


def collective_device(backends: dict[str, str], device: torch.device) -> torch.device:
    """Where a small bookkeeping collective (plan fingerprints) is sent on a group with
    `backends`: the CPU where the group talks there (no device copies), else `device`."""
    return torch.device("cpu") if "cpu" in backends else device
