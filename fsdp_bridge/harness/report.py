"""Render a comparison: a terminal table, JSON, and a PNG of loss curves and deviations.

Works for both kinds of report: `equivalence.Report` (backends of a recipe) and
`scripts.ScriptReport` (two scripts); both carry `title`, `settings`, `tolerance`,
`comparisons` (compare.Comparison), `curves()` and `exit_code`.
"""

from __future__ import annotations

import json
import math
import textwrap
from typing import Optional

from fsdp_bridge.harness.compare import Comparison
from fsdp_bridge.outputs import atomic_path, write_text

TOP_PARAMS = 5


def _num(value: Optional[float], fmt: str = ".6f") -> str:
    if value is None:
        return "-"
    return format(value, fmt)


def _ratio(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2g}"


def comparison_table(comparison: Comparison) -> list[str]:
    lines = [f"{comparison.candidate} vs {comparison.baseline}  (columns *_tol: deviation / "
             "tolerance, ok <= 1)"]
    if comparison.steps:
        lines.append(f"{'step':>5} {'loss':>12} {'baseline':>12} {'loss_tol':>9} "
                     f"{'gnorm_tol':>9} {'digest_tol':>10}  verdict")
    first = comparison.first_diverging_step
    for check in comparison.steps:
        verdict = "ok" if check.ok else ("DIVERGES (first)" if check.step == first
                                         else "differs")
        lines.append(f"{check.step:>5} {_num(check.loss):>12} {_num(check.baseline_loss):>12} "
                     f"{_ratio(check.loss_ratio):>9} {_ratio(check.grad_norm_ratio):>9} "
                     f"{_ratio(check.digest_ratio):>10}  {verdict}")
    if comparison.params:
        lines.append(f"final state dict ({len(comparison.params)} tensors), most different:")
        for diff in comparison.params[:TOP_PARAMS]:
            lines.append(f"    {diff.name:<48} max|diff| {diff.max_abs:.3g}  "
                         f"tol {_ratio(diff.ratio)}{'  DIFFERS' if diff.ratio > 1 else ''}")
    lines += [f"  ! {problem}" for problem in comparison.problems]
    label = {"equivalent": "AGREE  ", "different": "DIFFER ", "inconclusive": "CANNOT TELL "}
    lines.append(label[comparison.outcome] + comparison.summary())
    return lines


def render_table(report) -> str:
    settings = ", ".join(f"{key} {value}" for key, value in report.settings.items())
    lines = [f"== {report.title} ==", settings, f"tolerance: {report.tolerance.describe()}"]
    for note in getattr(report, "notes", []):
        lines.append(f"note: {note}")
    for comparison in report.comparisons:
        lines.append("")
        lines += comparison_table(comparison)
    lines.append("")
    lines.append({0: "RESULT: equivalent", 1: "RESULT: NOT equivalent", 2: "RESULT: error",
                  3: "RESULT: inconclusive (cannot tell)"}[report.exit_code])
    return "\n".join(lines)


def _comparison_json(comparison: Comparison) -> dict:
    return {
        "baseline": comparison.baseline,
        "candidate": comparison.candidate,
        "ok": comparison.ok,
        "outcome": comparison.outcome,
        "sensitivity": comparison.sensitivity,
        "advice": comparison.advice if comparison.outcome == "inconclusive" else None,
        "first_diverging_step": comparison.first_diverging_step,
        "steps": [{"step": c.step, "loss": c.loss, "baseline_loss": c.baseline_loss,
                   "loss_ratio": c.loss_ratio, "grad_norm_ratio": c.grad_norm_ratio,
                   "digest_ratio": c.digest_ratio, "ok": c.ok} for c in comparison.steps],
        "params_most_different": [vars(diff) for diff in comparison.params[:TOP_PARAMS]],
        "problems": comparison.problems,
    }


def to_json(report) -> dict:
    return {
        "title": report.title,
        "settings": report.settings,
        "tolerance": vars(report.tolerance) | {"rule": report.tolerance.describe()},
        "curves": report.curves(),
        "comparisons": [_comparison_json(c) for c in report.comparisons],
        "notes": list(getattr(report, "notes", [])),
        "ok": report.ok,
        "exit_code": report.exit_code,
    }


def write_json(report, path: str) -> None:
    # inf and NaN are not JSON; write them as strings so any JSON reader can load the file.
    write_text(path, json.dumps(_finite(to_json(report)), indent=2))


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def save_plot(report, path: str) -> None:
    """Loss curves (top) and per-step deviation / tolerance on a log scale (bottom)."""
    import matplotlib.pyplot as plt

    figure = plot_figure(report)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=100)
    plt.close(figure)


def plot_figure(report):
    """The figure `save_plot` writes (a matplotlib Figure; close it when done)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    # One colour per run in both panels: a run keeps the colour of its loss curve below.
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour_of = {name: colours[i % len(colours)] for i, name in enumerate(report.curves())}
    for name, curve in report.curves().items():
        points = [(step, loss) for step, loss in curve if loss is not None]
        top.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name,
                 color=colour_of[name])
    top.set_ylabel("loss")
    # Long titles (script paths) are wrapped rather than cut at the figure's edge.
    top.set_title(textwrap.fill(report.title, 70), fontsize=10)
    top.legend()
    for comparison in report.comparisons:
        steps = [c.step for c in comparison.steps]
        ratios = [max(c.ratio, 1e-12) if math.isfinite(c.ratio) else 1e12
                  for c in comparison.steps]
        bottom.semilogy(steps, ratios, marker="o", label=comparison.candidate,
                        color=colour_of.get(comparison.candidate))
    bottom.axhline(1.0, color="red", linestyle="--", label="tolerance")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    bottom.set_xlabel("step")
    # Exact agreement (deviation 0) is drawn at the bottom of the axis, 1e-12.
    bottom.set_ylabel(f"deviation / tolerance ({report.tolerance.dtype}; 0 shown as 1e-12)")
    bottom.legend()
    figure.tight_layout()
    return figure


def show(report, json_path: Optional[str], plot_path: Optional[str], error_prefix: str) -> None:
    """What the compare commands print and write once a report is in: the table, each error
    (on stderr, after `error_prefix`), and the --json / --plot files asked for."""
    import sys

    print(render_table(report))
    for error in report.errors:
        print(f"{error_prefix}{error}", file=sys.stderr)
    if json_path:
        write_json(report, json_path)
    if plot_path:
        save_plot(report, plot_path)
