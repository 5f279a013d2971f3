"""The CPU bench's figures (from rank 0's timings and every rank's measured step), its targets,
the printed report and the `--json` file."""

from __future__ import annotations

import json
import os
import statistics

from fsdp_bridge.bench.models import CONFIGS
from fsdp_bridge.outputs import STDOUT, write_json, write_text

# The speed target: ours at most this fraction of the faster native step time.
SPEEDUP_TARGET = 0.85
# The memory target: ours' peak per rank at most this fraction of native FSDP2's.
MEMORY_TARGET = 0.97
# The goal for the cost of sharding: ours at most this multiple of the compute-only step.
COMPUTE_ONLY_GOAL = 1.15


def _config_figures(times: list[list[float]], per_rank: list[dict]) -> dict:
    every_step = [t for run in times for t in run]
    collectives = per_rank[0]["collectives"]
    figures = {
        "median_step_ms": 1000 * statistics.median(every_step),
        "repeat_medians_ms": [1000 * statistics.median(run) for run in times],
        "step_times_ms": [[1000 * t for t in run] for run in times],
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "step_start_bytes_per_rank": [r["step_start_bytes"] for r in per_rank],
        "init_peak_bytes_per_rank": [r.get("init_peak_bytes", 0) for r in per_rank],
        "collective_calls_per_step": sum(collectives["calls"].values()),
        "collective_bytes_per_step": sum(collectives["bytes"].values()),
        "collectives_by_op": collectives,
    }
    if "engine_counter" in per_rank[0]:
        figures["engine_counter"] = per_rank[0]["engine_counter"]
    return figures


def _targets(figs: dict) -> dict:
    ours, f1, f2 = figs["ours"], figs["fsdp1"], figs["fsdp2"]
    faster = min(f1["median_step_ms"], f2["median_step_ms"])
    fsdp2_peak = max(f2["peak_bytes_per_rank"])
    measured = fsdp2_peak > 0  # False where the heap cannot be measured (see heap_in_use)
    compute_only = ours["median_step_ms"] / figs["plain"]["median_step_ms"]
    return {
        "speed_ratio_to_faster_native": ours["median_step_ms"] / faster,
        "speed_met": ours["median_step_ms"] <= SPEEDUP_TARGET * faster,
        "peak_ratio_to_fsdp2": max(ours["peak_bytes_per_rank"]) / fsdp2_peak if measured else None,
        "memory_met": (max(ours["peak_bytes_per_rank"]) <= MEMORY_TARGET * fsdp2_peak
                       if measured else None),
        "step_start_memory_met": (max(ours["step_start_bytes_per_rank"])
                                  <= max(f2["step_start_bytes_per_rank"]) if measured else None),
        "collectives_met": ours["collective_calls_per_step"] <= f2["collective_calls_per_step"],
        "compute_only_ratio": compute_only,
        "compute_only_goal_met": compute_only <= COMPUTE_ONLY_GOAL,
    }


def _paired_ratio(ours: list[list[float]], native: list[list[float]]) -> float:
    """The median over rounds of ours / native, each pair timed in the same round."""
    pairs = [o / n for ours_run, native_run in zip(ours, native) for o, n in zip(ours_run, native_run)]
    return statistics.median(pairs)


def summarize(s: dict, results: list[dict]) -> dict:
    """The figures of a finished run (rank 0's timings are already the max over ranks)."""
    report = {"settings": s, "dtypes": {}}
    for dtype_name in s["dtypes"]:
        figs = {
            config: _config_figures(
                results[0]["times"][dtype_name][config],
                [r["measured"][dtype_name][config] for r in results],
            )
            for config in CONFIGS
        }
        ours = figs["ours"]["median_step_ms"]
        for other in ("fsdp1", "fsdp2", "ours2", "plain"):
            figs["ours"][f"ratio_to_{other}"] = ours / figs[other]["median_step_ms"]
            figs["ours"][f"paired_ratio_to_{other}"] = _paired_ratio(
                results[0]["times"][dtype_name]["ours"], results[0]["times"][dtype_name][other]
            )
        faster = min(figs["fsdp1"]["median_step_ms"], figs["fsdp2"]["median_step_ms"])
        figs["ours2"]["ratio_to_faster_native"] = figs["ours2"]["median_step_ms"] / faster
        report["dtypes"][dtype_name] = {"configs": figs, "targets": _targets(figs)}
    return report


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def verdict(met) -> str:
    return "n/a" if met is None else "MET" if met else "MISSED"


def format_report(report: dict) -> str:
    lines = _header(report["settings"])
    for dtype_name, entry in report["dtypes"].items():
        lines += ["", f"{dtype_name}:", *_table(entry["configs"]),
                  *_counts(entry["configs"]), *timing_caveat(report["settings"]),
                  *_verdicts(entry["configs"], entry["targets"])]
    return "\n".join(lines)


# Timed steps per config from which the speed targets' MET / MISSED are said without a caveat:
# on a shared machine step times scatter by several percent, so the median of a handful of
# steps cannot place a ratio against a target a few percent away.
ENOUGH_TIMED_STEPS = 10


def timing_caveat(s: dict) -> list[str]:
    """A line saying the speed verdicts are indicative only, when too few steps were timed."""
    timed = s["steps"] * s["repeats"]
    if timed >= ENOUGH_TIMED_STEPS:
        return []
    return [f"  caveat: {timed} timed step{'s' * (timed != 1)} per config (--steps x --repeats) "
            f"are too few for the speed verdicts below to mean much (step times scatter by "
            f"several percent): take them as indicative, or time at least {ENOUGH_TIMED_STEPS} "
            "(the defaults time 30); the memory and call counts are exact"]


def _header(s: dict) -> list[str]:
    return [
        f"tiny Llama: hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, seq "
        f"{s['seq']}, batch {s['batch']}/rank; world {s['nproc']} on gloo, 1 thread/rank",
        f"{s['repeats']} repeats x ({s['warmup']} warmup steps + {s['steps']} rounds of one step "
        "per config, interleaved); step time = slowest rank; median over all timed steps",
        "peak = highest heap bytes in use (glibc mallinfo2, sampled at every op) during one "
        "step above the heap before the model was built, max over ranks; start = live bytes when the "
        "step begins; init = peak heap growth while the model, built on meta, is wrapped and "
        "materialised (FSDP1 and ours: inside the wrap; FSDP2, plain: to_empty + "
        "reset_parameters after it); collectives = c10d ops per step on one rank, bytes of the full tensor "
        "(all-to-all: sent + received); paired = median of per-round ours/this",
        "ours = our engine through the YaFSDP front-end; ours2 = through fully_shard "
        "(DTensor parameters); plain = compute only (each rank's unsharded model on its own "
        "batch, no communication)",
    ]


def _table(figs: dict) -> list[str]:
    from fsdp_bridge.text import table

    ours = figs["ours"]["median_step_ms"]
    rows = []
    for config in CONFIGS:
        f = figs[config]
        rows.append([config, f"{f['median_step_ms']:.1f}", f"{ours / f['median_step_ms']:.2f}",
                     f"{figs['ours'].get(f'paired_ratio_to_{config}', 1.0):.2f}",
                     mib(max(f["peak_bytes_per_rank"])), mib(max(f["step_start_bytes_per_rank"])),
                     mib(max(f["init_peak_bytes_per_rank"])), f["collective_calls_per_step"],
                     mib(f["collective_bytes_per_step"])])
    return table(rows, ["config", "median ms", "ours/this", "paired", "peak MiB", "start MiB",
                        "init MiB", "calls/step", "MiB/step"], right=range(1, 9))


def _counts(figs: dict) -> list[str]:
    """The collectives by op of every config, and the engine's own count of ours."""
    by_op = "; ".join(
        f"{config} " + " + ".join(f"{n} {op}" for op, n in figs[config]["collectives_by_op"]["calls"].items())
        for config in CONFIGS
    )
    lines = [f"  calls by op: {by_op}"]
    engine = figs["ours"].get("engine_counter")
    if engine:
        lines.append(f"  ours, engine's own counter: {sum(engine['calls'].values())} calls, "
                     f"{mib(sum(engine['bytes'].values()))} MiB")
    return lines


def _verdicts(figs: dict, targets: dict) -> list[str]:
    peak_ratio = targets["peak_ratio_to_fsdp2"]
    return [
        f"  targets: speed {verdict(targets['speed_met'])} (ours/faster native "
        f"{targets['speed_ratio_to_faster_native']:.2f}, target <= {SPEEDUP_TARGET}); "
        f"peak {verdict(targets['memory_met'])} (ours/fsdp2 "
        f"{'n/a' if peak_ratio is None else f'{peak_ratio:.3f}'}, target <= "
        f"{MEMORY_TARGET}); start <= fsdp2 {verdict(targets['step_start_memory_met'])}; "
        f"calls <= fsdp2 {verdict(targets['collectives_met'])}",
        f"  cost of sharding: ours/plain {targets['compute_only_ratio']:.2f} (goal <= "
        f"{COMPUTE_ONLY_GOAL}: {verdict(targets['compute_only_goal_met'])})",
        f"  ours2 (fully_shard) / faster native: "
        f"{figs['ours2']['ratio_to_faster_native']:.2f}",
        f"  init (wrap from meta) peak: ours {mib(max(figs['ours']['init_peak_bytes_per_rank']))}"
        f" MiB, native fsdp1 {mib(max(figs['fsdp1']['init_peak_bytes_per_rank']))} MiB "
        f"(ours/fsdp1 {_init_ratio(figs, 'ours', 'fsdp1')}); ours2 "
        f"{mib(max(figs['ours2']['init_peak_bytes_per_rank']))} MiB, native fsdp2 "
        f"{mib(max(figs['fsdp2']['init_peak_bytes_per_rank']))} MiB "
        f"(ours2/fsdp2 {_init_ratio(figs, 'ours2', 'fsdp2')}); {_allocator()}",
    ]


def _allocator() -> str:
    """Which glibc malloc settings the figures were taken under (the ranks inherit them)."""
    tuned = sorted(name for name in os.environ if name.startswith("MALLOC_"))
    return ("malloc: " + ", ".join(f"{n}={os.environ[n]}" for n in tuned) if tuned
            else "malloc: glibc defaults")


def _init_ratio(figs: dict, ours: str, native: str) -> str:
    """Ours' wrap peak over native's, the highest rank's each ('n/a' without a native
    figure, as off glibc)."""
    theirs = max(figs[native]["init_peak_bytes_per_rank"])
    return f"{max(figs[ours]['init_peak_bytes_per_rank']) / theirs:.2f}" if theirs else "n/a"


def write_figures(path, figures: dict) -> None:
    """`--json FILE`: the figures as JSON (nothing when the option is not given; "-": stdout)."""
    if path == STDOUT:
        write_json(path, figures)
    elif path:
        write_text(path, json.dumps(figures, indent=2))
        print(f"figures written to {path}")
