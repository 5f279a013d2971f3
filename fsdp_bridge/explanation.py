"""`fsdp_bridge.explain(model)`: the Plan a model got, as text: units with their parameters and
bytes per rank, dtypes, strategy, the memory a rank needs for a training step and while the
model is wrapped (see `fsdp_bridge.memory`), and every setting a front-end could not honour.
Also `render_docs()`: every front-end's argument table as Markdown, committed as
`fsdp_bridge/frontends.md` (what `fsdp-bridge explain` prints, without importing torch)."""

from __future__ import annotations

import dataclasses
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


def _bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def plan_summary(model: nn.Module, optimizer=None) -> dict:
    """The plan of `model` as data (what `explain` prints, and `fsdp-bridge explain --json`
    writes); pass the `optimizer` to have its state counted in the memory per rank."""
    from fsdp_bridge.memory import estimate_step_memory, estimate_wrap_memory

    sharded = find_sharded(model)
    plan = sharded.plan
    step = estimate_step_memory(sharded, optimizer)
    wrap = estimate_wrap_memory(sharded)
    return {
        "frontend": plan.frontend,
        "mode": plan.mode.value,
        "shard_group": sharded.comm.shard_size,
        "replicated": sharded.comm.replicate_size,
        "device": str(sharded.device),
        "plan": plan.describe(),
        "units": [row for unit in sharded.units for row in _unit_summary(unit)],
        "ignored_params": len(sharded.ignored_params),
        "step_memory_bytes": {**dataclasses.asdict(step), "predicted_peak": step.predicted_peak},
        "wrap_memory_bytes": {"this_wrap": wrap.this_wrap, "this_start": wrap.this_start,
                              "by_start": {start.value: value
                                           for start, value in wrap.by_start.items()}},
        "memory": [step.describe(), wrap.describe()],
        "warnings": list(plan.notes),
    }


def _unit_summary(unit) -> list[dict]:
    """One row per flat group of the unit (a unit without parameters has one, empty)."""
    name = unit.name or "<root>"
    return [_group_summary(name, group) for group in unit.groups] or [{"unit": name, "params": 0}]


def _group_summary(unit: str, group) -> dict:
    return {
        "unit": unit,
        "params": len(group.slots),
        "numel_per_rank": group.shard_numel,
        "master_bytes_per_rank": group.shard_numel * group.master.dtype.itemsize,
        "gathered_bytes": group.padded_numel * group.compute_dtype.itemsize,
        "master_dtype": str(group.master.dtype),
        "compute_dtype": str(group.compute_dtype),
        "reduce_dtype": str(group.reduce_dtype),
        "frozen": not group.requires_grad,
    }


def explain(model: nn.Module, optimizer=None) -> str:
    """The plan of `model` as text; pass the `optimizer` to have its state counted in the
    memory per rank."""
    return render_summary(plan_summary(model, optimizer))


def render_summary(summary: dict) -> str:
    """`plan_summary`'s data as the text `explain` prints."""
    from fsdp_bridge.text import table

    lines = [
        f"fsdp_bridge plan (front-end {summary['frontend']}): mode {summary['mode']}, shard "
        f"group of {summary['shard_group']}, replicated {summary['replicated']}x, device "
        f"{summary['device']}",
        summary["plan"],
        "",
        "units (per rank):",
    ]
    rows = [[unit["unit"], unit["params"], unit.get("numel_per_rank", ""),
             _bytes(unit["master_bytes_per_rank"]) if "master_dtype" in unit else "",
             _bytes(unit["gathered_bytes"]) if "master_dtype" in unit else "",
             _dtypes(unit)] for unit in summary["units"]]
    lines += table(rows, ["unit", "params", "numel/rank", "master/rank", "gathered",
                          "dtypes (master -> compute / reduce)"], right=(1, 2, 3, 4))
    if summary["ignored_params"]:
        lines.append(f"ignored (not sharded, not reduced): {summary['ignored_params']} params")
    lines += ["", *summary["memory"], ""]
    lines.append("warnings raised while translating:")
    lines += [f"  - {note}" for note in summary["warnings"]] or ["  (none)"]
    return "\n".join(lines)


def _dtypes(unit: dict) -> str:
    if "master_dtype" not in unit:
        return ""
    return (f"{unit['master_dtype']} -> {unit['compute_dtype']} / {unit['reduce_dtype']}"
            + ("  (frozen)" if unit["frozen"] else ""))


def tables_summary() -> list[dict]:
    """Every front-end's argument table as data (`fsdp-bridge explain --json`)."""
    return [{"frontend": table.frontend,
             "arguments": [{"name": argument.name, "treatment": argument.treatment.value,
                            "detail": argument.detail} for argument in table.arguments]}
            for table in _tables()]


def _tables() -> list:
    """Every front-end's table, in a fixed order whatever was imported first."""
    return [importlib.import_module(name).TABLE for name in FRONTEND_MODULES]


def render_docs() -> str:
    tables = _tables()
    parts = [
        "# Front-end argument tables",
        "",
        "Generated from the tables in the code (`python -m fsdp_bridge explain --write-docs "
        "fsdp_bridge/frontends.md`); do not edit by hand. Each argument of each dialect is translated "
        "into the Plan, ignored with a warning naming it (and why), or rejected with an error "
        "naming the argument, the value and what is accepted.",
        "",
    ]
    for table in tables:
        parts += [table.render_markdown(), ""]
    return "\n".join(parts)
