"""`fsdp-bridge bench --sweep`: the CPU bench at several model sizes, so that the way the cost of
sharding grows with the model is visible: one table of ratios per size, and a PNG of step time,
peak memory per rank in a step and while wrapping (the `init` figure) against the parameter
count. The table also gives the unsharded fp32 weights beside each wrap peak.

The sweep is drawn against one rank's memory cap (`--cap-mib`): its largest size holds more fp32
weights than the cap, so the unsharded model would not fit on one rank there, and a second table
says which configs' wrap and step peaks stay under the cap at each size. The cap is a line on the
plot, not a limit set on the ranks: `tests/test_memory_cap.py` trains under a real one.

Each size is a full bench run of its own (a fresh world, the configs interleaved step by step
inside it), so every ratio compares configs measured side by side; figures of different sizes
come from different runs and are compared only through their ratios.
"""

from __future__ import annotations

import sys

from fsdp_bridge import tiny
from fsdp_bridge.bench import models, schedule
from fsdp_bridge.bench import report as bench_report
from fsdp_bridge.outputs import atomic_path

# (hidden, layers, vocab): the default tiny Llama, then two larger ones. Attention heads are
# 64 wide at every size.
SIZES = ((256, 4, 1000), (512, 8, 4000), (1024, 8, 8000))
HEAD_DIM = 64
PLOTTED = ("fsdp1", "fsdp2", "ours", "plain")


def size_settings(s: dict, hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // HEAD_DIM
    return dict(s, hidden=hidden, layers=layers, vocab=vocab, heads=heads, kv_heads=heads,
                intermediate=4 * hidden)


def _weights_mib(settings: dict) -> float:
    """The unsharded fp32 weights of the model these settings build, in MiB."""
    return 4 * tiny.parameter_count(models.llama_config(settings)) / 2**20


def check_cap(s: dict, cap_mib: float) -> None:
    """The sweep must reach past the cap: its largest model's fp32 weights must exceed it."""
    largest = size_settings(s, *SIZES[-1])
    weights = _weights_mib(largest)
    if weights <= cap_mib:
        raise ValueError(
            f"--cap-mib {cap_mib:g}: the sweep's largest model (hidden {largest['hidden']}, "
            f"{largest['layers']} layers) holds {weights:.0f} MiB of fp32 weights, under the cap, so "
            f"no size would be too large for one rank; choose a cap below {weights:.0f} MiB")


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
    from fsdp_bridge.text import table

    rows = []
    for report in reports:
        s = report["settings"]
        for dtype_name, entry in report["dtypes"].items():
            targets, figs = entry["targets"], entry["configs"]
            peak_ratio = targets["peak_ratio_to_fsdp2"]
            rows.append([
                f"{s['hidden']}x{s['layers']} v{s['vocab']}", f"{report['parameters'] / 1e6:.1f}M",
                dtype_name, f"{targets['speed_ratio_to_faster_native']:.2f}",
                f"{targets['compute_only_ratio']:.2f}",
                "n/a" if peak_ratio is None else f"{peak_ratio:.3f}",
                bench_report.mib(max(figs["fsdp2"]["peak_bytes_per_rank"])),
                bench_report.mib(max(figs["ours"]["peak_bytes_per_rank"])),
                bench_report.mib(report["parameters"] * 4),
                bench_report.mib(max(figs["fsdp1"]["init_peak_bytes_per_rank"])),
                bench_report.mib(max(figs["ours"]["init_peak_bytes_per_rank"])),
            ])
    headers = ["size", "params", "dtype", "ours/faster native", "ours/plain", "peak ours/fsdp2",
               "peak MiB fsdp2", "peak MiB ours", "weights MiB", "init MiB fsdp1",
               "init MiB ours"]
    return "\n".join(["sweep: ratios measured side by side within each size's run",
                      *table(rows, headers, right=range(1, len(headers)))])


def _mib_cell(mib: float, cap_mib: float) -> str:
    return f"{mib:.0f}{'*' if mib > cap_mib else ''}"


def _peaks_cell(figures: dict, cap_mib: float) -> str:
    """'wrap / step' peak per rank of one config, in MiB."""
    wrap, step = (max(figures[key]) / 2**20 for key in ("init_peak_bytes_per_rank", "peak_bytes_per_rank"))
    return f"{_mib_cell(wrap, cap_mib)} / {_mib_cell(step, cap_mib)}"


def format_cap(reports: list[dict], cap_mib: float) -> str:
    """Per size and dtype: the unsharded fp32 weights and each config's wrap / step peak per rank,
    with * on every figure above the cap."""
    from fsdp_bridge.text import table

    world = reports[0]["settings"]["nproc"]

    rows = []
    for report in reports:
        s = report["settings"]
        weights = _mib_cell(4 * report["parameters"] / 2**20, cap_mib)
        for dtype_name, entry in report["dtypes"].items():
            rows.append([f"{s['hidden']}x{s['layers']} v{s['vocab']}", dtype_name, weights,
                         *(_peaks_cell(entry["configs"][c], cap_mib) for c in PLOTTED)])
    lines = [f"per-rank cap {cap_mib:g} MiB at world {world}: wrap peak / step peak per rank in "
             "MiB, * above the cap",
             *table(rows, ["size", "dtype", "fp32 weights", *PLOTTED],
                    right=range(1, 3 + len(PLOTTED)))]
    return "\n".join(lines)


def plot_sweep(reports: list[dict], path: str, cap_mib: float | None = None) -> None:
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
    if cap_mib is not None:
        for axis in (memory_axis, init_axis):
            axis.axhline(cap_mib, color="red", linestyle=":", label=f"per-rank cap {cap_mib:g} MiB")
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
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format="png", dpi=110)
    plt.close(figure)
