"""torch's own `fully_shard` tests, run natively and through `fsdp_bridge.fsdp`, on CPU + gloo.

torch's test files are not in its wheel (its test helpers, `torch.testing._internal`, are):
put the `test_fully_shard_*.py` files of a torch version whose helpers match the installed
torch in a folder outside this repository, and point this script at it:

    .venv/bin/python benchmarks/torch_fully_shard_tests.py /tmp/torch_fsdp_tests/files \
        [--only test_fully_shard_init.py ...] [--select CLASS[::TEST] ...] [--max-world 4] \
        [--test-timeout S] [--native-from FILE] [--out DIR] [--json FILE]

Each file is copied twice into `--out` and run with pytest, one file at a time:

  native  the file with a CPU prelude (below);
  ours    the same, with its imports of FSDP2's public names (`fully_shard`, `FSDPModule`,
          `MixedPrecisionPolicy`, `CPUOffloadPolicy`, `OffloadPolicy`, `register_fsdp_forward_method`,
          `UnshardHandle`, `share_comm_ctx`, `DataParallelMeshDims`), from any of the paths torch
          offers them under, pointed at `fsdp_bridge.fsdp`, and its spelled-out
          `torch.distributed.fsdp.fully_shard` too. Imports of torch's private modules stay.
          Only the tests that passed natively are run.

[Note: the CPU prelude] torch's tests are written for accelerators. So that the most of them
run on a CPU-only torch, both copies begin with a prelude that (1) lets every test decorated
`skip_if_lt_x_gpu(n)` run (one that truly needs a GPU then fails natively and is not counted),
(2) lifts the multi-process base class's "fewer accelerators than ranks" skip, (3) caps the
rank count of multi-process test classes at `--max-world` (threaded classes keep theirs: they
are cheap) and has `torch.cpu.device_count()` (what classes asking for "as many ranks as
devices" read) say that cap, (4) has `torch.accelerator.current_accelerator()` name the CPU
rather than None (files that read its `.type` at import), and (5) runs `compiled_fsdp_test`
tests once, eagerly, with the module's own `fully_shard` (torch's decorator swaps torch's
`fully_shard` into the module; with no Triton it runs only that eager pass anyway). Both
copies get the same prelude, so the comparison is fair.

Long files (test_fully_shard_training.py runs for over an hour natively on 2 cores): run them
a class at a time with `--select`, keep the native outcomes with `--json` and give them back
with `--native-from` (only the tests that passed natively run through ours), and stop a test
that hangs with `--test-timeout`. torch's own harness fails a multi-process test that runs
past `DISTRIBUTED_TESTS_DEFAULT_TIMEOUT` seconds (300 by default; its ranks then report "timed
out"): on a loaded machine some tests of that file need more, natively and through ours alike,
so set that variable for the run (both copies read it).

Printed: per file, the tests that passed natively, those that pass through ours, and each test
that passed natively but fails through ours with the first line of its error, marked `private`
where the error is a read of torch's private FSDP state (our modules keep none; see
`ForwardHooks` in fsdp_bridge/fsdp/_fully_shard.py). The split between private-state reads and
real differences is for a person to confirm; the marks are a first sort.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# Where torch offers FSDP2's public names.
TORCH_PATHS = (
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
)
PUBLIC_NAMES = frozenset({
    "fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
    "MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy", "share_comm_ctx",
    "DataParallelMeshDims",
})

PRELUDE = '''
# --- CPU prelude (benchmarks/torch_fully_shard_tests.py) ---
import inspect as _bridge_inspect
import torch as _bridge_torch
import torch.testing._internal.common_distributed as _bridge_distributed
import torch.testing._internal.common_fsdp as _bridge_fsdp_helpers


def _bridge_run_anyway(*args, **kwargs):
    return lambda test: test


def _bridge_eager_once(compile_compute_on_module=None):
    return lambda test: test


_bridge_distributed.skip_if_lt_x_gpu = _bridge_run_anyway
_bridge_fsdp_helpers.skip_if_lt_x_gpu = _bridge_run_anyway
_bridge_fsdp_helpers.compiled_fsdp_test = _bridge_eager_once
_bridge_torch.accelerator.device_count = lambda: 1 << 10
_BRIDGE_MAX_WORLD = {max_world}
_bridge_torch.cpu.device_count = lambda: _BRIDGE_MAX_WORLD
_bridge_current_accelerator = _bridge_torch.accelerator.current_accelerator


def _bridge_accelerator_or_cpu(*args, **kwargs):
    found = _bridge_current_accelerator(*args, **kwargs)
    return found if found is not None else _bridge_torch.device("cpu")


_bridge_torch.accelerator.current_accelerator = _bridge_accelerator_or_cpu


def _bridge_cap_worlds(namespace):
    base = _bridge_distributed.MultiProcessTestCase
    continuous = getattr(_bridge_distributed, "MultiProcContinuousTest", None)
    for value in list(namespace.values()):
        if not isinstance(value, type):
            continue
        if issubclass(value, base):
            own = _bridge_inspect.getattr_static(value, "world_size")
            if isinstance(own, property):
                value.world_size = property(
                    lambda self, _own=own: min(_own.fget(self), _BRIDGE_MAX_WORLD))
            else:
                value.world_size = min(own, _BRIDGE_MAX_WORLD)
        elif continuous is not None and issubclass(value, continuous):
            value.world_size = min(value.world_size, _BRIDGE_MAX_WORLD)
# --- end of the CPU prelude ---
'''
CAP_WORLDS = "\n\n_bridge_cap_worlds(globals())\n"
OURS_IMPORT = "import fsdp_bridge.fsdp\n"

# An error that says torch's private FSDP state was read (see the module's docstring).
PRIVATE_MARKS = (
    "keeps no torch FSDPState",
    "_fsdp_param_group",
    "_fsdp_param_groups",
    "_get_fsdp_state",
    "_state_ctx",
    "_lazy_init",
    "fsdp_params",
    "_all_gather_result",
    "FSDPParam",
)


def _insert_at_top(source: str, text: str) -> str:
    """`text` after the module's docstring and `from __future__` imports."""
    tree = ast.parse(source)
    line = 0
    for node in tree.body:
        is_docstring = (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                        and isinstance(node.value.value, str))
        is_future = isinstance(node, ast.ImportFrom) and node.module == "__future__"
        if not (is_docstring or is_future):
            break
        line = node.end_lineno or line
    lines = source.splitlines(keepends=True)
    return "".join(lines[:line]) + text + "".join(lines[line:])


def _before_main(source: str, text: str) -> str:
    """`text` before the `if __name__ == "__main__":` block (or at the end)."""
    match = re.search(r"^if __name__ == .__main__.:", source, flags=re.MULTILINE)
    if match is None:
        return source + text
    return source[: match.start()] + text.lstrip("\n") + "\n\n" + source[match.start():]


def point_imports_at_ours(source: str) -> tuple[str, list[str]]:
    """The source with FSDP2's public names imported from fsdp_bridge.fsdp; returns it and
    the names moved."""
    import fsdp_bridge.fsdp as ours

    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    moved: list[str] = []
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.ImportFrom) and node.module in TORCH_PATHS):
            continue
        mine = [a for a in node.names if a.name in PUBLIC_NAMES and hasattr(ours, a.name)]
        if not mine:
            continue
        rest = [a for a in node.names if a not in mine]
        indent = " " * node.col_offset
        text = ""
        if rest:
            text += f"{indent}from {node.module} import {_aliases(rest)}\n"
        text += f"{indent}from fsdp_bridge.fsdp import {_aliases(mine)}\n"
        edits.append((node.lineno, node.end_lineno, text))
        moved.extend(a.name for a in mine)
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1 : end] = [text]
    rewritten = "".join(lines).replace("torch.distributed.fsdp.fully_shard",
                                       "fsdp_bridge.fsdp.fully_shard")
    return rewritten, sorted(set(moved))


def _aliases(names) -> str:
    return ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in names)


def prepared(source: str, max_world: int, ours: bool) -> str:
    moved: list[str] = []
    if ours:
        source, moved = point_imports_at_ours(source)
    prelude = PRELUDE.format(max_world=max_world) + (OURS_IMPORT if ours else "")
    return _before_main(_insert_at_top(source, prelude), CAP_WORLDS)


def collected(path: Path, env: dict) -> tuple[list[str], str]:
    """The test ids pytest collects from `path`, in order, and the last error line pytest
    printed (why nothing was collected: a missing module such as expecttest, an import that
    this torch lacks)."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(path.name)], cwd=path.parent, env=env, capture_output=True, text=True, check=False)
    errors = [line.strip() for line in (done.stdout + done.stderr).splitlines()
              if line.startswith("E ") or "Error" in line]
    return ([line.strip() for line in done.stdout.splitlines() if "::" in line],
            errors[-1] if errors else "")


def run_tests(path: Path, ids: list[str], env: dict, timeout: float, log: Path,
              test_timeout: float | None = None) -> dict:
    """{test id: (outcome, first error line)} for `ids` of `path`, one pytest process at a
    time, its output streamed into `log`; a process that runs out of time (`timeout` in all,
    or `test_timeout` on one test) marks the test it was in TIMEOUT and goes on without it."""
    results: dict[str, tuple[str, str]] = {}
    left = list(ids)
    log.write_text("")
    while left:
        report = log.with_suffix(f".{len(results)}.xml")
        command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                   f"--junitxml={report}", "-o", "junit_family=xunit2", *left]
        start = log.stat().st_size
        with log.open("a") as out:
            overrun = _run_watched(command, path.parent, env, out, log, start, timeout,
                                   test_timeout)
            if overrun:
                out.write(f"\n--- {overrun}\n")
        if overrun:
            with log.open() as written:
                written.seek(start)
                finished = _from_verbose(written.read())
            results.update(finished)
            remaining = [t for t in left if t not in finished]
            if remaining:
                results[remaining[0]] = ("TIMEOUT", overrun)
            left = remaining[1:]
            continue
        results.update(_from_junit(report, path.name))
        for test_id in left:  # not reported at all (a crash of the process)
            results.setdefault(test_id, ("ERROR", "no result (the process died)"))
        left = []
    return results


def _run_watched(command, cwd, env, out, log: Path, start: int, timeout: float,
                 test_timeout: float | None) -> str:
    """Runs `command` (its output into `out`), in a session of its own so that a stop ends
    its ranks too; stops it once it has run `timeout` seconds, or `test_timeout` seconds since
    the last test result it printed. Returns why it was stopped, "" when it ended alone."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    started = last_progress = time.monotonic()
    seen = 0
    while process.poll() is None:
        time.sleep(2)
        now = time.monotonic()
        with log.open() as written:
            written.seek(start)
            count = len(_from_verbose(written.read()))
        if count != seen:
            seen, last_progress = count, now
        if now - started > timeout:
            why = f"over {timeout:.0f} s in all"
        elif test_timeout is not None and now - last_progress > test_timeout:
            why = f"over {test_timeout:.0f} s on one test"
        else:
            continue
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"stopped: {why}"
    return ""


def _from_junit(report: Path, file_name: str) -> dict:
    results = {}
    if not report.exists():
        return results
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        test_class = case.get("classname", "").rpartition(".")[2]
        test_id = f"{file_name}::{test_class}::{case.get('name')}"
        outcome, message = "PASSED", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag.upper() if child.tag == "error" else "FAILED"
                message = _first_error_line(child.text or child.get("message", "") or "")
            elif child.tag == "skipped":
                outcome, message = "SKIPPED", (child.get("message") or "")[:160]
        results[test_id] = (outcome, message)
    return results


def _from_verbose(text: str) -> dict:
    results = {}
    for match in re.finditer(r"^(\S+::\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", text,
                             flags=re.MULTILINE):
        results[match.group(1)] = (match.group(2), "")
    return results


def _first_error_line(text: str) -> str:
    """The most telling line of a failure: the last error pytest reports (`E   ...Error: ...`)
    that is not a rank's or thread's wrapper around the real one, else the first line."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Unsupported)\b", line)
              and not re.search(r"(Thread|Process) \d+ exit", line)]
    if errors:
        return errors[-1][:300]
    first = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[-1] if lines else first[0] if first else "")[:300]


def is_private(message: str) -> bool:
    return any(mark in message for mark in PRIVATE_MARKS)


def run_file(source_path: Path, out: Path, args, env: dict, native=None) -> dict:
    """Both runs of one file (see the module's docstring); `native`: the native outcomes of an
    earlier run ({test id: [outcome, error]}) to take instead of running them again."""
    source = source_path.read_text()
    native_dir, ours_dir = out / "native", out / "ours"
    for folder in (native_dir, ours_dir):
        folder.mkdir(parents=True, exist_ok=True)
    native_path = native_dir / source_path.name
    ours_path = ours_dir / source_path.name
    native_path.write_text(prepared(source, args.max_world, ours=False))
    ours_path.write_text(prepared(source, args.max_world, ours=True))
    ids, error = collected(native_path, env)
    if args.select:
        ids = [t for t in ids if any(pattern in t for pattern in args.select)]
    if not ids:
        return {"file": source_path.name,
                "error": f"nothing collected: {error or 'pytest printed no error'}"}
    if native is None:
        native = run_tests(native_path, ids, env, args.timeout,
                           out / f"{source_path.stem}.native.log", args.test_timeout)
    passing = [t for t, (outcome, _) in native.items() if outcome == "PASSED" and t in ids]
    ours = run_tests(ours_path, passing, env, args.timeout, out / f"{source_path.stem}.ours.log",
                     args.test_timeout) if passing else {}
    differences = {t: ours[t] for t in passing if ours.get(t, ("",))[0] != "PASSED"}
    return {
        "file": source_path.name,
        "collected": len(ids),
        "native": {t: list(r) for t, r in native.items() if t in ids},
        "native_passed": len(passing),
        "ours_passed": len(passing) - len(differences),
        "differences": {t: {"outcome": r[0], "error": r[1], "private": is_private(r[1])}
                        for t, r in differences.items()},
    }


def print_table(records: list[dict]) -> None:
    print(f"\n{'file':44} {'collected':>9} {'native':>7} {'ours':>5} {'private?':>8} "
          f"{'other':>6}")
    totals = [0, 0, 0, 0, 0]
    for record in records:
        if "error" in record:
            print(f"{record['file']:44} {record['error']}")
            continue
        private = sum(d["private"] for d in record["differences"].values())
        other = len(record["differences"]) - private
        row = [record["collected"], record["native_passed"], record["ours_passed"], private,
               other]
        totals = [a + b for a, b in zip(totals, row)]
        print(f"{record['file']:44} {row[0]:>9} {row[1]:>7} {row[2]:>5} {row[3]:>8} {row[4]:>6}")
    print(f"{'total':44} {totals[0]:>9} {totals[1]:>7} {totals[2]:>5} {totals[3]:>8} "
          f"{totals[4]:>6}")
    for record in records:
        for test_id, diff in record.get("differences", {}).items():
            mark = "private" if diff["private"] else "other"
            print(f"  [{mark}] {test_id}: {diff['outcome']} {diff['error']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a folder of torch's test_fully_shard_*.py")
    parser.add_argument("--only", nargs="*", default=None, help="file names to run")
    parser.add_argument("--max-world", type=int, default=4,
                        help="cap on the ranks of multi-process test classes (default 4)")
    parser.add_argument("--timeout", type=float, default=3600,
                        help="seconds one pytest process may run (default 3600)")
    parser.add_argument("--test-timeout", type=float, default=None,
                        help="seconds one test may run (the first of a pytest process: with "
                        "pytest's start and collection); it is then marked TIMEOUT and the run "
                        "goes on with the next (default: no limit)")
    parser.add_argument("--select", nargs="*", default=None,
                        help="run only the test ids containing one of these (a class name, "
                        "Class::test_name)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/fully_shard_torch_tests"),
                        help="where the prepared copies and logs go")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--native-from", type=Path, default=None, help="a --json file of an "
                        "earlier run: take its native outcomes instead of running them again")
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob("test_fully_shard_*.py"))
    if args.only:
        files = [f for f in files if f.name in set(args.only)]
    if not files:
        parser.error(f"no test_fully_shard_*.py in {args.folder}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]))
    earlier = {}
    if args.native_from is not None:
        earlier = {r["file"]: r["native"] for r in json.loads(args.native_from.read_text())
                   if "native" in r}
    records = []
    for path in files:
        started = time.monotonic()
        records.append(run_file(path, args.out, args, env, earlier.get(path.name)))
        print(f"{path.name}: {time.monotonic() - started:.0f} s", flush=True)
        if args.json is not None:
            args.json.write_text(json.dumps(records, indent=1))
    print_table(records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
