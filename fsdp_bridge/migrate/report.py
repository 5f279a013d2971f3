"""The `--report FILE` writer: every site, its rule code, how it was handled and why."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Sequence

from fsdp_bridge.codemods import rules
from fsdp_bridge.migrate.driver import FileResult
from fsdp_bridge.outputs import write_text

# Sites whose rewrite calls into fsdp_bridge: a runtime helper anywhere; under --to bridge every
# translated site (the mirrored module); under --to yafsdp the sites that name the YaFSDP class
# (its other in-place sites write torch's calls, or drop FSDP1 code).
_RUNTIME, _IN_PLACE = "translated via runtime helper", "translated in place"
_NAMES_YAFSDP = {rules.YAFSDP_IN_PLACE, rules.YAFSDP_TYPE_CHECK}


def _needs_package(site: dict, target: str) -> bool:
    if site["status"] == _RUNTIME:
        return True
    if site["status"] != _IN_PLACE:
        return False
    return target == "bridge" or (target == "yafsdp" and site["rule"] in _NAMES_YAFSDP)


def fsdp_bridge_sites(result: FileResult, target: str) -> int:
    """How many of the file's rewritten sites still import fsdp_bridge (0 means the migrated file
    needs torch alone)."""
    if not result.changed:
        return 0
    return sum(_needs_package(site, target) for site in result.sites)


def summary(results: Sequence[FileResult], target: str) -> dict:
    statuses = Counter(site["status"] for r in results for site in r.sites)
    return {
        "files": len(results),
        "parsed": sum(r.parsed for r in results),
        "changed": sum(r.changed for r in results),
        "errors": sum(r.error is not None for r in results),
        "sites": sum(statuses.values()),
        "by_status": dict(sorted(statuses.items())),
        "fsdp_bridge_sites": sum(fsdp_bridge_sites(r, target) for r in results),
    }


def _entries(results: Sequence[FileResult], target: str) -> list[dict]:
    return [
        {"path": r.path, "changed": r.changed, "error": r.error,
         "fsdp_bridge_sites": fsdp_bridge_sites(r, target),
         "sites": sorted(r.sites, key=lambda site: site["line"])}
        for r in results
        if r.sites or r.error or r.changed
    ]


def to_json(results: Sequence[FileResult], target: str) -> str:
    document = {"target": target, "summary": summary(results, target), "files": _entries(results, target)}
    return json.dumps(document, indent=2) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def to_markdown(results: Sequence[FileResult], target: str) -> str:
    totals = summary(results, target)
    lines = [
        f"# fsdp-bridge migrate --to {target}",
        "",
        f"{totals['files']} files, {totals['parsed']} parsed, {totals['changed']} changed, "
        f"{totals['errors']} errors, {totals['sites']} sites ("
        + ", ".join(f"{n} {status}" for status, n in totals["by_status"].items()) + ")"
        + f"; {totals['fsdp_bridge_sites']} rewritten sites still import fsdp_bridge",
        "",
    ]
    for entry in _entries(results, target):
        lines += [f"## {entry['path']}", ""]
        if entry["fsdp_bridge_sites"]:
            lines += [f"{entry['fsdp_bridge_sites']} rewritten sites still import fsdp_bridge.", ""]
        if entry["error"]:
            lines += [f"**error:** {_cell(entry['error'])}", ""]
        if entry["sites"]:
            lines += ["| line | rule | status | site | reason |", "|---:|---|---|---|---|"]
            for site in entry["sites"]:
                lines.append(
                    f"| {site['line']} | {site['rule']} | {site['status']} | "
                    f"`{_cell(site['what'])}` | {_cell(site['reason'])} |"
                )
            lines.append("")
    return "\n".join(lines)


def check_path(path: str) -> None:
    """Raise ValueError unless a report can be written at `path` (checked before any work)."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in (".json", ".md", ".markdown"):
        raise ValueError(f"--report {path!r}: unknown report format {extension or '(no suffix)'!r}; "
                         "the file name must end in .json or .md")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"--report {path!r}: the directory {directory} does not exist; create it first")
    if not os.access(directory, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--report {path!r}: not writable; pick another path")


def write(path: str, results: Sequence[FileResult], target: str) -> None:
    check_path(path)
    extension = os.path.splitext(path)[1].lower()
    text = to_json(results, target) if extension == ".json" else to_markdown(results, target)
    write_text(path, text)
