"""The rewrite leaves unvisited the statements that hold no name or attribute a rule reads (see
[Note: statements no rule reads] in fsdp_bridge/codemods/facts.py). On every corpus file the
output and the report equal those of a rewrite that visits every statement (under `--to fsdp2`;
`--to yafsdp` walks the file with the same class)."""

import pathlib

from fsdp_bridge.codemods.fsdp1_codemod import Fsdp1Codemod
from fsdp_bridge.migrate.driver import transform_source

CORPUS = sorted((pathlib.Path(__file__).parent / "corpus").glob("*.py"))


def test_skipping_statements_changes_nothing(monkeypatch):
    pruned = {path.name: transform_source(path.read_text(), "fsdp2") for path in CORPUS}
    monkeypatch.setattr(Fsdp1Codemod, "_unread", lambda self, node: False)
    for path in CORPUS:
        assert transform_source(path.read_text(), "fsdp2") == pruned[path.name], path.name


def test_statements_are_skipped():
    """A statement that names nothing FSDP is left unvisited: the first pass says so."""
    import libcst as cst
    from libcst.codemod import CodemodContext

    from fsdp_bridge.codemods.to_fsdp2 import ToFsdp2Command

    source = "import os\nfrom torch.distributed.fsdp import FullyShardedDataParallel as FSDP\n\n" \
             "def build(net):\n    path = os.getcwd()\n    return FSDP(net)\n"
    command = ToFsdp2Command(CodemodContext())
    module = cst.parse_module(source)
    command.transform_module(module)
    build = module.body[2]
    path_line, return_line = build.body.body
    assert id(return_line) in command.statements_to_visit and id(build) in command.statements_to_visit
    assert id(path_line) not in command.statements_to_visit and id(module.body[0]) not in command.statements_to_visit
