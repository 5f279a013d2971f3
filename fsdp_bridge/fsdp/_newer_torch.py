"""Names of torch's FSDP modules that only newer torch releases have.

The drop-in modules re-export torch's public names; a few of them appeared after the oldest
torch we support, so they are re-exported only when the installed torch has them. Asking for
one on an older torch raises an AttributeError that names the torch release it needs, instead
of an ImportError at `import fsdp_bridge.fsdp` for everybody.
"""

from __future__ import annotations

import torch


def reexport(namespace: dict, source, newer: dict[str, str]) -> list[str]:
    """Put into `namespace` each name of `newer` (name -> the torch release that has it) that
    the module `source` has; return the names put there."""
    present = [name for name in newer if hasattr(source, name)]
    namespace.update({name: getattr(source, name) for name in present})
    return present


def missing(module: str, source: str, newer: dict[str, str], name: str) -> AttributeError:
    """The error for `module.name` (a module's `__getattr__`): for a name of `newer`, which
    torch release has it; otherwise Python's usual message."""
    if name not in newer:
        return AttributeError(f"module {module!r} has no attribute {name!r}")
    return AttributeError(
        f"{module}.{name} is torch's {source}.{name}, which torch {torch.__version__} does not "
        f"have: it needs torch {newer[name]}. Install a newer torch, or leave {name} out.")
