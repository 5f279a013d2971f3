"""Hugging Face's `Trainer` on fsdp_bridge's engine.

    from fsdp_bridge.integrations.transformers import Trainer  # was: from transformers import Trainer

With FSDP2 in the training arguments (`fsdp=True`, `fsdp_config={"version": 2, ...}`, or an
`accelerate launch` FSDP2 config), the Trainer's Accelerator is
`fsdp_bridge.integrations.accelerate.Accelerator`: it shards the model with our `fully_shard`
using the same settings accelerate would pass to torch's. Everything else is the Trainer's own:
`generate` after training (through torch's `register_fsdp_forward_method`), checkpoints,
`resume_from_checkpoint`. On a CPU-only machine, where accelerate would drop FSDP for data
parallelism, it shards all the same. For a Trainer subclass of another library, put the mixin first:
`class MyTrainer(BridgeTrainerMixin, SFTTrainer)`.
"""

from __future__ import annotations

from fsdp_bridge.extras import require_for

require_for(__name__, "transformers", "accelerate")

import accelerate  # noqa: E402
import transformers  # noqa: E402

from fsdp_bridge.integrations.accelerate import (  # noqa: E402
    Accelerator,
    check_fsdp_version,
    shard_on_cpu,
)
from fsdp_bridge.translation import bad_argument  # noqa: E402


class BridgeTrainerMixin:
    """Makes a `transformers.Trainer` (or subclass) prepare its model with our Accelerator,
    through the Trainer's public hook that builds its Accelerator."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        use_bridge_accelerator(self.accelerator)
        if self.args.fsdp_plugin_args is not None and not self.is_fsdp_enabled:
            # accelerate dropped FSDP on a CPU-only machine: shard there too (see
            # [Note: FSDP on the CPU] in fsdp_bridge.integrations.accelerate).
            from accelerate.utils import FullyShardedDataParallelPlugin

            shard_on_cpu(self.accelerator,
                         FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = getattr(self.accelerator.state, "fsdp_plugin", None) is not None


class Trainer(BridgeTrainerMixin, transformers.Trainer):
    """`transformers.Trainer`, training FSDP2 on fsdp_bridge's engine."""


def use_bridge_accelerator(accelerator: accelerate.Accelerator) -> None:
    """Turn the Accelerator the Trainer built into ours. Ours only overrides `prepare` and adds
    no state, so the object the Trainer configured stays as it is; an Accelerator of another
    subclass is refused (its own `prepare` would be lost)."""
    if isinstance(accelerator, Accelerator):
        return
    if type(accelerator) is not accelerate.Accelerator:
        raise bad_argument("fsdp_bridge.integrations.transformers.Trainer", "accelerator",
                           accelerator, "accelerate.Accelerator, as Trainer builds it",
                           f"Make {type(accelerator).__name__} inherit from "
                           "fsdp_bridge.integrations.accelerate.Accelerator.", exc=TypeError)
    accelerator.__class__ = Accelerator
    check_fsdp_version(accelerator)
