"""The package's one atomic file writer (`fsdp_bridge.outputs.atomic_path`): a file is replaced
whole or not at all, and no other module replaces files itself."""

from __future__ import annotations

import os
import pathlib

import pytest

from fsdp_bridge.outputs import atomic_path, write_text

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "fsdp_bridge"


def test_a_failed_last_check_leaves_the_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("before")

    def refuse() -> None:
        raise RuntimeError("edited meanwhile")

    with pytest.raises(RuntimeError, match="edited meanwhile"):
        with atomic_path(str(target), durable=True, before_replace=refuse) as tmp:
            pathlib.Path(tmp).write_text("after")
    assert target.read_text() == "before" and os.listdir(tmp_path) == ["report.json"]


def test_a_named_temporary_keeps_the_extension_free_and_is_renamed_in_place(tmp_path):
    target = tmp_path / "model.safetensors"
    with atomic_path(str(target), temporary=str(tmp_path / "t.tmp"), durable=True) as tmp:
        assert tmp == str(tmp_path / "t.tmp")
        pathlib.Path(tmp).write_bytes(b"data")
    assert target.read_bytes() == b"data" and os.listdir(tmp_path) == ["model.safetensors"]
    write_text(str(target), "text")
    assert target.read_text() == "text" and os.listdir(tmp_path) == ["model.safetensors"]


def test_no_other_module_replaces_files_itself():
    # Directories are published by renames in checkpoint/atomic.py; files go through outputs.
    replacing = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                       if "os.replace(" in path.read_text())
    assert replacing == ["outputs.py"], replacing
