"""The generated front-end docs match the tables in the code, and `fsdp-bridge explain`
prints a model's plan (units, bytes per rank, dtypes, warnings)."""

from __future__ import annotations

import os
import subprocess
import sys

from fsdp_bridge.explanation import render_docs
from fsdp_bridge.translation import all_tables

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_committed_docs_equal_the_rendering():
    with open(os.path.join(ROOT, "fsdp_bridge", "frontends.md")) as handle:
        committed = handle.read()
    assert committed == render_docs(), (
        "fsdp_bridge/frontends.md is stale: run `python -m fsdp_bridge explain --write-docs "
        "fsdp_bridge/frontends.md`")


def test_every_frontend_has_a_table():
    render_docs()
    names = {table.frontend for table in all_tables()}
    assert {"FullyShardedDataParallel", "fully_shard", "YaFSDP", "zeta.fsdp",
            "torchacc.Config"} <= names


def test_explain_cli_demo():
    out = subprocess.run([sys.executable, "-m", "fsdp_bridge", "explain", "--demo"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "model.layers.0" in text and "<root>" in text
    assert "numel/rank" in text and "KiB" in text
    assert "torch.float32 -> torch.bfloat16" in text
    assert "limit_all_gathers=False) is ignored" in text
