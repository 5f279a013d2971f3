"""Fixture pairs: `fixtures/<target>/NAME.in.py` rewritten with `--to <target>` is `NAME.out.py`.

Every pair also checks idempotence (the output rewritten again is unchanged) and that the output
parses. To regenerate the outputs after a deliberate change, run with FSDP_BRIDGE_REGEN=1 and
review the diff.
"""

import ast
import os
import pathlib

import pytest

from fsdp_bridge.migrate.driver import transform_source

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
