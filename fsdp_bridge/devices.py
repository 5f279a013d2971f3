"""The `device_id` argument of the front-ends, checked before anything is touched.

FSDP1 and YaFSDP take `device_id` as an int (a CUDA index), a `torch.device` or a device string.
A device the running torch cannot use is refused here, with the argument named, instead of
failing halfway through sharding (after the model has been flattened):

- `meta` holds no storage: shards must live on a real device;
- a CUDA device (or index) on a torch without CUDA;
- a CUDA index beyond the visible devices;
- a bool (`True` is an int to Python, not a device).
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_bridge.translation import bad_argument

_ACCEPTED = "None, an int CUDA index, a torch.device or a device string"


def _check_available(frontend: str, argument: str, value, device: torch.device) -> None:
    if device.type == "meta":
        raise bad_argument(frontend, argument, value, "a device with storage (the shards live "
                           "there), not 'meta'", "To build the model without memory, create it "
                           "under torch.device('meta') and pass param_init_fn (or rely on "
                           "reset_parameters); set device_id to the compute device, e.g. "
                           "torch.device('cuda', local_rank), or leave it None on CPU.")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise bad_argument(frontend, argument, value, "a torch.device this torch can "
                               "use (it has no CUDA here: 'cpu'), or None", "Leave device_id None (CPU "
                               "with gloo), or install a CUDA build of torch.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise bad_argument(frontend, argument, value, f"a CUDA index below "
                               f"{torch.cuda.device_count()} (the visible devices)", "Pass "
                               "the local rank, e.g. device_id=int(os.environ['LOCAL_RANK']).")
        return
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    if device.type != "cpu" and callable(available) and not available():
        raise bad_argument(frontend, argument, value, f"a device this torch can use "
                           f"({device.type!r} is not available)", "Pass device_id='cpu' or "
                           "leave it None.")


def resolve_device(frontend: str, device_id, argument: str = "device_id") -> Optional[torch.device]:
    """`device_id` as a `torch.device` (None stays None), or a clear error."""
    if device_id is None:
        return None
    if isinstance(device_id, bool):
        raise bad_argument(frontend, argument, device_id, _ACCEPTED, "A bool is not a device: "
                           "pass e.g. device_id=torch.cuda.current_device(), or leave it None.",
                           exc=TypeError)
    if isinstance(device_id, int):
        if device_id < 0:
            raise bad_argument(frontend, argument, device_id, "a CUDA index >= 0",
                               "Pass the local rank, e.g. device_id=int(os.environ['LOCAL_RANK']).")
        device = torch.device("cuda", device_id)
    elif isinstance(device_id, (str, torch.device)):
        try:
            device = torch.device(device_id)
        except RuntimeError:
            raise bad_argument(frontend, argument, device_id, _ACCEPTED, "e.g. "
                               "device_id=torch.device('cpu') or device_id='cuda:0'.") from None
    else:
        raise bad_argument(frontend, argument, device_id, _ACCEPTED, "e.g. device_id="
                           "torch.device('cpu') or device_id=torch.cuda.current_device().",
                           exc=TypeError)
    _check_available(frontend, argument, device_id, device)
    return device
