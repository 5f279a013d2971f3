"""`fsdp-bridge migrate`: modes, exit codes, report, walker, byte-identical files, libcst runner."""

import json
import os
import pathlib
import subprocess
import sys

from fsdp_bridge.cli import main
from fsdp_bridge.migrate.files import may_use_fsdp

ROOT = pathlib.Path(__file__).resolve().parents[2]
FSDP1 = "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\nmodel = FSDP(model)  # wrap\n"
PLAIN = "import torch\r\n\r\nx = torch.ones(2)  # CRLF and odd   spacing\r\n"


def _tree(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "train.py").write_text(FSDP1)
    (tmp_path / "pkg" / "plain.py").write_bytes(PLAIN.encode())
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "copy.py").write_text(FSDP1)
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "v.py").write_text(FSDP1)
    (tmp_path / ".gitignore").write_text("build/\n")
    return tmp_path


def test_diff_check_write_and_exit_codes(tmp_path, capsys):
    root = _tree(tmp_path)
    assert main(["migrate", str(root), "--to", "fsdp2", "--exclude", "vendor/", "-j", "1"]) == 1
    out, err = capsys.readouterr()
    assert "+model = fully_shard(model)  # wrap" in out
    assert "build/copy.py" not in out and "vendor" not in out  # .gitignore and --exclude
    assert len(err.strip().splitlines()) == 1 and "1 to change" in err  # one summary line

    assert main(["migrate", str(root), "--to", "fsdp2", "--check", "--exclude", "vendor/"]) == 1
    assert (root / "pkg" / "train.py").read_text() == FSDP1  # --check writes nothing

    assert main(["migrate", str(root), "--to", "fsdp2", "--write", "--exclude", "vendor/"]) == 0
    assert "fully_shard(model)" in (root / "pkg" / "train.py").read_text()
    assert (root / "pkg" / "plain.py").read_bytes() == PLAIN.encode()  # byte-identical
    assert (root / "build" / "copy.py").read_text() == FSDP1
    assert main(["migrate", str(root), "--to", "fsdp2", "--check", "--exclude", "vendor/"]) == 0


def test_parse_error_is_reported_and_others_continue(tmp_path, capsys):
    # Python's account of the error: the bracket left open on line 2, not the end of the file,
    # where libcst's parser gives up.
    (tmp_path / "bad.py").write_text("import torch.distributed.fsdp\nx = {\n    'a': 1,\n\n"
                                     "def f():\n    return 1\n")
    (tmp_path / "good.py").write_text(FSDP1)
    report = tmp_path / "report.json"
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--write", "--report", str(report)]) == 2
    assert "fully_shard" in (tmp_path / "good.py").read_text()
    data = json.loads(report.read_text())
    entries = {pathlib.Path(e["path"]).name: e for e in data["files"]}
    assert entries["bad.py"]["error"] == "SyntaxError: '{' was never closed (line 2)"
    assert f"error: {tmp_path / 'bad.py'}: SyntaxError: '{{' was never closed (line 2)" \
        in capsys.readouterr().err
    assert entries["good.py"]["sites"][0]["rule"] == "FB100"
    assert data["summary"]["errors"] == 1


def test_markdown_report_lists_todos_and_config_lines(tmp_path, capsys):
    (tmp_path / "sub.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel\n\nclass W(FullyShardedDataParallel):\n    pass\n"
    )
    (tmp_path / "hf.py").write_text(
        "from transformers import TrainingArguments\n\nargs = TrainingArguments('o', fsdp='full_shard')\n"
    )
    (tmp_path / "accelerate.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\n")
    report = tmp_path / "report.md"
    main(["migrate", str(tmp_path), "--to", "fsdp2", "--report", str(report)])
    text = report.read_text()
    assert "| FB201 | left with TODO |" in text
    assert "| FB400 | report only |" in text and "| FB401 | report only |" in text
    # Without --report too, each site to review is listed on stderr, path:line first.
    listed = capsys.readouterr().err.splitlines()
    assert "fsdp-bridge migrate: 3 sites to review (left with a TODO, or reported only):" in listed
    assert any(line.startswith(f"  {tmp_path / 'sub.py'}:3: FB201 ") for line in listed), listed
    assert any(line.startswith(f"  {tmp_path / 'accelerate.yaml'}:2: FB401 ") for line in listed)


def test_prefilter():
    assert may_use_fsdp(b"from torch.distributed import (\n    fsdp,\n)\n", "fsdp2")
    assert may_use_fsdp(b"import torch.distributed._composable.fsdp\n", "fsdp2")
    assert may_use_fsdp(b"import torchacc\n", "bridge")
    assert not may_use_fsdp(b"import torch\nfrom torch.nn.parallel import DistributedDataParallel\n", "fsdp2")
    assert not may_use_fsdp(b"def is_fsdp_enabled():\n    return False\n", "fsdp2")
    # FSDP1's clip_grad_norm_ on a model wrapped in another file; not accelerate's or torch's.
    assert may_use_fsdp(b"norm = model.clip_grad_norm_(1.0)\n", "fsdp2")
    assert not may_use_fsdp(b"norm = model.clip_grad_norm_(1.0)\n", "yafsdp")  # YaFSDP has the method
    assert not may_use_fsdp(b"accelerator.clip_grad_norm_(model.parameters(), 1.0)\n", "fsdp2")
    assert not may_use_fsdp(b"torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n", "fsdp2")


def test_libcst_runner(tmp_path):
    target = tmp_path / "t.py"
    target.write_text(FSDP1)
    result = subprocess.run(
        [sys.executable, "-m", "libcst.tool", "codemod", "--no-format", "to_fsdp2.ToFsdp2Command", str(target)],
        cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    assert "model = fully_shard(model)  # wrap" in target.read_text()


def test_a_file_edited_while_migrate_runs_is_refused_by_name(tmp_path, monkeypatch, capsys):
    from fsdp_bridge.migrate import cli, driver

    path = tmp_path / "train.py"
    path.write_text(FSDP1)
    real_write = driver.Writer.write

    def user_saves_first(self, target, data, *args):
        with open(target, "a") as handle:  # the user's editor saves a line between read and write
            handle.write("print('added while migrating')\n")
        return real_write(self, target, data, *args)

    monkeypatch.setattr(cli.Writer, "write", user_saves_first)
    assert main(["migrate", str(path), "--to", "fsdp2", "--write", "-j", "1"]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: changed on disk since it was read" in err
    assert path.read_text() == FSDP1 + "print('added while migrating')\n"  # the user's line is kept
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_an_unchanged_file_is_rewritten(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(FSDP1)
    assert main(["migrate", str(path), "--to", "fsdp2", "--write", "-j", "1"]) == 0
    assert "fully_shard(model)" in path.read_text()


def test_report_counts_the_sites_that_still_import_fsdp_bridge_per_file(tmp_path):
    (tmp_path / "pure.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "def save(model, ddp_model, scheduler):\n"
        "    model = FSDP(model)\n"
        "    return model.state_dict(), ddp_model.state_dict(), scheduler.state_dict()\n")
    (tmp_path / "helper.py").write_text(
        "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n"
        "def build(model, kwargs):\n"
        "    return FSDP(model, **kwargs)\n")
    report = tmp_path / "report.json"
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--report", str(report), "-j", "1"]) == 1
    data = json.loads(report.read_text())
    counts = {pathlib.Path(entry["path"]).name: entry["fsdp_bridge_sites"] for entry in data["files"]}
    assert counts == {"pure.py": 0, "helper.py": 1}  # torch alone where torch suffices
    assert data["summary"]["fsdp_bridge_sites"] == 1


def test_virtual_environments_and_build_dirs_are_skipped_by_default(tmp_path, capsys):
    # None of these is in a .gitignore: the defaults alone keep migrate out of them.
    for relative in (".venv/lib/python3.12/site-packages/torch/fsdp_user.py", "venv/x.py",
                     "myenv/lib/y.py", "build/lib/z.py", "dist/d.py", ".tox/py/t.py",
                     "node_modules/n.py", "__pypackages__/3.12/p.py", "src/train.py"):
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(FSDP1)
    (tmp_path / "myenv" / "pyvenv.cfg").write_text("home = /usr/bin\n")  # a venv of any name
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--check", "-j", "1"]) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"would rewrite {tmp_path / 'src' / 'train.py'}"]
    assert "skipped" in err and "--no-default-excludes" in err
    assert "1 file," in err.splitlines()[-1]

    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--check", "-j", "1",
                 "--no-default-excludes"]) == 1
    assert len(capsys.readouterr().out.splitlines()) == 9
    # A directory named on the command line is walked, whatever its name.
    assert main(["migrate", str(tmp_path / "venv"), "--to", "fsdp2", "--check", "-j", "1"]) == 1
    assert "venv/x.py" in capsys.readouterr().out


def test_help_documents_the_default_excludes(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["migrate", "--help"])
    assert "--no-default-excludes" in capsys.readouterr().out


def test_a_named_file_migrate_does_not_read_is_an_error_not_a_silent_skip(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text(FSDP1)
    (tmp_path / "train.py").write_text(FSDP1)
    assert main(["migrate", str(notes), str(tmp_path / "train.py"), "--to", "fsdp2", "-j", "1"]) == 2
    out, err = capsys.readouterr()
    assert f"error: {notes}: not a Python (.py, .pyi), YAML or notebook file: skipped" in err
    assert "+model = fully_shard(model)" in out  # the other files are still migrated
    assert "1 error in" in err.splitlines()[-1]


def test_quiet_silences_the_summary_lines_but_not_errors(tmp_path, capsys):
    (tmp_path / "train.py").write_text(FSDP1)
    (tmp_path / "venv").mkdir()
    (tmp_path / "venv" / "x.py").write_text(FSDP1)
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--check", "-q", "-j", "1"]) == 1
    assert capsys.readouterr().err == ""
    (tmp_path / "bad.py").write_text("import torch.distributed.fsdp\ndef f(:\n")
    assert main(["migrate", str(tmp_path), "--to", "fsdp2", "--check", "-q", "-j", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'bad.py'}") and len(err.splitlines()) == 1
