"""The repository's examples/: one runnable script per dialect and per training framework, each
saying in its docstring how to run it. The dialect scripts train in the spawned world of
tests/frontends/test_seed_examples.py; those that run a script shipped in the package
(fsdp_bridge/examples, run by tests/integrations/test_examples.py, tests/test_demo.py) only
start it, so that no code is written twice. Read with ast: nothing is imported."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
DIALECTS = ("fsdp1_llama", "fsdp2_llama", "yafsdp_llama", "zeta_llama", "torchacc_llama")
FRAMEWORKS = ("accelerate_llama", "hf_trainer_llama", "lightning_llama")
SHIPPED = ("yafsdp_llama", *FRAMEWORKS)  # run the package's script of the same name


def _tree(name: str) -> ast.Module:
    with open(os.path.join(EXAMPLES, name + ".py")) as handle:
        return ast.parse(handle.read())


def test_one_example_per_dialect_and_framework_and_nothing_else():
    scripts = sorted(name[:-3] for name in os.listdir(EXAMPLES) if name.endswith(".py"))
    assert scripts == sorted((*DIALECTS, *FRAMEWORKS, "common"))


@pytest.mark.parametrize("name", DIALECTS + FRAMEWORKS)
def test_each_example_says_how_to_run_it(name):
    docstring = ast.get_docstring(_tree(name))
    assert f"torchrun --standalone --nproc_per_node 2 examples/{name}.py" in docstring


@pytest.mark.parametrize("name", SHIPPED)
def test_a_shipped_example_is_started_not_copied(name):
    tree = _tree(name)
    imports = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert [(node.module, [alias.name for alias in node.names]) for node in imports] == [
        (f"fsdp_bridge.examples.{name}", ["main"])]
    with open(os.path.join(ROOT, "fsdp_bridge", "examples", name + ".py")) as handle:
        shipped = ast.parse(handle.read())
    assert "main" in {node.name for node in shipped.body if isinstance(node, ast.FunctionDef)}


@pytest.mark.parametrize("name", sorted(set(DIALECTS) - set(SHIPPED)))
def test_a_dialect_example_is_its_shard_function_on_the_shared_loop(name):
    tree = _tree(name)
    assert "shard" in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "run(shard, __file__)" in ast.unparse(tree.body[-1])
