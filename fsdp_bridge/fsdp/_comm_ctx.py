"""FSDP2's `share_comm_ctx(modules)` for our `fully_shard` modules.

Torch's version makes several FSDP roots (pipeline-parallel model chunks) use the same CUDA
streams for their collectives. The engine issues every collective on the backend's own stream
(NCCL's, or gloo's thread), which all roots already share, so there is nothing to merge; the
call only checks its argument, as torch's does. Torch's own function cannot be re-exported: it
refuses modules that are not torch's FSDPModule.
"""

from __future__ import annotations

from fsdp_bridge.translation import bad_argument


def share_comm_ctx(modules) -> None:
    from fsdp_bridge.fsdp._fully_shard import FSDPModule

    for index, module in enumerate(modules):
        if not isinstance(module, FSDPModule):
            raise bad_argument("share_comm_ctx", f"modules[{index}]", module, "modules "
                               "passed to fully_shard (FSDPModule instances)", "Call "
                               "fully_shard(module) on each model chunk first.")
