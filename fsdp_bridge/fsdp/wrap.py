"""Drop-in for `torch.distributed.fsdp.wrap`: torch's own policy objects and functions.

They are torch's objects, not look-alikes: user code mixes them freely with ours, and our
front-ends evaluate them with torch's own code (`fsdp_bridge.policies`). `enable_wrap` / `wrap`
are torch's too: inside `enable_wrap(wrapper_cls=FullyShardedDataParallel, ...)`, `wrap(m)`
builds our wrapper, and the outermost wrapper adopts the inner ones as units.
"""

from torch.distributed.fsdp.wrap import (  # noqa: F401
    CustomPolicy,
    ModuleWrapPolicy,
    _module_wrap_policy,
    _or_policy,
    _Policy,
    _wrap_module_cls_individually,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

__all__ = [
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "enable_wrap",
    "wrap",
    "CustomPolicy",
    "ModuleWrapPolicy",
]
