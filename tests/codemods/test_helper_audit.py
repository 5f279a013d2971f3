"""Under `--to fsdp2` a runtime helper of `fsdp_bridge.migrate.runtime` appears only where torch
has no form for the site: every helper an output calls is listed in NEEDED_AT_RUN_TIME with what
it does that no torch call does, and none of them merely hands its arguments to one torch call
(such a helper would have to be written as that call instead). Checked over every input the
codemod tests know: the corpus, the runnable fixtures and the `--to fsdp2` fixture pairs.
"""

import ast
import inspect
import pathlib
import re
import textwrap

from fsdp_bridge.migrate import runtime
from fsdp_bridge.migrate.driver import transform_source
from tests.codemods.runnable_loader import load_fixture as _load
from tests.world import run_world

HERE = pathlib.Path(__file__).parent
INPUTS = sorted((HERE / "corpus").glob("*.py")) + sorted((HERE / "runnable").glob("*.py")) \
    + sorted((HERE / "fixtures" / "fsdp2").glob("*.in.py"))

# What each helper needs that is not in the file: no torch call does it at that site.
NEEDED_AT_RUN_TIME = {
    "fsdp1_fully_shard": "FSDP1 arguments that are not literals: the wrap policy's units, the strategy's mesh, "
                         "ignored modules or parameters, meta init and sync_module_states unit by unit",
    "fsdp1_no_sync": "whether the receiver is an FSDP2 module (set_requires_gradient_sync) or has no_sync()",
    "fsdp1_clip_grad_norm_": "whether the receiver is an FSDP2 module (torch.nn.utils) or has the method",
    "fsdp1_state_dict_options": "the StateDictOptions of a state-dict type or config held in a value",
    "fsdp1_state_dict_type": "a state_dict_type context held in a value: the options of the calls it governs",
    "fsdp1_state_dict": "whether the receiver holds FSDP2 modules, and the options of an active context",
    "fsdp1_load_state_dict": "whether the receiver holds FSDP2 modules, and the options of an active context",
    "fsdp1_optim_state_dict": "copies of the tensors DCP shares with the optimizer, for a state the file keeps; "
                              "FSDP1's default config (full on every rank, on the CPU)",
    "fsdp1_optim_state_dict_to_load": "the loaded state for a later load_state_dict; torch 2.0's argument order",
    "fsdp1_scatter_full_optim_state_dict": "the loaded state for a later load_state_dict",
    "fsdp1_fsdp_modules": "FSDP1 wrappers a kept constructor builds; the outermost modules of the built model",
    "fsdp1_unwrap": "whether the receiver is a sharded model (no wrapper) or has .module",
    "fsdp1_load_sharded_optimizer_state_dict": "the checkpoint's optimizer entries read as DTensors laid out as "
                                               "the model state dict's parameters (torch's function builds "
                                               "FSDP1 ShardedTensors)",
    "fsdp1_module_class": "the class a module had before fully_shard gave it one of its own (torch records it "
                          "only among the new class's bases)",
}


def is_pass_through(function) -> bool:
    """True if the function's body (its docstring aside) only hands its parameters, in order, to one
    call: `return f(a, b)`, or `with f(a, b): yield` for a context manager."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    definition = tree.body[0]
    body = definition.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1:
        return False
    (statement,) = body
    if isinstance(statement, ast.Return):
        call = statement.value
    elif isinstance(statement, ast.With) and len(statement.items) == 1 and len(statement.body) == 1:
        call = statement.items[0].context_expr
    else:
        return False
    if not isinstance(call, ast.Call):
        return False
    parameters = [a.arg for a in definition.args.posonlyargs + definition.args.args + definition.args.kwonlyargs]
    passed = [ast.unparse(a) for a in call.args] + [ast.unparse(k.value) for k in call.keywords]
    return passed == parameters


def _pass_through_example(model, max_norm):
    """Clips."""
    return runtime.torch.nn.utils.clip_grad_norm_(model, max_norm)


def _not_pass_through_example(model, max_norm):
    return runtime.torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def test_the_pass_through_check_tells_them_apart():
    assert is_pass_through(_pass_through_example)
    assert not is_pass_through(_not_pass_through_example)
    assert not is_pass_through(runtime.fsdp1_no_sync)


def test_no_helper_a_migrated_file_may_call_is_a_pass_through():
    assert set(NEEDED_AT_RUN_TIME) <= set(runtime.__all__)
    assert [name for name in NEEDED_AT_RUN_TIME if is_pass_through(getattr(runtime, name))] == []


def _helpers_called(output: str) -> set[str]:
    tree = ast.parse(output)
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module == "fsdp_bridge.migrate.runtime" for alias in node.names}
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id in imported}


def test_fsdp2_outputs_call_only_helpers_that_torch_cannot_replace():
    assert len(INPUTS) >= 85
    unlisted, unexplained = {}, []
    for path in INPUTS:
        output, sites = transform_source(path.read_text(), "fsdp2")
        called = _helpers_called(output)
        if called - set(NEEDED_AT_RUN_TIME):
            unlisted[path.name] = called - set(NEEDED_AT_RUN_TIME)
        unexplained += [(path.name, site["line"]) for site in sites
                        if site["status"] == "translated via runtime helper" and len(site["reason"]) < 20]
    assert unlisted == {} and unexplained == []


def test_sites_with_a_torch_form_import_nothing_of_fsdp_bridge():
    """A wrap policy on a model built in the call, an optimizer state saved after its block, a load
    written inside optim.load_state_dict(...): torch alone."""
    for path in (HERE / "fixtures" / "fsdp2" / "layout_kept.in.py",
                 HERE / "fixtures" / "fsdp2" / "state_dict_sharded_load.in.py",
                 HERE / "runnable" / "fsdp1_checkpoint_check_fn.py"):
        output, _ = transform_source(path.read_text(), "fsdp2")
        assert not re.search(r"^\s*(from|import) fsdp_bridge\b", output, re.MULTILINE), path.name
    output, sites = transform_source((HERE / "runnable" / "fsdp1_torch_forms.py").read_text(), "fsdp2")
    assert _helpers_called(output) == {"fsdp1_optim_state_dict"}
    (kept,) = [site for site in sites if site["status"] == "translated via runtime helper"]
    assert "sharded_osd is used beyond a torch.save(...)" in kept["reason"]


def _run_both(rank, world_size, original, rewritten):
    return _load(original).train(rank), _load(rewritten).train(rank)


def test_torch_forms_behave_like_fsdp1(tmp_path):
    original = HERE / "runnable" / "fsdp1_torch_forms.py"
    rewritten = tmp_path / "fsdp1_torch_forms_fsdp2.py"
    rewritten.write_text(transform_source(original.read_text(), "fsdp2")[0])
    results = run_world(_run_both, 2, str(original), str(rewritten), timeout=240)
    for fsdp1, fsdp2 in results:
        assert len(fsdp1["losses"]) == 5 and fsdp1 == fsdp2
    assert results[0][0]["saved"]  # rank 0 saved a full state with Adam's entries
