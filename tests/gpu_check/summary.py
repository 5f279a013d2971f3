"""The gpu-check summary: test outcomes read from pytest's junit XML (or, for a pytest killed at
its timeout, from its `-v` log), the bench table read from the bench's JSON (or its progress
lines), and the summary itself written as JSON and Markdown. Standard library only."""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ElementTree

SCHEMA = 1
OUTCOMES = ("passed", "failed", "error", "skipped")


# -- test outcomes -----------------------------------------------------------------------------


def first_line(text: str | None) -> str:
    """The first non-blank line of `text` ("" when there is none)."""
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()
    return ""


def _test_id(case) -> str:
    classname, name = case.get("classname", ""), case.get("name", "")
    return f"{classname}::{name}" if classname else name


def read_junit(path: str) -> dict:
    """Every test case of a pytest junit XML file: its outcome, and for a failure, an error or
    a skip the first line of the message (a skip's message is its reason)."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        entry = {"id": _test_id(case), "outcome": "passed", "seconds": float(case.get("time", 0))}
        for outcome in ("failure", "error", "skipped"):
            found = case.find(outcome)
            if found is not None:
                entry["outcome"] = {"failure": "failed"}.get(outcome, outcome)
                entry["first_line"] = first_line(found.get("message")) or first_line(found.text)
                break
        cases.append(entry)
    return tally(cases)


# pytest -v prints "path::test " before a test runs and its outcome after it.
_VERBOSE_LINE = re.compile(r"^(\S+::\S+(?:\[.*?\])?)\s*(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)?")


def read_verbose_log(path: str) -> dict:
    """The outcomes a `pytest -v` log shows, for a pytest that was killed before writing its
    junit file; `running` names the test that had started and not finished."""
    cases, running = [], None
    with open(path, errors="replace") as handle:
        for line in handle:
            match = _VERBOSE_LINE.match(line.strip())
            if not match:
                continue
            test_id, outcome = match.groups()
            if outcome is None:
                running = test_id
                continue
            running = None
            entry = {"id": test_id, "outcome": outcome.lower()}
            if entry["outcome"] not in OUTCOMES:
                entry["outcome"] = "skipped" if outcome == "XFAIL" else "passed"
            cases.append(entry)
    result = tally(cases)
    result["running_when_stopped"] = running
    result["source"] = "pytest -v log (no junit XML: pytest did not finish)"
    return result


def tally(cases: list[dict]) -> dict:
    return {"counts": {o: sum(c["outcome"] == o for c in cases) for o in OUTCOMES},
            "cases": cases}


# -- the bench table ---------------------------------------------------------------------------


def bench_table(report: dict) -> dict:
    """dtype -> config -> step time and peak memory, from `bench --json`'s figures (the CUDA
    bench gives one peak, the CPU bench one per rank: the largest is taken)."""
    table = {}
    for dtype_name, entry in report.get("dtypes", {}).items():
        rows = {}
        for config, figures in entry.get("configs", {}).items():
            peak = figures.get("peak_bytes", max(figures.get("peak_bytes_per_rank") or [0]))
            rows[config] = {"median_step_ms": figures["median_step_ms"], "peak_gib": peak / 2**30,
                            "ratio_to_plain": figures.get("ratio_to_plain")}
        table[dtype_name] = {"configs": rows, "targets": entry.get("targets", {})}
    return table


# The CUDA bench's progress line after each config of each repeat (fsdp_bridge/bench/cuda.py).
_BENCH_LINE = re.compile(r"repeat (\d+)/\d+ (\w+) (\w+): median ([\d.]+) ms, peak ([\d.]+) GiB")


def bench_table_from_log(path: str) -> dict:
    """The configs a bench killed before its JSON had measured, from its progress lines: the
    median step time of the last repeat seen and the largest peak."""
    table: dict = {}
    with open(path, errors="replace") as handle:
        for match in _BENCH_LINE.finditer(handle.read()):
            _, dtype_name, config, median_ms, peak_gib = match.groups()
            rows = table.setdefault(dtype_name, {"configs": {}, "targets": {}})["configs"]
            old_peak = rows.get(config, {}).get("peak_gib", 0.0)
            rows[config] = {"median_step_ms": float(median_ms),
                            "peak_gib": max(old_peak, float(peak_gib)), "ratio_to_plain": None}
    return table


# -- writing -----------------------------------------------------------------------------------


def write(folder: str, summary: dict) -> None:
    """summary.json and summary.md in `folder`, each replaced whole (never half written)."""
    _replace(os.path.join(folder, "summary.json"), json.dumps(summary, indent=2, default=str))
    _replace(os.path.join(folder, "summary.md"), markdown(summary))


def _replace(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as handle:
        handle.write(text + "\n")
    os.replace(path + ".tmp", path)


def markdown(summary: dict) -> str:
    lines = [f"# fsdp-bridge gpu-check ({summary['mode']})", "",
             f"Status: **{summary['status']}**; started {summary['started']}, updated "
             f"{summary['updated']}; budget {summary['budget_s']:.0f} s.", ""]
    lines += _environment_lines(summary.get("environment", {}))
    lines += _phase_lines(summary.get("phases", []))
    for phase, result in summary.get("tests", {}).items():
        lines += _test_lines(phase, result)
    if summary.get("bench"):
        lines += _bench_lines(summary["bench"])
    if summary.get("offload"):
        lines += ["## CPU offload", "", "```", json.dumps(summary["offload"], indent=2), "```", ""]
    if summary.get("frameworks"):
        lines += ["## Framework examples (one rank)", "", "```",
                  json.dumps(summary["frameworks"], indent=2), "```", ""]
    return "\n".join(lines)


def _environment_lines(env: dict) -> list[str]:
    if not env:
        return []
    lines = ["## Environment", "", "| what | value |", "|---|---|"]
    for key, value in env.items():
        if isinstance(value, (dict, list)):
            value = json.dumps(value)
        lines.append(f"| {key} | {_cell(value)} |")
    return lines + [""]


def _phase_lines(phases: list[dict]) -> list[str]:
    lines = ["## Phases", "", "| phase | status | exit | seconds | timeout s | peak GPU MiB | log |",
             "|---|---|---|---|---|---|---|"]
    for p in phases:
        seconds = "" if p.get("duration_s") is None else f"{p['duration_s']:.1f}"
        lines.append(f"| {p['name']} | {p['status']} | {_cell(p.get('exit_code'))} | {seconds} | "
                     f"{_cell(p.get('timeout_s'))} | {_cell(p.get('peak_gpu_memory_mib'))} | "
                     f"{_cell(p.get('log'))} |")
    notes = [f"- {p['name']}: {note}" for p in phases for note in p.get("notes", [])]
    return lines + [""] + notes + ([""] if notes else [])


def _test_lines(phase: str, result: dict) -> list[str]:
    counts = ", ".join(f"{n} {o}" for o, n in result["counts"].items())
    lines = [f"## Tests: {phase}", "", counts + "."]
    if result.get("source"):
        lines.append(f"Read from the {result['source']}.")
    if result.get("running_when_stopped"):
        lines.append(f"Running when the phase was stopped: `{result['running_when_stopped']}`.")
    lines.append("")
    for outcome in ("failed", "error", "skipped"):
        picked = [c for c in result["cases"] if c["outcome"] == outcome]
        if picked:
            lines += [f"{outcome}:", ""] + [
                f"- `{c['id']}`: {c.get('first_line', '')}" for c in picked] + [""]
    return lines


def _bench_lines(bench: dict) -> list[str]:
    lines = ["## Bench", ""]
    if bench.get("source"):
        lines += [f"Read from the {bench['source']}.", ""]
    for dtype_name, entry in bench.get("table", {}).items():
        lines += [f"{dtype_name}:", "", "| config | median step ms | x plain | peak GiB |",
                  "|---|---|---|---|"]
        for config, row in entry["configs"].items():
            ratio = row.get("ratio_to_plain")
            lines.append(f"| {config} | {row['median_step_ms']:.1f} | "
                         f"{'' if ratio is None else f'{ratio:.3f}'} | {row['peak_gib']:.2f} |")
        if entry.get("targets"):
            lines += ["", "targets: `" + json.dumps(entry["targets"]) + "`"]
        lines.append("")
    return lines


def _cell(value) -> str:
    return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")
