"""Render a comparison: a terminal table, JSON, and a PNG of loss curves and deviations.

Works for both kinds of report: `equivalence.Report` (backends of a recipe) and
`scripts.ScriptReport` (two scripts); both carry `title`, `settings`, `tolerance`,
`comparisons` (compare.Comparison), `curves()` and `exit_code`.
"""

from __future__ import annotations

import math
import sys
import textwrap
from typing import Optional

from fsdp_bridge import outputs
from fsdp_bridge.harness.compare import Comparison

TOP_PARAMS = 5


def _num(value: Optional[float], fmt: str = ".6f") -> str:
    if value is None:
        return "-"
    return format(value, fmt)


def _ratio(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.2g}"


def comparison_table(comparison: Comparison) -> list[str]:
    from fsdp_bridge.text import table

    lines = [f"{comparison.candidate} vs {comparison.baseline}  (columns *_tol: deviation / "
             "tolerance, ok <= 1)"]
    first = comparison.first_diverging_step
    rows = [[check.step, _num(check.loss), _num(check.baseline_loss), _ratio(check.loss_ratio),
             _ratio(check.grad_norm_ratio), _ratio(check.digest_ratio),
             "ok" if check.ok else ("DIVERGES (first)" if check.step == first else "differs")]
            for check in comparison.steps]
    if rows:
        lines += table(rows, ["step", "loss", "baseline", "loss_tol", "gnorm_tol", "digest_tol",
                              "verdict"], right=range(6), indent="")
    if comparison.params:
        lines.append(f"final state dict ({len(comparison.params)} tensors), most different:")
        lines += table([[diff.name, f"{diff.max_abs:.3g}", _ratio(diff.ratio),
                         "DIFFERS" if diff.ratio > 1 else ""]
                        for diff in comparison.params[:TOP_PARAMS]],
                       ["tensor", "max|diff|", "tol", ""], right=(1, 2), indent="    ")
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
    """The report as JSON to `path` ("-": stdout)."""
    outputs.write_json(path, to_json(report))


def save_plot(report, path: str) -> None:
    """Loss curves (top) and per-step deviation / tolerance on a log scale (bottom)."""
    import matplotlib.pyplot as plt

    figure = plot_figure(report)
    with outputs.atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=100)
    plt.close(figure)


# [Note: curves that coincide]
# Equivalent runs draw the same curve: drawn alike, the last one hides the others. Each run gets
# its own marker and dash pattern, and later runs are drawn thinner with smaller markers, so a
# curve under another still shows around it.
_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_DASHES = ("-", "--", "-.", ":")


def _style(index: int) -> dict:
    return {"marker": _MARKERS[index % len(_MARKERS)],
            "linestyle": _DASHES[index % len(_DASHES)],
            "markersize": max(3.0, 9.0 - 1.5 * index), "linewidth": max(0.8, 2.6 - 0.5 * index),
            "markerfacecolor": "none" if index else None}


def plot_figure(report):
    """The figure `save_plot` writes (a matplotlib Figure; close it when done)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    # One colour and one style per run in both panels: a run keeps its loss curve's look below.
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(report.curves())
    look = {name: {"color": colours[i % len(colours)], **_style(i)}
            for i, name in enumerate(names)}
    for name, curve in report.curves().items():
        points = [(step, loss) for step, loss in curve if loss is not None]
        top.plot([p[0] for p in points], [p[1] for p in points], label=name, **look[name])
    top.set_ylabel("loss")
    # Long titles (script paths) are wrapped rather than cut at the figure's edge.
    top.set_title(textwrap.fill(report.title, 70), fontsize=10)
    top.legend()
    for comparison in report.comparisons:
        steps = [c.step for c in comparison.steps]
        ratios = [max(c.ratio, 1e-12) if math.isfinite(c.ratio) else 1e12
                  for c in comparison.steps]
        bottom.semilogy(steps, ratios, label=comparison.candidate,
                        **look.get(comparison.candidate, _style(len(names))))
    bottom.axhline(1.0, color="red", linestyle="--", label="tolerance")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    bottom.set_xlabel("step")
    # Exact agreement (deviation 0) is drawn at the bottom of the axis, 1e-12.
    bottom.set_ylabel(f"deviation / tolerance ({report.tolerance.dtype}; 0 shown as 1e-12)")
    bottom.legend()
    figure.tight_layout()
    return figure


def show(report, json_path: Optional[str], plot_path: Optional[str], error_prefix: str) -> None:
    """What the compare commands print and write once a report is in: the table (on stderr when
    the JSON goes to stdout, `--json -`), each error (on stderr, after `error_prefix`), the
    --json / --plot files asked for, and where they were written."""
    text = outputs.human_stream(json_path)
    print(render_table(report), file=text)
    for error in report.errors:
        print(f"{error_prefix}{error}", file=sys.stderr)
    if json_path:
        write_json(report, json_path)
        if json_path != outputs.STDOUT:
            print(f"wrote the report as JSON to {json_path}", file=text)
    if plot_path:
        save_plot(report, plot_path)
        print(f"wrote the plot to {plot_path}", file=text)
