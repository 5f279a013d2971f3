"""The package's one atomic file writer (`fsdp_bridge.outputs.atomic_path`): a file is replaced
whole or not at all, nothing else in its directory is touched, a link at the path stays a link,
no other module replaces files itself, and a failed write ends a command in one line."""

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


def _json_writers():
    """Each command output written as a file: (name, write(path, n), what n writes)."""
    from fsdp_bridge.bench.report import write_figures
    from fsdp_bridge.migrate import report as migrate_report
    from fsdp_bridge.migrate.driver import FileResult

    return [
        ("write_text", lambda path, n: write_text(path, f'{{"n": {n}}}'), '"n": {}'),
        ("bench --json", lambda path, n: write_figures(path, {"n": n}), '"n": {}'),
        ("migrate --report", lambda path, n: migrate_report.write(
            path, [FileResult(f"f{i}.py") for i in range(n)], "fsdp2"), '"files": {}'),
    ]


@pytest.mark.parametrize("index", range(3))
def test_command_outputs_replace_only_their_file_and_write_through_a_link(tmp_path, capsys,
                                                                          index):
    from tests.checkpoint import user_files

    name, write, said = _json_writers()[index]
    planted = user_files.plant(tmp_path / "results", tmp_path / "elsewhere")
    out = tmp_path / "results" / "out.json"
    for n in (1, 2):  # written, then replaced
        write(str(out), n)
        assert user_files.intact(planted), name
        assert said.format(n) in out.read_text(), name
    # A link as the output path stays a link: the file it names is written, as `>` would.
    (tmp_path / "elsewhere" / "latest.json").write_text("old")
    link = tmp_path / "results" / "latest.json"
    link.symlink_to(tmp_path / "elsewhere" / "latest.json")
    write(str(link), 3)
    assert link.is_symlink(), name
    assert said.format(3) in (tmp_path / "elsewhere" / "latest.json").read_text(), name
    assert sorted(os.listdir(tmp_path / "results")) == ["NOTES.md", "latest.json", "mine",
                                                        "out.json", "shared.txt"], name
    capsys.readouterr()


def test_a_failed_output_write_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """A file-system failure that no command foresaw (here: the disk fills up while `migrate
    --report` writes) ends the command in one line naming the file, not a traceback."""
    import errno

    from fsdp_bridge.cli import main
    from fsdp_bridge.migrate import report as migrate_report

    def full_disk(path, text):
        with atomic_path(path) as tmp:
            with open(tmp, "w") as handle:
                handle.write(text[:10])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(migrate_report, "write_text", full_disk)
    (tmp_path / "src").mkdir()
    target = tmp_path / "report.json"
    target.write_text("previous report")
    assert main(["migrate", str(tmp_path / "src"), "--to", "fsdp2", "-q", "--report",
                 str(target)]) == 2
    err = capsys.readouterr().err
    assert err == (f"fsdp-bridge migrate: error: {target}: the disk is full: free some space and "
                   "run again [Errno 28]\n")
    assert target.read_text() == "previous report"
    assert sorted(os.listdir(tmp_path)) == ["report.json", "src"]
