"""Two sites with a torch form under `--to fsdp2`: an optimizer load whose statement carries
comments (one set_optimizer_state_dict call, the comments kept), and FSDP1 ignored parameters
given by a `.parameters()` call (fully_shard's ignored_params). Values not known to be
parameters keep the runtime helper, with its reason."""

import pathlib
import re

from fsdp_bridge.codemods.helpers import comments_in
from fsdp_bridge.migrate.driver import transform_source

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "fsdp2"


def test_a_commented_optimizer_load_is_torch_alone_and_keeps_its_comments():
    source = (FIXTURES / "optimizer_load_commented.in.py").read_text()
    output, sites = transform_source(source, "fsdp2")
    assert not re.search(r"^\s*(from|import) fsdp_bridge\b", output, re.MULTILINE)
    assert "load_state_dict(" not in output and output.count("set_optimizer_state_dict(") == 3
    assert sorted(comments_in(output)) == sorted(comments_in(source))
    assert {site["status"] for site in sites} == {"translated in place"}


def test_ignored_parameters_known_here_become_ignored_params():
    output, sites = transform_source((FIXTURES / "constructor_ignored_parameters.in.py").read_text(), "fsdp2")
    assert "fully_shard(model, ignored_params=set(model.head.parameters()))" in output
    assert "ignored_params=set(blocks[0].parameters(recurse=False))" in output
    assert output.count("ignored_params=set(blocks[1][0].parameters())") == 2  # the policy's loop and the root
    kept = [line for line in output.splitlines() if "fsdp1_fully_shard(" in line]
    assert kept == ["    kept = fsdp1_fully_shard(blocks[2], ignored_states=frozen)",
                    "    weights = fsdp1_fully_shard(blocks[3], ignored_states=[blocks[3].weight])"]
    helped = [site for site in sites if site["status"] == "translated via runtime helper"]
    assert len(helped) == 2 and all("ignored_states: whether it holds modules or parameters" in site["reason"]
                                    for site in helped)
