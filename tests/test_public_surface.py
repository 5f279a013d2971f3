"""Names the README uses, reached as the README writes them: `fsdp_bridge.explain(model)` any
number of times, `checkpoint.hf` after `from fsdp_bridge import checkpoint`; and
`convert-checkpoint` prints its report, nothing of torch's."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_explain_is_the_function_every_time():
    done = _python("""
        import os, sys, tempfile
        import torch, torch.distributed as dist
        import fsdp_bridge
        dist.init_process_group("gloo", init_method="file://" + tempfile.mkdtemp() + "/init",
                                rank=0, world_size=1)
        from fsdp_bridge.fsdp import FullyShardedDataParallel
        model = FullyShardedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4)))
        first = fsdp_bridge.explain(model)
        second = fsdp_bridge.explain(model)
        import fsdp_bridge.explanation  # importing the module must not replace the function
        third = fsdp_bridge.explain(model)
        print(first == second == third, first.splitlines()[0])
        dist.destroy_process_group()
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("True fsdp_bridge plan"), done.stdout


def test_checkpoint_hf_and_convert_are_attributes_of_checkpoint():
    done = _python("""
        from fsdp_bridge import checkpoint
        print(checkpoint.hf.load_pretrained.__name__, checkpoint.hf.save_pretrained.__name__,
              checkpoint.convert.convert.__name__)
        try:
            checkpoint.no_such_thing
        except AttributeError as exc:
            print(exc)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "load_pretrained save_pretrained convert"
    assert "no attribute 'no_such_thing'" in lines[1]


def test_convert_checkpoint_prints_no_torch_warning(tmp_path):
    made = _python("import torch; torch.save({'model': {'w': torch.ones(3)}}, 'a.pt')",
                   cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    for source, destination, to in (("a.pt", "dcp", "dcp"), ("dcp", "b.pt", "torch")):
        done = subprocess.run([sys.executable, "-m", "fsdp_bridge", "convert-checkpoint", source,
                               destination, "--to", to], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stderr == "", done.stderr
        assert done.stdout.startswith("converted"), done.stdout
