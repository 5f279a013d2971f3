"""Drop-in for `torch.distributed.fsdp.api`: torch's own enums and config dataclasses, the very
objects (user code mixes them with ours), under every public name torch's module has."""

import torch.distributed.fsdp.api as _torch_api
from torch.distributed.fsdp.api import *  # noqa: F401,F403  (torch's own objects)

__all__ = list(_torch_api.__all__)
