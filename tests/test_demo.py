"""The YaFSDP Llama example runs with only the import changed, on 2 CPU ranks under
torchrun, and trains to the same losses as a single process (this is also `make demo`)."""

import subprocess
import sys


def test_demo_yafsdp_example_matches_reference():
    # Part 2 of `make demo`; part 1 (migrate + compare-scripts) is test_demo_migrate_flow below.
    completed = subprocess.run(
        [sys.executable, "-m", "fsdp_bridge", "demo", "--only", "yafsdp", "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    rows = [line for line in completed.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4, completed.stdout
    first, last = (float(rows[i].split()[1]) for i in (0, -1))
    assert last < first, "the example must actually train"
    assert "of the tolerance: equivalent (fp32: |a-b| <= 1e-05 + 1.3e-06*|b|" in completed.stdout


def test_demo_migrate_flow(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "fsdp_bridge", "demo", "--only", "migrate", "--migrate-steps", "2",
         "--out", str(tmp_path), "-q"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "fsdp-bridge migrate" not in completed.stderr  # -q: no inner summary either
    assert "migrated --to bridge" in completed.stdout and "migrated --to fsdp2" in completed.stdout
    assert (tmp_path / "compare.png").stat().st_size > 0
    assert (tmp_path / "fsdp1_train_llama_to_fsdp2.py").read_text().count("fully_shard(") >= 1
