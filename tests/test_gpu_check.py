"""`python -m tests.gpu_check` (`make gpu-check`) on the CPU: what it needs (no libcst, no
pathspec, no pytest plugin), that it runs what `make test-gpu` runs, its summary from pytest's
junit XML and from a killed pytest's log, its bench table from the CUDA bench's report, its
timeout ending a phase's whole process group, and a `--smoke` run writing the summary with a
failing test's first line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.gpu_check import check as gpu_check
from tests.gpu_check import summary as S
from tests.gpu_check.runner import run_phase

ROOT = Path(__file__).resolve().parent.parent

# In a fresh interpreter: libcst and pathspec (the codemods' dependencies) made unimportable, as
# on a GPU machine without them; then the GPU test files are collected (hypothesis's pytest
# plugin left out), and whatever of the three got imported is printed.
WITHOUT_CODEMOD_DEPENDENCIES = """
import sys
sys.modules["libcst"] = None  # `import libcst` now raises ImportError
sys.modules["pathspec"] = None
import fsdp_bridge.engine, fsdp_bridge.fsdp, fsdp_bridge.ya_fsdp, fsdp_bridge.bench.cuda
import pytest
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
                    *sys.argv[1:]])
loaded = {name.split(".")[0] for name, module in sys.modules.items() if module is not None}
print("imported:", sorted(loaded & {"libcst", "pathspec", "hypothesis"}))
sys.exit(code)
"""


def test_the_engine_front_ends_and_gpu_tests_need_no_libcst_pathspec_or_hypothesis():
    files = sorted(set(gpu_check.GPU_TESTS + gpu_check.GPU_GLOO_TESTS))
    done = subprocess.run([sys.executable, "-c", WITHOUT_CODEMOD_DEPENDENCIES, *files], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\d+ tests? collected", done.stdout), done.stdout[-2000:]
    assert "imported: []" in done.stdout, done.stdout[-2000:]


def _make_variable(name: str) -> list[str]:
    text = (ROOT / "Makefile").read_text().replace("\\\n", " ")
    match = re.search(rf"^{name} \?=(.*)$", text, re.MULTILINE)
    assert match, f"no {name} in the Makefile"
    return match.group(1).split()


def test_the_check_runs_what_make_test_gpu_runs():
    assert list(gpu_check.GPU_TESTS) == _make_variable("GPU_TESTS")
    assert list(gpu_check.GPU_GLOO_TESTS) == _make_variable("GPU_GLOO_TESTS")


def test_the_gpu_tests_need_no_fixture_of_the_pytest_plugin():
    # The plugin is registered by the installed package's entry point, which the check does
    # not have: a GPU test asking for its fixture would fail there.
    files = set(gpu_check.GPU_TESTS + gpu_check.GPU_GLOO_TESTS)
    assert [f for f in files if "fsdp_equivalence" in (ROOT / f).read_text()] == []


def test_each_phase_may_use_its_share_of_the_budget_and_what_earlier_phases_saved(tmp_path):
    shares = gpu_check.SHARES
    whole = gpu_check.Check(gpu_check.parse(["--out", str(tmp_path), "--budget", "450"]), [])
    assert sum(shares.values()) == 450
    assert whole.timeout("environment") == pytest.approx(shares["environment"], abs=1)
    later = sum(shares[p] for p in ("tests-gloo", "bench", "offload", "frameworks"))
    assert whole.timeout("tests-nccl") == pytest.approx(450 - later, abs=1)
    # A smaller budget without two phases: the shares of those that run, scaled to it.
    small = gpu_check.Check(gpu_check.parse(["--out", str(tmp_path), "--budget", "100", "--skip",
                                             "bench", "--skip", "offload", "--skip",
                                             "frameworks"]), [])
    running = shares["environment"] + shares["tests-nccl"] + shares["tests-gloo"]
    assert small.timeout("environment") == pytest.approx(100 * shares["environment"] / running,
                                                         abs=1)
    for check in (whole, small):
        shutil.rmtree(check.work)


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_gpu" name="test_ok" time="1.5"/>
<testcase classname="tests.test_gpu" name="test_bad[int]" time="0.2">
  <failure message="AssertionError: GPU memory grows over steps&#10;assert 3 == 2">long text</failure>
</testcase>
<testcase classname="tests.test_gpu" name="test_setup" time="0.1">
  <error message="failed on setup with &quot;RuntimeError: NCCL error&quot;">trace</error>
</testcase>
<testcase classname="tests.test_engine_parity" name="test_world4" time="0">
  <skipped type="pytest.skip" message="needs 4 CUDA devices (one per NCCL rank), found 1">x</skipped>
</testcase>
</testsuite></testsuites>
"""


def test_the_summary_reads_each_outcome_and_first_line_from_junit(tmp_path):
    path = tmp_path / "run.xml"
    path.write_text(JUNIT)
    result = S.read_junit(str(path))
    assert result["counts"] == {"passed": 1, "failed": 1, "error": 1, "skipped": 1}
    by_id = {case["id"]: case for case in result["cases"]}
    assert by_id["tests.test_gpu::test_bad[int]"]["first_line"] == \
        "AssertionError: GPU memory grows over steps"
    assert by_id["tests.test_gpu::test_setup"]["first_line"] == \
        'failed on setup with "RuntimeError: NCCL error"'
    assert by_id["tests.test_engine_parity::test_world4"]["first_line"] == \
        "needs 4 CUDA devices (one per NCCL rank), found 1"
    summary = {"mode": "gpu", "status": "failed", "started": "t0", "updated": "t1",
               "budget_s": 450, "phases": [], "tests": {"tests-nccl": result}}
    written = S.markdown(summary)
    assert "- `tests.test_gpu::test_bad[int]`: AssertionError: GPU memory grows over steps" in written


def test_a_killed_pytest_log_gives_the_finished_outcomes_and_the_running_test(tmp_path):
    log = tmp_path / "tests.log"
    log.write_text("tests/test_gpu.py::test_a[int] PASSED                      [ 10%]\n"
                   "tests/test_gpu.py::test_b SKIPPED (needs 2 CUDA devices)   [ 20%]\n"
                   "tests/test_gpu.py::test_c FAILED                           [ 30%]\n"
                   "tests/test_gpu.py::test_d \n"  # started, never finished
                   "[gpu-check: stopped at the phase's timeout of 160 s]\n")
    result = S.read_verbose_log(str(log))
    assert result["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert result["running_when_stopped"] == "tests/test_gpu.py::test_d"


def test_the_bench_table_reads_the_cuda_bench_report_and_its_progress_lines(tmp_path):
    from fsdp_bridge.bench import cuda

    s = {"dtypes": ["bf16"], "nproc": 1}
    runs = {c: [{"times": [t / 1000, t / 1000], "peak_bytes": int(gib * 2**30), "step_start_bytes": 0}]
            for c, t, gib in [("plain", 100, 20), ("fsdp1", 110, 18), ("fsdp2", 108, 17),
                              ("ours", 104, 16)]}
    table = S.bench_table(json.loads(json.dumps(cuda.summarize(s, [{"bf16": runs}]))))
    rows = table["bf16"]["configs"]
    assert sorted(rows) == sorted(cuda.CONFIGS)
    assert rows["ours"]["median_step_ms"] == 104 and rows["ours"]["peak_gib"] == 16
    assert abs(rows["ours"]["ratio_to_plain"] - 1.04) < 1e-9
    assert table["bf16"]["targets"]["overhead_met"] is True

    log = tmp_path / "bench.log"
    log.write_text("[bench] repeat 1/2 bf16 plain: median 101.5 ms, peak 20.10 GiB\n"
                   "[bench] repeat 1/2 bf16 ours: median 104.0 ms, peak 16.00 GiB\n"
                   "[bench] repeat 2/2 bf16 plain: median 99.5 ms, peak 19.90 GiB\n")
    partial = S.bench_table_from_log(str(log))["bf16"]["configs"]
    assert partial["plain"] == {"median_step_ms": 99.5, "peak_gib": 20.1, "ratio_to_plain": None}
    assert sorted(partial) == ["ours", "plain"]


# Starts a grandchild (as pytest starts ranks) that sleeps, then sleeps too or ends at once.
LEAVES_A_CHILD = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
                  "'import time; time.sleep(600)']); print('child', child.pid, flush=True); "
                  "time.sleep(float(sys.argv[1]))")


def _child(log: Path) -> int:
    return int(re.search(r"child (\d+)", log.read_text()).group(1))


def test_a_phase_past_its_timeout_ends_with_its_whole_process_group(tmp_path):
    log = tmp_path / "phase.log"
    start = time.monotonic()
    result = run_phase([sys.executable, "-c", LEAVES_A_CHILD, "600"], dict(os.environ), str(log),
                       5, str(tmp_path))
    assert time.monotonic() - start < 60
    assert result["status"] == "timeout" and result["exit_code"] is not None
    assert "stopped at the phase's timeout of 5 s" in log.read_text()
    assert not _alive(_child(log)), "the grandchild outlived its phase"


def test_what_a_finished_phase_leaves_running_is_ended_and_reported(tmp_path):
    log = tmp_path / "phase.log"
    result = run_phase([sys.executable, "-c", LEAVES_A_CHILD, "0"], dict(os.environ), str(log),
                       60, str(tmp_path))
    assert result["status"] == "passed" and result["left_processes_running"] is True
    assert "leaving processes of its group running: ended them" in log.read_text()
    assert not _alive(_child(log))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # reaped by init soon; a zombie is not alive
        return handle.read().split()[2] != "Z"


SAMPLE_TESTS = """
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 == 2, "the sample is broken on purpose"

@pytest.mark.skip(reason="skipped on purpose")
def test_skipped():
    pass
"""


def test_a_smoke_run_writes_the_summary_with_a_failures_first_line(tmp_path):
    sample = tmp_path / "test_sample.py"
    sample.write_text(SAMPLE_TESTS)
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_check", "--smoke", "--out", str(out), "--tests",
         str(sample), "--skip", "tests-gloo", "--skip", "bench", "--skip", "offload",
         "--skip", "frameworks",
         "--budget", "300"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr  # 1: a test failed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed: tests-nccl"
    assert summary["environment"]["torch"] and summary["environment"]["python"]
    assert summary["environment"]["fsdp_bridge_file"] == str(ROOT / "fsdp_bridge" / "__init__.py")
    phases = {p["name"]: p for p in summary["phases"]}
    assert phases["environment"]["status"] == "passed"
    assert {phases[p]["status"] for p in ("tests-gloo", "bench", "offload", "frameworks")} == {
        "skipped (--skip)"}
    phase = phases["tests-nccl"]
    assert phase["status"] == "failed" and phase["exit_code"] == 1 and phase["duration_s"] > 0
    result = summary["tests"]["tests-nccl"]
    assert result["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    failed = [c for c in result["cases"] if c["outcome"] == "failed"]
    assert failed[0]["first_line"] == "AssertionError: the sample is broken on purpose"
    assert "1 failed" in (out / "tests-nccl.log").read_text()
    # The folder keeps the summary and one log per phase that ran (what the check reads from
    # the phases is in summary.json).
    assert sorted(os.listdir(out)) == ["environment.log", "summary.json", "summary.md",
                                       "tests-nccl.log"]
    written = (out / "summary.md").read_text()
    assert "AssertionError: the sample is broken on purpose" in written
    assert "skipped on purpose" in written
