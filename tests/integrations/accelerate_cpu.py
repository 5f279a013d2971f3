"""A test-only switch that runs accelerate's FSDP path on the CPU.

On a CPU-only machine stock accelerate drops the FSDP plugin (its state says MULTI_CPU), so
neither native FSDP2 nor ours would be reached. `accelerator_on_cpu_fsdp` builds an Accelerator,
then sets accelerate's shared state as a GPU launch would have it: distributed type FSDP with
the plugin (and its mixed precision) installed. It touches accelerate's state object only,
never torch.
"""

from __future__ import annotations


def accelerator_on_cpu_fsdp(accelerator_class, plugin, mixed_precision: str = "no", **kwargs):
    """A fresh `accelerator_class(fsdp_plugin=plugin, ...)` whose state is FSDP with `plugin`."""
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    accelerator = accelerator_class(fsdp_plugin=plugin, mixed_precision=mixed_precision, **kwargs)
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    state.fsdp_plugin = plugin
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    return accelerator
