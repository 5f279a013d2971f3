"""`fsdp-bridge bench --device cuda`: a Llama of about 1.1B parameters on GPUs over NCCL, one GPU
per rank (world 1 by default): native torch FSDP1, native torch FSDP2 and our engine (YaFSDP
front-end) wrapping the same decoder layers, and the plain unsharded model (autocast for bf16),
in one run.

How it measures, and why it differs from the CPU bench (the rest of this package):
- A GPU is not shared the way the CPU is, and four copies of a 1B model with their optimizer
  state (16 bytes a parameter) do not fit on one GPU together, so configurations run one after
  another, each with a freshly built model, not interleaved step by step; the order rotates
  from repeat to repeat.
- A step is forward + backward + AdamW + zero_grad, timed from a CUDA synchronize to the next
  (after a barrier, so every rank starts together); its time is the slowest rank's; the figure
  is the median over every timed step of every repeat.
- Memory: `torch.cuda.max_memory_allocated` over the timed steps (the peak is reset after the
  warm-up, which creates the optimizer state), so it counts what a step needs in steady state:
  parameters, gradients, optimizer state, activations and gather buffers. Max over ranks.
- `--profile DIR`: one more step of each config under torch.profiler, exported as a Chrome
  trace (DIR/<config>-<dtype>-rank<r>.json). From rank 0's trace, the report gives the time of
  NCCL kernels, and how much of it runs while a compute kernel runs on another stream
  (`comm_overlap`): the overlap of gathers and reductions with compute.

Targets: our step time <= 1.05 x plain at world 1, and <= native FSDP2's step time and memory.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import time

from fsdp_bridge import tiny
from fsdp_bridge.bench import models, schedule
from fsdp_bridge.bench.options import settings as checked_settings
from fsdp_bridge.bench.report import timing_caveat, verdict, write_figures
from fsdp_bridge.harness.world import RankSetup
from fsdp_bridge.outputs import check_output_file, human_stream

CONFIGS = ("plain", "fsdp1", "fsdp2", "ours")
SHARDED = ("fsdp1", "fsdp2", "ours")
# A Llama-3.2-1B-like shape with Llama-2's vocabulary and untied embeddings: 1.10B parameters.
CUDA_DEFAULTS = dict(dtype="bf16", nproc=1, hidden=2048, layers=16, vocab=32000, seq=2048,
                     batch=2, heads=32, kv_heads=8, intermediate=8192)
OVERHEAD_TARGET = 1.05  # ours / plain at world 1
# One GPU per rank over NCCL; a rank stuck in a collective gives up after 600 s.
CUDA_RANKS = RankSetup(backend="nccl", group_timeout_s=600, threads=None, one_gpu_per_rank=True)


# -- settings and the no-GPU error --------------------------------------------------------------


def cuda_problem(nproc: int):
    """Why `--device cuda` cannot run here (a message naming the fix), or None."""
    import torch

    if not torch.cuda.is_available():
        return ("--device cuda: no CUDA device (torch " + torch.__version__ + ", CUDA build: "
                f"{torch.version.cuda}). The GPU benchmark needs an NVIDIA GPU and a CUDA build "
                "of torch; use --device cpu (the default) on this machine.")
    found = torch.cuda.device_count()
    if nproc > found:
        return (f"--nproc {nproc}: needs one GPU per rank (NCCL cannot put two ranks on one "
                f"GPU), found {found}; use --nproc {found} or fewer.")
    return None


def settings(args) -> dict:
    s = checked_settings(args, CUDA_DEFAULTS)
    s["device"] = "cuda"
    s["profile"] = args.profile
    s["parameters"] = tiny.parameter_count(models.llama_config(s))
    return s


# -- one rank -----------------------------------------------------------------------------------


def _build(config: str, dtype_name: str, s: dict):
    import torch

    dtype = models.torch_dtype(dtype_name)
    with torch.device("cuda", torch.cuda.current_device()):  # initialised on the GPU: seconds
        model = models.build_llama(s)
    if config != "plain":
        model = models.WRAPPERS[config](model, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def _step(config: str, dtype_name: str, model, optimizer, ids) -> None:
    import torch

    if config == "plain" and dtype_name != "fp32":
        # Plain torch mixed precision: fp32 weights and optimizer, bf16 compute (autocast), as
        # the sharded configs keep fp32 masters and compute in param_dtype.
        with torch.autocast("cuda", dtype=models.torch_dtype(dtype_name)):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    else:
        models.step(model, optimizer, ids)


def _timed_step(config, dtype_name, model, optimizer, ids) -> float:
    import torch
    import torch.distributed as dist

    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    _step(config, dtype_name, model, optimizer, ids)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _profile_step(config, dtype_name, model, optimizer, ids, s: dict, rank: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(s["profile"], exist_ok=True)
    path = os.path.join(s["profile"], f"{config}-{dtype_name}-rank{rank}.json")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(config, dtype_name, model, optimizer, ids)
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    return path


def _measure(config: str, dtype_name: str, s: dict, ids, rank: int) -> dict:
    """A fresh model of `config`: warm-up steps, then timed steps with the memory peak."""
    import torch

    gc.collect()
    torch.cuda.empty_cache()
    model, optimizer = _build(config, dtype_name, s)
    for _ in range(s["warmup"]):
        _step(config, dtype_name, model, optimizer, ids)
    torch.cuda.synchronize()
    start_bytes = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = [_timed_step(config, dtype_name, model, optimizer, ids) for _ in range(s["steps"])]
    result = {"times": times, "peak_bytes": torch.cuda.max_memory_allocated(),
              "step_start_bytes": start_bytes}
    if s["profile"]:
        result["trace"] = _profile_step(config, dtype_name, model, optimizer, ids, s, rank)
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return result


def _keep_slowest_rank(measured: dict) -> None:
    """Every step's time and the peak memory become their maximum over the ranks."""
    import torch
    import torch.distributed as dist

    slowest = torch.tensor(measured["times"] + [measured["peak_bytes"]], dtype=torch.float64,
                           device="cuda")
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    measured["times"] = slowest[:-1].tolist()
    measured["peak_bytes"] = int(slowest[-1].item())


def _rank_program(rank: int, world: int, s: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")  # FSDP1's deprecation notice, our YaFSDP notes
    ids = models.batch(s, rank).cuda()
    runs = {d: {c: [] for c in CONFIGS} for d in s["dtypes"]}
    for repeat_index in range(s["repeats"]):
        shift = repeat_index % len(CONFIGS)
        order = CONFIGS[shift:] + CONFIGS[:shift]
        for dtype_name in s["dtypes"]:
            for config in order:
                profile = s["profile"] if repeat_index == s["repeats"] - 1 else None
                measured = _measure(config, dtype_name, {**s, "profile": profile}, ids, rank)
                _keep_slowest_rank(measured)
                runs[dtype_name][config].append(measured)
                schedule.log(rank, f"repeat {repeat_index + 1}/{s['repeats']} {dtype_name} "
                                    f"{config}: median {1000 * statistics.median(measured['times']):.1f}"
                                    f" ms, peak {measured['peak_bytes'] / 2**30:.2f} GiB")
    return runs


# -- the profile: communication overlapping compute ---------------------------------------------


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _covered(start, end, merged) -> float:
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in merged)


def comm_overlap(trace: dict) -> dict:
    """From a Chrome trace of GPU work: NCCL kernel time, the part of it during which a compute
    kernel runs on another stream, and the streams each kind ran on (times in ms)."""
    kernels = [e for e in trace.get("traceEvents", [])
               if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    comm = [e for e in kernels if "nccl" in e.get("name", "").lower()]
    compute = [e for e in kernels if "nccl" not in e.get("name", "").lower()]
    overlapped = 0.0
    for event in comm:
        stream = event.get("args", {}).get("stream")
        others = _union((c["ts"], c["ts"] + c["dur"]) for c in compute
                        if c.get("args", {}).get("stream") != stream)
        overlapped += _covered(event["ts"], event["ts"] + event["dur"], others)
    comm_us = sum(e["dur"] for e in comm)
    return {
        "comm_kernels": len(comm),
        "comm_ms": comm_us / 1000,
        "overlapped_ms": overlapped / 1000,
        "overlap_fraction": overlapped / comm_us if comm_us else None,
        "comm_streams": sorted({str(e.get("args", {}).get("stream")) for e in comm}),
        "compute_streams": sorted({str(e.get("args", {}).get("stream")) for e in compute}),
    }


# -- figures and report -------------------------------------------------------------------------


def summarize(s: dict, results: list[dict]) -> dict:
    """Figures from rank 0's results (times and peaks already the max over ranks)."""
    report = {"settings": s, "dtypes": {}}
    for dtype_name in s["dtypes"]:
        figs = {}
        for config in CONFIGS:
            runs = results[0][dtype_name][config]
            every_step = [t for run in runs for t in run["times"]]
            figs[config] = {
                "median_step_ms": 1000 * statistics.median(every_step),
                "repeat_medians_ms": [1000 * statistics.median(run["times"]) for run in runs],
                "peak_bytes": max(run["peak_bytes"] for run in runs),
                "step_start_bytes": max(run["step_start_bytes"] for run in runs),
            }
            trace = runs[-1].get("trace")
            if trace:
                with open(trace) as handle:
                    figs[config]["profile"] = {"trace": trace, **comm_overlap(json.load(handle))}
        plain = figs["plain"]["median_step_ms"]
        for config in CONFIGS:
            figs[config]["ratio_to_plain"] = figs[config]["median_step_ms"] / plain
        ours, fsdp2 = figs["ours"], figs["fsdp2"]
        targets = {
            "overhead_vs_plain": ours["ratio_to_plain"],
            # The 1.05x goal is stated for world 1; with more ranks it is reported, not judged.
            "overhead_met": ours["ratio_to_plain"] <= OVERHEAD_TARGET if s["nproc"] == 1 else None,
            "speed_vs_fsdp2_met": ours["median_step_ms"] <= fsdp2["median_step_ms"],
            "memory_vs_fsdp2_met": ours["peak_bytes"] <= fsdp2["peak_bytes"],
        }
        report["dtypes"][dtype_name] = {"configs": figs, "targets": targets}
    return report


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _profile_cells(profile) -> tuple[str, str]:
    """The report's "comm ms" and "overlap" cells ("-" without a profile or without NCCL work)."""
    if not profile:
        return "-", "-"
    fraction = profile["overlap_fraction"]
    return f"{profile['comm_ms']:.1f}", "-" if fraction is None else f"{100 * fraction:.0f}%"


def format_report(report: dict) -> str:
    from fsdp_bridge.text import table

    s = report["settings"]
    lines = [
        f"Llama {s['parameters'] / 1e9:.2f}B: hidden {s['hidden']}, {s['layers']} layers, "
        f"{s['heads']} heads ({s['kv_heads']} kv), intermediate {s['intermediate']}, vocab "
        f"{s['vocab']}, seq {s['seq']}, batch {s['batch']}/rank; world {s['nproc']} on NCCL",
        f"{s['repeats']} repeats x ({s['warmup']} warm-up + {s['steps']} timed steps per config, "
        "configs one after another); step time = slowest rank, median over all timed steps; "
        "peak = torch.cuda.max_memory_allocated over the timed steps, max over ranks; plain = "
        "the unsharded model (autocast under bf16), no communication",
    ]
    for dtype_name, entry in report["dtypes"].items():
        figs, targets = entry["configs"], entry["targets"]
        rows = []
        for config in CONFIGS:
            f = figs[config]
            rows.append([config, f"{f['median_step_ms']:.1f}", f"{f['ratio_to_plain']:.3f}",
                         f"{figs['ours']['median_step_ms'] / f['median_step_ms']:.3f}",
                         _gib(f["peak_bytes"]), _gib(f["step_start_bytes"]),
                         *_profile_cells(f.get("profile"))])
        lines += ["", f"{dtype_name}:",
                  *table(rows, ["config", "median ms", "x plain", "ours/this", "peak GiB",
                                "start GiB", "comm ms", "overlap"], right=range(1, 8)),
                  *timing_caveat(s)]
        lines.append(
            f"  targets: ours <= {OVERHEAD_TARGET} x plain {verdict(targets['overhead_met'])} "
            f"({targets['overhead_vs_plain']:.3f}); step time <= fsdp2 "
            f"{verdict(targets['speed_vs_fsdp2_met'])}; peak memory <= fsdp2 "
            f"{verdict(targets['memory_vs_fsdp2_met'])}"
        )
        traced = [f"{c}: {figs[c]['profile']['trace']}" for c in CONFIGS if figs[c].get("profile")]
        if traced:
            lines.append("  traces: " + "; ".join(traced))
    return "\n".join(lines)


def run(args) -> int:
    try:
        s = checked_settings(args, CUDA_DEFAULTS)  # bad options first, whatever the machine
        if getattr(args, "sweep", False) or getattr(args, "plot", None):
            raise ValueError("--sweep/--plot: the size sweep runs on the CPU bench only; drop "
                             "--device cuda, or drop --sweep/--plot")
        check_output_file("--json", args.json, stdout=True)
        problem = cuda_problem(s["nproc"])
        if problem:
            raise ValueError(problem)
        s = settings(args)
    except ValueError as exc:
        import sys

        print(f"fsdp-bridge bench: error: {exc}", file=sys.stderr)
        return 2
    report = summarize(s, schedule.run_world(s, _rank_program, CUDA_RANKS))
    print(format_report(report), file=human_stream(args.json))
    write_figures(args.json, report)
    return 0
