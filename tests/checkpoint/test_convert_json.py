"""`convert-checkpoint --json`: what was converted, as data, in a file or on stdout (- : the
text lines then go to stderr)."""

import json

import torch

from fsdp_bridge.cli import main


def test_convert_checkpoint_writes_its_summary_as_json(tmp_path, capsys):
    source = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.ones(2, 3), "b": torch.zeros(3)}, "step": 7}, source)
    assert main(["convert-checkpoint", str(source), str(tmp_path / "dcp"), "--to", "dcp",
                 "--json", "-"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out)
    assert summary["source"] == str(source) and summary["destination"] == str(tmp_path / "dcp")
    assert (summary["source_format"], summary["target_format"]) == ("torch", "dcp")
    assert summary["tensors"] == summary["source_tensors"] == 2
    assert "converted torch -> dcp: 2 tensors" in err
    report = tmp_path / "convert.json"
    assert main(["convert-checkpoint", str(tmp_path / "dcp"), str(tmp_path / "back.pt"),
                 "--to", "torch", "--json", str(report)]) == 0
    assert json.loads(report.read_text())["target_format"] == "torch"
    assert f"wrote the summary as JSON to {report}" in capsys.readouterr().out
