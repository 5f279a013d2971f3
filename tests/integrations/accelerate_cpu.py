"""A test-only switch that runs accelerate's FSDP path on the CPU.

On a CPU-only machine stock accelerate drops the FSDP plugin (its state says MULTI_CPU), so
native FSDP2 would not be reached; fsdp_bridge's Accelerator shards there all the same, by
setting accelerate's shared state as a GPU launch would have it (distributed type FSDP with the
plugin and its mixed precision installed: `shard_on_cpu`). `switch_to_fsdp` does the same to a
native Accelerator, for the comparison. It touches accelerate's state object only, never torch.
"""

from __future__ import annotations


def fresh_accelerate_state() -> None:
    """Forget the previous case's accelerate state (its singletons outlive an Accelerator),
    and describe this rank as torchrun does, so that accelerate sees a distributed launch (it
    splits the data loaders over the ranks)."""
    import os

    import torch.distributed as dist
    from accelerate.state import AcceleratorState, GradientState

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def switch_to_fsdp(accelerator, plugin) -> None:
    from fsdp_bridge.integrations.accelerate import shard_on_cpu

    shard_on_cpu(accelerator, plugin)  # nothing left to do for fsdp_bridge's Accelerator


def accelerator_on_cpu_fsdp(accelerator_class, plugin, mixed_precision: str = "no", **kwargs):
    """A fresh `accelerator_class(fsdp_plugin=plugin, ...)` whose state is FSDP with `plugin`."""
    fresh_accelerate_state()
    accelerator = accelerator_class(fsdp_plugin=plugin, mixed_precision=mixed_precision,
                                    cpu=True, **kwargs)
    switch_to_fsdp(accelerator, plugin)
    return accelerator


def trainer_on_cpu_fsdp(trainer_class):
    """`trainer_class` whose Accelerator is switched to FSDP with the plugin its arguments
    describe, as the Trainer sees it on a GPU launch."""

    class OnCpuFsdp(trainer_class):
        def create_accelerator_and_postprocess(self):
            from accelerate.utils import FullyShardedDataParallelPlugin

            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            switch_to_fsdp(self.accelerator, plugin)
            self.is_fsdp_enabled = True

    return OnCpuFsdp
