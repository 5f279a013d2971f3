"""The CPU bench's program on each rank, and the world it runs in: repeats of freshly built
models, interleaved timed rounds, then one measured step and one measured wrap from meta per
(dtype, config)."""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time

from fsdp_bridge.bench.models import CONFIGS, batch, build, step, wrap_from_meta
from fsdp_bridge.bench.probes import heap_in_use, step_probe, wrap_peak
from fsdp_bridge.harness.world import RankSetup, WorldFailed, spawn

# CPU ranks: one thread each (the configs are timed side by side on a shared machine); a failed
# rank must not hang the others for long.
CPU_RANKS = RankSetup(backend="gloo", group_timeout_s=300, threads=1)


def _timed_step(model, optimizer, ids) -> float:
    import torch.distributed as dist

    dist.barrier()  # every rank starts the step together (not timed)
    start = time.perf_counter()
    step(model, optimizer, ids)
    return time.perf_counter() - start


def _round_order(round_index: int) -> list[str]:
    """The configs in a rotating order, so none always runs first or last."""
    shift = round_index % len(CONFIGS)
    return list(CONFIGS[shift:] + CONFIGS[:shift])


def _timed_repeat(dtype_name: str, s: dict, ids, repeat_index: int) -> dict[str, list[float]]:
    """Fresh models of every config, warmed up, then `steps` rounds of one step of each.

    Interleaving single steps (rather than whole runs) exposes every config to the same load
    from the other users of the machine. Returns each step's time, the slowest rank's."""
    import torch
    import torch.distributed as dist

    runs = {config: build(config, dtype_name, s) for config in CONFIGS}
    for _ in range(s["warmup"]):
        for config in CONFIGS:
            step(*runs[config], ids)
    times = {config: [] for config in CONFIGS}
    for round_index in range(s["steps"]):
        for config in _round_order(repeat_index * s["steps"] + round_index):
            times[config].append(_timed_step(*runs[config], ids))
    slowest = torch.tensor([times[config] for config in CONFIGS], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    del runs
    gc.collect()
    return dict(zip(CONFIGS, slowest.tolist()))


def _measured_step(config: str, dtype_name: str, s: dict, ids) -> dict:
    """One warm-up step (it creates the optimizer state), then one step under the probe."""
    gc.collect()
    baseline = heap_in_use()  # before this config's model exists
    model, optimizer = build(config, dtype_name, s)
    step(model, optimizer, ids)
    engine_stats = model._sharded.comm.stats if config == "ours" else None
    if engine_stats is not None:
        engine_stats.reset()
    gc.collect()
    start = heap_in_use()
    probe = step_probe()
    with probe:
        step(model, optimizer, ids)
    result = {
        "step_start_bytes": start - baseline,
        "peak_bytes": probe.peak_heap - baseline,
        "collectives": {"calls": probe.calls, "bytes": probe.bytes},
    }
    if engine_stats is not None:
        result["engine_counter"] = {"calls": dict(engine_stats.calls), "bytes": dict(engine_stats.bytes)}
    del model, optimizer
    gc.collect()
    return result


def _measured_wrap(config: str, dtype_name: str, s: dict) -> int:
    """The `init` figure: the heap's peak growth while the model, built on meta, is wrapped
    and materialised (see `models.wrap_from_meta`)."""
    peak, model = wrap_peak(lambda: wrap_from_meta(config, dtype_name, s))
    del model
    gc.collect()
    return peak


def log(rank: int, message: str, quiet: bool = False) -> None:
    """Progress of the bench, from rank 0, on stderr (the report goes to stdout)."""
    if rank == 0 and not quiet:
        print(f"[bench] {message}", file=sys.stderr, flush=True)


def rank_program(rank: int, world: int, s: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")  # FSDP1's deprecation notice, our YaFSDP notes
    ids = batch(s, rank)
    times = {d: {c: [] for c in CONFIGS} for d in s["dtypes"]}
    quiet = s.get("quiet", False)
    for repeat_index in range(s["repeats"]):
        for dtype_name in s["dtypes"]:
            log(rank, f"repeat {repeat_index + 1}/{s['repeats']} {dtype_name}: building "
                f"{', '.join(CONFIGS)}, {s['warmup']} warm-up and {s['steps']} timed steps "
                "each...", quiet)
            repeat = _timed_repeat(dtype_name, s, ids, repeat_index)
            for config, step_times in repeat.items():
                times[dtype_name][config].append(step_times)
            medians = ", ".join(
                f"{c} {1000 * statistics.median(t):.0f}" for c, t in repeat.items()
            )
            log(rank, f"repeat {repeat_index + 1}/{s['repeats']} {dtype_name}: median ms {medians}",
                s.get("quiet", False))
    # After the timed repeats on purpose: the first use of some torch internals allocates
    # for good, which would otherwise be charged to whichever config is measured first.
    log(rank, "measuring each config's memory and collectives...", quiet)
    measured = {d: {c: _measured_step(c, d, s, ids) for c in CONFIGS} for d in s["dtypes"]}
    for dtype_name in s["dtypes"]:
        for config in CONFIGS:
            measured[dtype_name][config]["init_peak_bytes"] = _measured_wrap(config, dtype_name, s)
    log(rank, "memory and collectives measured", quiet)
    return {"times": times, "measured": measured}


def run_world(s: dict, program=rank_program, setup: RankSetup = CPU_RANKS) -> list:
    """`program(rank, world, s)` on `s["nproc"]` spawned ranks; their results, in rank order."""
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the spawned ranks at start-up
    log(0, f"starting {s['nproc']} ranks (each loads torch and transformers)...",
        s.get("quiet", False))
    try:
        return spawn(program, s["nproc"], (s,), setup)
    except WorldFailed as failed:
        raise RuntimeError("bench: a rank failed:\n" + "\n".join(failed.errors)) from None
