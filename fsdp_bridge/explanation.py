"""`fsdp_bridge.explain(model)`: the Plan a model got, as text: units with their parameters and
bytes per rank, dtypes, strategy, the memory a rank needs for a training step and while the
model is wrapped (see `fsdp_bridge.memory`), and every setting a front-end could not honour.
Also `render_docs()`: every front-end's argument table as Markdown (docs/frontends.md)."""

from __future__ import annotations

import importlib

from torch import nn

from fsdp_bridge import engine

FRONTEND_MODULES = (
    "fsdp_bridge.fsdp._fsdp1_translate",
    "fsdp_bridge.fsdp._fsdp2_translate",
    "fsdp_bridge.ya_fsdp._translate",
    "fsdp_bridge.zeta._translate",
    "fsdp_bridge.torchacc._translate",
)


def find_sharded(model: nn.Module):
    """The engine state behind any front-end's model (wrapper, FSDP2 root, raw module)."""
    candidates = [getattr(model, "_sharded", None), engine.get_sharded(model)]
    for param in model.parameters():
        candidates.append(engine.owner_of(param))
        break
    for candidate in candidates:
        if candidate is not None:
            return candidate
    raise ValueError(
        f"explain: {type(model).__name__} is not sharded by fsdp_bridge. Pass a model wrapped "
        "by one of fsdp_bridge's front-ends (after fully_shard, use it once or build the "
        "optimizer first)."
    )


def _bytes(numel: int, dtype) -> str:
    size = numel * dtype.itemsize
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def explain(model: nn.Module, optimizer=None) -> str:
    """The plan of `model` as text; pass the `optimizer` to have its state counted in the
    memory per rank."""
    from fsdp_bridge.memory import estimate_step_memory, estimate_wrap_memory

    sharded = find_sharded(model)
    plan = sharded.plan
    comm = sharded.comm
    lines = [
        f"fsdp_bridge plan (front-end {plan.frontend}): mode {plan.mode.value}, shard group of "
        f"{comm.shard_size}, replicated {comm.replicate_size}x, device {sharded.device}",
        plan.describe(),
        "",
        "units (per rank):",
        f"  {'unit':<28} {'params':>10} {'numel/rank':>11} {'master/rank':>12} "
        f"{'gathered':>10}  dtypes (master -> compute / reduce)",
    ]
    for unit in sharded.units:
        for group in unit.groups:
            master = group.master.dtype
            lines.append(
                f"  {unit.name or '<root>':<28} {len(group.slots):>10} {group.shard_numel:>11} "
                f"{_bytes(group.shard_numel, master):>12} "
                f"{_bytes(group.padded_numel, group.compute_dtype):>10}  {master} -> "
                f"{group.compute_dtype} / {group.reduce_dtype}"
                + ("" if group.requires_grad else "  (frozen)")
            )
        if not unit.groups:
            lines.append(f"  {unit.name or '<root>':<28} {0:>10}")
    if sharded.ignored_params:
        lines.append(f"ignored (not sharded, not reduced): {len(sharded.ignored_params)} params")
    lines += ["", estimate_step_memory(sharded, optimizer).describe(),
              estimate_wrap_memory(sharded).describe(), ""]
    lines.append("warnings raised while translating:")
    lines += [f"  - {note}" for note in plan.notes] or ["  (none)"]
    return "\n".join(lines)


def render_docs() -> str:
    tables = [importlib.import_module(name).TABLE for name in FRONTEND_MODULES]
    parts = [
        "# Front-end argument tables",
        "",
        "Generated from the tables in the code (`python -m fsdp_bridge explain --write-docs "
        "docs/frontends.md`); do not edit by hand. Each argument of each dialect is translated "
        "into the Plan, ignored with a warning naming it (and why), or rejected with an error "
        "naming the argument, the value and what is accepted.",
        "",
    ]
    for table in tables:  # a fixed order, whatever was imported first
        parts += [table.render_markdown(), ""]
    return "\n".join(parts)
