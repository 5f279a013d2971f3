"""Optional dependencies, checked before a command starts work.

A command that needs `transformers` (the tiny Llama and GPT-2 recipes) or `matplotlib` (plots)
checks for it first, in the process the user started, so that a missing one is reported in one
line naming the extra to install, not as a traceback from inside every spawned rank.
"""

from __future__ import annotations

import importlib.util

# module -> the extra of fsdp-bridge that installs it
EXTRA_OF = {"transformers": "hf", "safetensors": "hf", "accelerate": "hf", "matplotlib": "plot",
            "lightning": "lightning"}


class MissingExtra(RuntimeError):
    """An optional dependency a command needs is not installed."""


def missing_message(modules: list[str], why: str = "") -> str:
    """e.g. "needs transformers (why), which is not installed: pip install 'fsdp-bridge[hf]'"."""
    extras = ",".join(sorted({EXTRA_OF.get(name, name) for name in modules}))
    verb = "is" if len(modules) == 1 else "are"
    return (f"needs {' and '.join(modules)}{f' ({why})' if why else ''}, which {verb} not "
            f"installed: pip install 'fsdp-bridge[{extras}]'")


def installed(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: set to None in sys.modules, i.e. blocked
        return False


def require(*modules: str, why: str = "") -> None:
    """Raise MissingExtra naming every module of `modules` that is not installed."""
    missing = [name for name in modules if not installed(name)]
    if missing:
        raise MissingExtra(missing_message(missing, why))


def require_for(user: str, *modules: str) -> None:
    """As `require`, for a module of fsdp_bridge that imports `modules` (e.g. an integration):
    "fsdp_bridge.integrations.accelerate needs accelerate, which is not installed: ..."."""
    missing = [name for name in modules if not installed(name)]
    if missing:
        raise MissingExtra(f"{user} {missing_message(missing)}")


def as_missing_extra(exc: ModuleNotFoundError) -> MissingExtra | None:
    """The one-line form of an import of an optional dependency that failed after all (None
    when the missing module is not one of ours to name)."""
    top = (exc.name or "").split(".")[0]
    return MissingExtra(missing_message([top])) if top in EXTRA_OF else None
