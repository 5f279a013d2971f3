"""The gpu-check's phases, their time budget and the run (`python -m tests.gpu_check`, see
tests/gpu_check/__init__.py). Exit status: 0 when every phase that ran passed, 1 when one
failed or timed out, 2 when no CUDA device (without --smoke) or bad options."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from tests.gpu_check import summary as S
from tests.gpu_check.runner import DRAIN_S, run_phase

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# What `make test-gpu` runs (the Makefile's GPU_TESTS and GPU_GLOO_TESTS; a test keeps them equal).
GPU_TESTS = ("tests/test_gpu.py", "tests/test_engine_parity.py",
             "tests/frontends/test_parity_native.py", "tests/checkpoint/test_checkpoints.py",
             "tests/integrations/test_native_checkpoints_cuda.py")
GPU_GLOO_TESTS = ("tests/test_engine_parity.py",)
# Under --smoke, on the CPU: the CUDA-only file (every test skipped, with its reason) and a
# quick file that runs.
SMOKE_TESTS = ("tests/test_gpu.py", "tests/test_topology.py")
# Each phase's share of a 450 s budget (seconds; scaled to the --budget given): a phase may run
# until the time left is what the phases after it are promised, so time one phase saves goes to
# the next.
SHARES = {"environment": 30, "tests-nccl": 150, "tests-gloo": 90, "bench": 90, "offload": 30,
          "frameworks": 60}
PHASES = tuple(SHARES)
# Under 8 minutes in all: a phase stopped at its timeout may take GRACE_S twice more to end, and
# the last phase's overrun is past the budget.
DEFAULT_BUDGET_S = 440.0
PER_TEST_TIMEOUT_S = 120  # pytest-timeout's limit per test (module fixtures spawn whole worlds)
# The CUDA bench: the 1.1B Llama in bf16 at world 1, configs one after another.
BENCH_GPU = ("--device", "cuda", "--dtype", "bf16", "--repeats", "2", "--warmup", "2",
             "--steps", "5")
BENCH_SMOKE = ("--device", "cpu", "--dtype", "fp32", "--nproc", "2", "--repeats", "1",
               "--warmup", "0", "--steps", "1", "--hidden", "32", "--layers", "2", "--heads", "2",
               "--vocab", "128", "--seq", "16", "--batch", "2")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


class Check:
    """The run: its options, its deadline, the summary it rewrites after every phase."""

    def __init__(self, args, argv: list[str]):
        self.args = args
        self.out = os.path.abspath(args.out)
        # What the phases write for the check to read (versions, junit XML, the bench's and the
        # offload's JSON) goes here, and into summary.json: the folder keeps the summary and
        # one log per phase, no more.
        self.work = tempfile.mkdtemp(prefix="gpu-check-")
        self.deadline = time.monotonic() + args.budget
        self.summary = {"schema": S.SCHEMA, "mode": "smoke (CPU)" if args.smoke else "gpu",
                        "status": "running", "started": _now(), "updated": _now(),
                        "budget_s": args.budget, "command": [sys.executable, "-m", "tests.gpu_check", *argv],
                        "repository": ROOT, "commit": _commit(), "environment": {},
                        "phases": [], "tests": {}, "bench": None, "offload": None,
                        "frameworks": None}

    def save(self) -> None:
        self.summary["updated"] = _now()
        S.write(self.out, self.summary)

    def env(self, **extra) -> dict:
        """The children's environment: this repository first on PYTHONPATH, output unbuffered
        (a killed child's last lines still reach the log)."""
        env = {k: v for k, v in os.environ.items()
               if k not in ("FSDP_BRIDGE_DEVICE", "FSDP_BRIDGE_BACKEND")}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        env.update(extra)
        return env

    def timeout(self, name: str) -> float:
        """What is left of the budget, less what the later phases are promised: their shares,
        scaled so that the shares of the phases that run add up to the budget."""
        running = [p for p in PHASES if p not in self.args.skip]
        scale = self.args.budget / sum(SHARES[p] for p in running)
        later = scale * sum(SHARES[p] for p in running[running.index(name) + 1:])
        return max(1.0, self.deadline - time.monotonic() - later)

    def phase(self, name: str, argv: list[str], env: dict, notes=()) -> dict:
        record = {"name": name, "status": "running", "command": argv, "timeout_s": None,
                  "log": f"{name}.log", "notes": list(notes)}
        self.summary["phases"].append(record)
        record["timeout_s"] = round(self.timeout(name))
        self.save()  # a run killed now still says which phase it was in
        record.update(run_phase(argv, env, os.path.join(self.out, record["log"]),
                                record["timeout_s"], cwd=ROOT))
        if record["left_processes_running"]:
            record["notes"].append("the command ended, leaving processes of its group running "
                                   f"for over {DRAIN_S} s: they were ended")
        return record


def _commit():
    try:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=20)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain"], capture_output=True,
                               text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" (uncommitted changes)" if dirty.stdout.strip() else "")


# -- the phases --------------------------------------------------------------------------------


def environment(check: Check) -> bool:
    """The versions; False when torch says there is no CUDA device (without --smoke)."""
    found = os.path.join(check.work, "environment.json")
    record = check.phase("environment", [sys.executable, "-m", "tests.gpu_check.probe", found],
                         check.env())
    try:
        with open(found) as handle:
            check.summary["environment"] = json.load(handle)
    except (OSError, ValueError):
        record["notes"].append("the probe printed no versions (see its log); the other phases "
                               "run anyway")
        return True
    env = check.summary["environment"]
    if env.get("fsdp_bridge_import_errors"):
        record["notes"].append("package modules that fail to import (the tests that need them "
                               "fail): " + json.dumps(env["fsdp_bridge_import_errors"]))
    if not check.args.smoke and not env.get("cuda_available"):
        record["status"] = "failed"
        record["notes"].append(
            f"no CUDA device: torch {env.get('torch')} (CUDA build: {env.get('torch_cuda')}) "
            "sees no GPU. Run on a machine with an NVIDIA GPU and a CUDA build of torch, or add "
            "--smoke to check this command on the CPU.")
        return False
    return True


def pytest_phase(check: Check, name: str, files, extra_env: dict) -> None:
    junit = os.path.join(check.work, f"{name}.junit.xml")
    argv = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider",
            f"--junitxml={junit}", "--durations=15", *files]
    notes = []
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.insert(3, f"--timeout={check.args.per_test_timeout}")
    else:
        notes.append("pytest-timeout is not installed: no per-test timeout; a hung test runs "
                     "until the phase's timeout, then the phase is stopped and the test that was "
                     "running is named")
    record = check.phase(name, argv, check.env(**extra_env), notes)
    if os.path.exists(junit):
        check.summary["tests"][name] = S.read_junit(junit)
    else:
        check.summary["tests"][name] = S.read_verbose_log(os.path.join(check.out, record["log"]))
    if record["exit_code"] == 5:
        record["notes"].append("pytest collected no tests")


def bench(check: Check) -> None:
    figures = os.path.join(check.work, "bench.json")
    options = BENCH_SMOKE if check.args.smoke else BENCH_GPU
    record = check.phase("bench", [sys.executable, "-m", "fsdp_bridge", "bench", *options,
                                   "--json", figures], check.env())
    if os.path.exists(figures):
        with open(figures) as handle:
            report = json.load(handle)
        check.summary["bench"] = {"source": "bench --json file", "table": S.bench_table(report),
                                  "report": report}
    else:
        table = S.bench_table_from_log(os.path.join(check.out, record["log"]))
        check.summary["bench"] = {"source": "bench's progress lines (it wrote no JSON)",
                                  "table": table}


def offload(check: Check) -> None:
    figures = os.path.join(check.work, "offload.json")
    argv = [sys.executable, "-m", "tests.gpu_check.offload", "--json", figures]
    device = {} if check.args.smoke else {"FSDP_BRIDGE_DEVICE": "cuda"}
    check.phase("offload", argv + (["--smoke"] if check.args.smoke else []), check.env(**device))
    if os.path.exists(figures):
        with open(figures) as handle:
            check.summary["offload"] = json.load(handle)


def frameworks(check: Check) -> None:
    figures = os.path.join(check.work, "frameworks.json")
    argv = [sys.executable, "-m", "tests.gpu_check.frameworks", "--json", figures,
            "--timeout", str(round(check.timeout("frameworks")))]
    check.phase("frameworks", argv + (["--smoke"] if check.args.smoke else []), check.env())
    if os.path.exists(figures):
        with open(figures) as handle:
            check.summary["frameworks"] = json.load(handle)


def run(check: Check) -> int:
    skip = check.args.skip
    device = {} if check.args.smoke else {"FSDP_BRIDGE_DEVICE": "cuda"}
    nccl_files = check.args.tests or (SMOKE_TESTS if check.args.smoke else GPU_TESTS)
    gloo_files = check.args.tests or (SMOKE_TESTS if check.args.smoke else GPU_GLOO_TESTS)
    if not environment(check):
        check.summary["status"] = "stopped: " + check.summary["phases"][0]["notes"][-1]
        return 2
    steps = [("tests-nccl", lambda: pytest_phase(check, "tests-nccl", nccl_files, device)),
             ("tests-gloo", lambda: pytest_phase(check, "tests-gloo", gloo_files,
                                                 {**device, "FSDP_BRIDGE_BACKEND": "gloo"})),
             ("bench", lambda: bench(check)), ("offload", lambda: offload(check)),
             ("frameworks", lambda: frameworks(check))]
    for name, step in steps:
        if name in skip:
            check.summary["phases"].append({"name": name, "status": "skipped (--skip)"})
        else:
            step()
        check.save()
    failed = [p["name"] for p in check.summary["phases"] if p["status"] in ("failed", "timeout")]
    check.summary["status"] = "failed: " + ", ".join(failed) if failed else "passed"
    return 1 if failed else 0


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_check", description=(
        "The GPU tests and the CUDA bench on this interpreter's torch, offline; one summary "
        "(summary.md, summary.json) and the raw logs in --out."))
    parser.add_argument("--out", default="gpu-check", help="folder for the summary and logs "
                        "(created; our files in it are replaced; default: gpu-check)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for all phases together (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--smoke", action="store_true",
                        help="the same phases on the CPU at tiny sizes (checks this command)")
    parser.add_argument("--tests", nargs="+", metavar="PATH",
                        help="test files or ids for both test phases instead of the defaults")
    parser.add_argument("--skip", action="append", default=[], choices=PHASES[1:],
                        help="leave a phase out (repeatable)")
    parser.add_argument("--per-test-timeout", type=int, default=PER_TEST_TIMEOUT_S,
                        help=f"pytest-timeout's --timeout (default {PER_TEST_TIMEOUT_S} s)")
    args = parser.parse_args(argv)
    # The phases run in the repository root: paths given from elsewhere are made absolute.
    args.tests = [_from_here(entry) for entry in args.tests or ()] or None
    if args.budget <= 0:
        parser.error(f"--budget {args.budget:g}: must be a positive number of seconds")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        parser.error(f"--out {args.out!r}: exists and is not a folder; name a folder")
    return args


def _from_here(test: str) -> str:
    path, _, rest = test.partition("::")
    if not os.path.exists(path):
        return test  # pytest says it is not found
    return os.path.abspath(path) + (f"::{rest}" if rest else "")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    check = Check(parse(argv), argv)
    os.makedirs(check.out, exist_ok=True)
    try:
        code = run(check)
    except KeyboardInterrupt:
        check.summary["status"] = "interrupted"
        code = 130
    except Exception as exc:  # recorded in the summary, then raised with its traceback
        check.summary["status"] = f"error in gpu-check itself: {type(exc).__name__}: {exc}"
        raise
    finally:
        check.save()
        shutil.rmtree(check.work, ignore_errors=True)
    print(f"gpu-check: {check.summary['status']}")
    print(f"gpu-check: summary in {os.path.join(check.out, 'summary.md')}")
    return code

