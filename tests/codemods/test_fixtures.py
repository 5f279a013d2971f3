"""Fixture pairs: `fixtures/<target>/NAME.in.py` rewritten with `--to <target>` is `NAME.out.py`.

Every pair also checks idempotence (the output rewritten again is unchanged) and that the output
parses. To regenerate the outputs after a deliberate change, run with FSDP_BRIDGE_REGEN=1 and
review the diff.
"""

import ast
import os
import pathlib
import re

import pytest

from fsdp_bridge.migrate.driver import FileResult, transform_source
from fsdp_bridge.migrate.report import fsdp_bridge_sites

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
PAIRS = sorted(FIXTURES.glob("*/*.in.py"))


def _id(path: pathlib.Path) -> str:
    return f"{path.parent.name}/{path.name[: -len('.in.py')]}"


def test_enough_fixture_pairs():
    assert len(PAIRS) >= 25
    assert {p.parent.name for p in PAIRS} == {"bridge", "fsdp2", "yafsdp"}


@pytest.mark.parametrize("source_path", PAIRS, ids=_id)
def test_fixture(source_path: pathlib.Path):
    target = source_path.parent.name
    expected_path = source_path.with_name(source_path.name.replace(".in.py", ".out.py"))
    source = source_path.read_text()
    output, _ = transform_source(source, target)
    if os.environ.get("FSDP_BRIDGE_REGEN"):
        expected_path.write_text(output)
    assert output == expected_path.read_text()
    ast.parse(output)
    again, _ = transform_source(output, target)
    assert again == output, "a second run must change nothing"


CORPUS = sorted((FIXTURES.parent / "corpus").glob("*.py"))


@pytest.mark.parametrize("source_path, target", [(p, p.parent.name) for p in PAIRS if p.parent.name != "bridge"]
                         + [(p, t) for p in CORPUS for t in ("fsdp2", "yafsdp")],
                         ids=lambda v: v if isinstance(v, str) else v.stem if v in CORPUS else _id(v))
def test_report_counts_a_site_exactly_where_the_output_imports_fsdp_bridge(source_path, target):
    """The per-file count of sites that still need this package (fixtures and corpus) is 0
    exactly when the migrated file needs torch alone."""
    source = source_path.read_text()
    output, sites = transform_source(source, target)
    result = FileResult(path=str(source_path), new_source=output.encode() if output != source else None, sites=sites)
    imports = re.search(r"^\s*(from|import) fsdp_bridge\b", output, re.MULTILINE)
    assert bool(fsdp_bridge_sites(result, target)) == bool(imports)
