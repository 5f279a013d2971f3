"""`fsdp-bridge bench --sweep`: the CPU bench at several model sizes, so that the way the cost of
sharding grows with the model is visible: one table of ratios per size, and a PNG of step time,
peak memory per rank in a step and while wrapping (the `init` figure) against the parameter
count. The table also gives the unsharded fp32 weights beside each wrap peak.

Each size is a full bench run of its own (a fresh world, the configs interleaved step by step
inside it), so every ratio compares configs measured side by side; figures of different sizes
come from different runs and are compared only through their ratios.
"""

from __future__ import annotations

import sys

from fsdp_bridge import tiny
from fsdp_bridge.bench import models, schedule
from fsdp_bridge.bench import report as bench_report

# (hidden, layers, vocab): the default tiny Llama, then two larger ones. Attention heads are
# 64 wide at every size.
SIZES = ((256, 4, 1000), (512, 8, 4000), (1024, 8, 8000))
HEAD_DIM = 64
PLOTTED = ("fsdp1", "fsdp2", "ours", "plain")


def size_settings(s: dict, hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // HEAD_DIM
    return dict(s, hidden=hidden, layers=layers, vocab=vocab, heads=heads, kv_heads=heads,
                intermediate=4 * hidden)


def run_sweep(s: dict, run_world=schedule.run_world) -> list[dict]:
    """One bench report per size, each with its parameter count."""
    reports = []
    for hidden, layers, vocab in SIZES:
        settings = size_settings(s, hidden, layers, vocab)
        print(f"[bench] sweep: hidden {hidden}, {layers} layers, vocab {vocab}", file=sys.stderr,
              flush=True)
        report = bench_report.summarize(settings, run_world(settings))
        report["parameters"] = tiny.parameter_count(models.llama_config(settings))
        reports.append(report)
    return reports


def format_sweep(reports: list[dict]) -> str:
    lines = ["sweep: ratios measured side by side within each size's run",
             f"  {'size':16s}{'params':>8s}{'dtype':>6s}{'ours/faster native':>20s}"
             f"{'ours/plain':>12s}{'peak ours/fsdp2':>17s}{'peak MiB fsdp2':>16s}"
             f"{'peak MiB ours':>15s}{'weights MiB':>13s}{'init MiB fsdp1':>16s}"
             f"{'init MiB ours':>15s}"]
    for report in reports:
        s = report["settings"]
        size = f"{s['hidden']}x{s['layers']} v{s['vocab']}"
        for dtype_name, entry in report["dtypes"].items():
            targets, figs = entry["targets"], entry["configs"]
            peak_ratio = targets["peak_ratio_to_fsdp2"]
            lines.append(
                f"  {size:16s}{report['parameters'] / 1e6:7.1f}M{dtype_name:>6s}"
                f"{targets['speed_ratio_to_faster_native']:20.2f}"
                f"{targets['compute_only_ratio']:12.2f}"
                f"{'n/a' if peak_ratio is None else f'{peak_ratio:.3f}':>17s}"
                f"{bench_report.mib(max(figs['fsdp2']['peak_bytes_per_rank'])):>16s}"
                f"{bench_report.mib(max(figs['ours']['peak_bytes_per_rank'])):>15s}"
                f"{bench_report.mib(report['parameters'] * 4):>13s}"
                f"{bench_report.mib(max(figs['fsdp1']['init_peak_bytes_per_rank'])):>16s}"
                f"{bench_report.mib(max(figs['ours']['init_peak_bytes_per_rank'])):>15s}"
            )
    return "\n".join(lines)


def plot_sweep(reports: list[dict], path: str) -> None:
    """Step time and peak memory per rank against the parameter count, one line per config and
    dtype, written to `path` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    figure, (time_axis, memory_axis, init_axis) = plt.subplots(1, 3, figsize=(15, 4.2))
    millions = [report["parameters"] / 1e6 for report in reports]
    for dtype_name in reports[0]["dtypes"]:
        for config in PLOTTED:
            figs = [report["dtypes"][dtype_name]["configs"][config] for report in reports]
            label = f"{config} {dtype_name}"
            time_axis.plot(millions, [f["median_step_ms"] for f in figs], marker="o", label=label)
            memory_axis.plot(millions, [max(f["peak_bytes_per_rank"]) / 2**20 for f in figs],
                             marker="o", label=label)
            init_axis.plot(millions, [max(f["init_peak_bytes_per_rank"]) / 2**20 for f in figs],
                           marker="o", label=label)
    init_axis.plot(millions, [4 * m * 1e6 / 2**20 for m in millions], linestyle="--",
                   color="grey", label="unsharded fp32 weights")
    for axis, title, unit in ((time_axis, "step time (median)", "ms"),
                              (memory_axis, "peak memory per rank, step", "MiB"),
                              (init_axis, "peak memory per rank, wrap from meta", "MiB")):
        axis.set(title=title, xlabel="parameters (millions)", ylabel=unit, xscale="log",
                 yscale="log")
        axis.grid(True, which="both", alpha=0.3)
    memory_axis.legend(fontsize=7)
    init_axis.legend(fontsize=7)
    world = reports[0]["settings"]["nproc"]
    figure.suptitle(f"fsdp-bridge bench --sweep: world {world} on gloo, CPU")
    figure.tight_layout()
    figure.savefig(path, format="png", dpi=110)
    plt.close(figure)
