"""Adversarial inputs: nothing a user wrote is lost, and errors are reported, not raised."""

import codecs
import json
import os
import stat

from fsdp_bridge.cli import main
from fsdp_bridge.migrate.driver import transform_source

FSDP1 = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\nmodel = FSDP(model)\n"


def test_symlink_is_rewritten_through_and_stays_a_link(tmp_path):
    (tmp_path / "real.py").write_text(FSDP1)
    (tmp_path / "link.py").symlink_to("real.py")
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--write", "-j", "1"]) == 0
    assert (tmp_path / "link.py").is_symlink()
    assert "fully_shard(model)" in (tmp_path / "real.py").read_text()


def test_a_link_to_a_file_outside_the_tree_is_skipped_and_said(tmp_path, capsys):
    tree, other = tmp_path / "project", tmp_path / "other_project"
    tree.mkdir()
    other.mkdir()
    (other / "train.py").write_text(FSDP1)
    (tree / "real.py").write_text(FSDP1)
    (tree / "inside.py").symlink_to("real.py")
    (tree / "outside.py").symlink_to(other / "train.py")
    assert main(["migrate", str(tree), "--to", "fsdp2", "--write", "-j", "1"]) == 0
    err = capsys.readouterr().err
    assert (other / "train.py").read_text() == FSDP1  # another project's file: untouched
    assert (tree / "outside.py").is_symlink() and (tree / "inside.py").is_symlink()
    assert "fully_shard(model)" in (tree / "real.py").read_text()  # once, through the link
    assert f"skipped {tree / 'outside.py'}: symbolic links to files outside" in err, err
    # Named on the command line, the link is followed: the user asked for that file.
    assert main(["migrate", str(tree / "outside.py"), "--to", "fsdp2", "--write"]) == 0
    assert "fully_shard(model)" in (other / "train.py").read_text()


def test_read_only_file_and_unwritable_directory_are_errors_and_nothing_is_written(tmp_path, capsys):
    locked = tmp_path / "locked.py"
    locked.write_text(FSDP1)
    locked.chmod(0o444)
    (tmp_path / "sub").mkdir()
    inner = tmp_path / "sub" / "inner.py"
    inner.write_text(FSDP1)
    (tmp_path / "ok.py").write_text(FSDP1)
    (tmp_path / "sub").chmod(0o555)
    try:
        code = main(["migrate", str(tmp_path), "--to", "fsdp2", "--write", "-j", "1"])
    finally:
        (tmp_path / "sub").chmod(0o755)
    err = capsys.readouterr().err
    assert code == 2
    assert locked.read_text() == FSDP1 and stat.S_IMODE(locked.stat().st_mode) == 0o444
    assert "read-only file: not rewritten" in err
    # root may write into a 0555 directory; everyone else gets the error too
    if os.geteuid() != 0:
        assert "is not writable" in err
    # All or none: one file that cannot be written leaves every other file as it was.
    assert inner.read_text() == FSDP1 and (tmp_path / "ok.py").read_text() == FSDP1
    assert "nothing was written: 1 of the 3 files" in err or "nothing was written: 2 of the 3" in err
    assert "0 rewritten" in err and "Traceback" not in err


def test_a_file_edited_during_the_run_leaves_every_file_unwritten(tmp_path, capsys, monkeypatch):
    from fsdp_bridge.migrate import cli as migrate_cli

    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text(FSDP1)
    second.write_text(FSDP1)
    run_all = migrate_cli.run_all

    def then_edit(*args, **kwargs):  # an editor saves b.py after migrate read it
        results = run_all(*args, **kwargs)
        second.write_text(FSDP1 + "# edited\n")
        return results

    monkeypatch.setattr(migrate_cli, "run_all", then_edit)
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--write", "-j", "1"]) == 2
    err = capsys.readouterr().err
    assert "changed on disk since it was read" in err and "nothing was written" in err
    assert first.read_text() == FSDP1 and second.read_text() == FSDP1 + "# edited\n"


def test_a_rename_failing_midway_restores_the_files_already_written(tmp_path, capsys,
                                                                    monkeypatch):
    from fsdp_bridge.migrate import driver

    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text(FSDP1)
    second.write_text(FSDP1)
    replace = os.replace

    def fail_on_b(source, target):
        if str(target) == str(second) and "fully_shard" in open(source).read():
            raise PermissionError(13, "Permission denied", str(target))
        replace(source, target)

    monkeypatch.setattr(driver.os, "replace", fail_on_b)
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--write", "-j", "1"]) == 2
    err = capsys.readouterr().err
    assert "b.py: cannot rewrite" in err and "nothing was written" in err
    assert first.read_text() == FSDP1 and second.read_text() == FSDP1


def test_bad_report_path_fails_before_any_file_is_written(tmp_path, capsys):
    (tmp_path / "train.py").write_text(FSDP1)
    for report, words in ((tmp_path / "missing" / "r.json", "does not exist"),
                          (tmp_path / "r.txt", "unknown report format")):
        assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--write", "--report", str(report)]) == 2
        assert words in capsys.readouterr().err
        assert (tmp_path / "train.py").read_text() == FSDP1


def test_bom_is_kept(tmp_path):
    path = tmp_path / "bom.py"
    path.write_bytes(codecs.BOM_UTF8 + FSDP1.encode())
    assert main(["migrate", str(path), "--to", "fsdp2", "--write"]) == 0
    data = path.read_bytes()
    assert data.startswith(codecs.BOM_UTF8) and b"fully_shard(model)" in data


def test_notebook_is_reported(tmp_path, capsys):
    notebook = {"cells": [{"cell_type": "code", "source": [FSDP1]}]}
    (tmp_path / "nb.ipynb").write_text(json.dumps(notebook))
    report = tmp_path / "r.json"
    main(["migrate", str(tmp_path), "--to", "fsdp2", "--report", str(report)])
    assert "nb.ipynb:1: FB402 notebook mentions FSDP" in capsys.readouterr().err  # listed, path:line
    sites = json.loads(report.read_text())["files"][0]["sites"]
    assert sites[0]["rule"] == "FB402"


def test_star_import_is_flagged():
    source = "from torch.distributed.fsdp import *\n\nmodel = FullyShardedDataParallel(model)\n"
    output, sites = transform_source(source, "fsdp2")
    assert [s["rule"] for s in sites] == ["FB211"]
    assert "model = FullyShardedDataParallel(model)" in output


def test_comment_inside_multiline_policy_argument():
    source = (
        "import functools\n"
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n"
        "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy\n\n"
        "model = FSDP(\n    model,\n    auto_wrap_policy=functools.partial(\n"
        "        transformer_auto_wrap_policy,  # decoder layers only\n"
        "        transformer_layer_cls={Block},\n    ),\n)\n"
    )
    for target in ("fsdp2", "yafsdp"):
        output, _ = transform_source(source, target)
        assert "# decoder layers only" in output
        assert transform_source(output, target)[0] == output


def test_a_declared_latin_1_file_is_read_and_written_in_latin_1():
    """PEP 263: `# coding: latin-1` is valid Python; the rewrite keeps its encoding and bytes."""
    from fsdp_bridge.migrate.files import decode_python

    data = ("# -*- coding: latin-1 -*-\n# Modèle réparti\n" + FSDP1).encode("latin-1")
    source, encode = decode_python(data)
    assert source.startswith("# -*- coding: latin-1 -*-\n# Modèle réparti\n")
    output, _ = transform_source(source, "fsdp2")
    written = encode(output)
    assert written.decode("latin-1") == output and b"Mod\xe8le r\xe9parti" in written
    assert b"fully_shard(model)" in written


def test_decoding_keeps_a_bom_and_rejects_bytes_the_declaration_cannot_read():
    import pytest

    from fsdp_bridge.migrate.files import decode_python

    source, encode = decode_python(codecs.BOM_UTF8 + FSDP1.encode())
    assert source == FSDP1 and encode(source) == codecs.BOM_UTF8 + FSDP1.encode()
    with pytest.raises((SyntaxError, UnicodeDecodeError)):
        decode_python(b"x = 1\ny = 2\nz = '\xe9'\n")  # no declaration: UTF-8, and \xe9 alone is not UTF-8
    with pytest.raises(SyntaxError):
        decode_python(b"# coding: no-such-codec\nx = 1\n")


def test_migrate_rewrites_a_declared_latin_1_file_in_latin_1(tmp_path, capsys):
    """The command itself (not only the decoder) takes a PEP 263 latin-1 file: exit 0, the file
    rewritten in latin-1 with its accented comment byte for byte (it was refused, exit 2)."""
    path = tmp_path / "train.py"
    path.write_bytes(("# -*- coding: latin-1 -*-\n# Modèle réparti\n" + FSDP1).encode("latin-1"))
    assert main(["migrate", str(path), "--to", "fsdp2", "--write"]) == 0
    written = path.read_bytes()
    assert written.startswith(b"# -*- coding: latin-1 -*-\n# Mod\xe8le r\xe9parti\n")
    assert b"fully_shard(model)" in written
    assert written.decode("latin-1") != ("# -*- coding: latin-1 -*-\n# Modèle réparti\n" + FSDP1)
