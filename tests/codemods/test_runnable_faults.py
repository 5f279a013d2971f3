"""Runnable fixtures for the fault classes the codemod must never get silently wrong, each run
before and after `migrate --to fsdp2` inside one 2-rank gloo world:

- fsdp1_meta_sync.py: ranks other than 0 on meta + sync_module_states + param_init_fn (the
  runtime helper must materialise before it broadcasts, or the ranks issue different collectives);
- fsdp1_checkpoint_styles.py: state_dict_type held in a variable and chosen at run time, a save
  helper that receives FSDP or DDP modules, a state dict taken outside any context, blocks on a
  parameter with literal configs held in variables (rewritten to torch alone), optimizer state
  through full_optim_state_dict / scatter_full_optim_state_dict / optim_state_dict_to_load;
- fsdp1_optimizer_options.py: FSDP1's default optimizer config (full on every rank, on the
  CPU), a state saved on rank 0 only and loaded back with rank0_only (the other ranks pass None);
- fsdp1_wrapper_reads.py: a compiled model loaded through `model._orig_mod.load_state_dict`, a
  state dict taken inside a context held in a variable from a name the file does not prove;
- fsdp1_checkpoint_check_fn.py: an activation-checkpointing check_fn that skips FSDP1's wrapper
  objects with `not isinstance(m, FSDP)` (narrowed, it would skip every sharded block);
- fsdp1_torch20_forms.py: torch 2.0's `ignored_parameters=` and `optim_state_dict_to_load(osd,
  model, optim)`, which current torch no longer runs: its reference is the same file in torch
  2.1+'s spellings.
"""

import pathlib

from fsdp_bridge.migrate.driver import transform_source
from tests.codemods.runnable_loader import load_fixture as _load
from tests.world import run_world

RUNNABLE = pathlib.Path(__file__).parent / "runnable"
FIXTURES = ("fsdp1_meta_sync", "fsdp1_checkpoint_styles", "fsdp1_torch20_forms", "fsdp1_optimizer_options",
            "fsdp1_wrapper_reads", "fsdp1_checkpoint_check_fn")


def _run_all(rank, world_size, pairs):
    results = {}
    for name, original, rewritten in pairs:
        # Native FSDP1 cannot sync module states on CPU: its reference run builds the model everywhere.
        kwargs = {"low_memory": False} if name == "fsdp1_meta_sync" else {}
        results[name] = (_load(original).train(rank, **kwargs), _load(rewritten).train(rank))
    return results


def test_rewritten_fixtures_behave_like_fsdp1(tmp_path):
    pairs, all_sites = [], {}
    for name in FIXTURES:
        source, sites = transform_source((RUNNABLE / f"{name}.py").read_text(), "fsdp2")
        assert "FullyShardedDataParallel as FSDP" not in source or "TODO" not in source
        rewritten = tmp_path / f"{name}_fsdp2.py"
        if name == "fsdp1_checkpoint_styles":  # the blocks with literal configs in variables: torch alone
            assert "get_model_state_dict(model, options=StateDictOptions(full_state_dict=False))" in source
            assert "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))" in source
            assert "isinstance(submodule, FSDPModule)]" in source
            assert "(full_osd if dist.get_rank() == 0 else None) or {}," in source
        if name == "fsdp1_optimizer_options":
            assert "broadcast_from_rank0=True" in source and "fsdp1_optim_state_dict(model, optimizer)" in source
        if name == "fsdp1_wrapper_reads":
            assert "fsdp1_load_state_dict(model._orig_mod, state)" in source and "fsdp1_state_dict(unwrapped)" in source
        original = RUNNABLE / f"{name}.py"
        if name == "fsdp1_torch20_forms":
            # ignored parameters given by a .parameters() call: fully_shard's own ignored_params
            assert "ignored_params=set(inner[1].parameters())" in source and "ignored_parameters=list(" not in source
            reference = tmp_path / f"{name}_current.py"
            reference.write_text(_load(str(original)).current_spellings(original.read_text()))
            original = reference
        rewritten.write_text(source)
        pairs.append((name, str(original), str(rewritten)))
        all_sites[name] = {(s["rule"], s["status"]) for s in sites}
    assert ("FB101", "translated via runtime helper") in all_sites["fsdp1_meta_sync"]
    # scatter_full_optim_state_dict followed by optim.load_state_dict: torch's set_optimizer_state_dict alone.
    assert {("FB208", "translated via runtime helper"), ("FB104", "translated in place"),
            ("FB104", "translated via runtime helper")} <= all_sites["fsdp1_checkpoint_styles"]
    results = run_world(_run_all, 2, pairs, timeout=240)
    for rank_result in results:
        fsdp1, fsdp2 = rank_result["fsdp1_meta_sync"]
        assert len(fsdp1) == 3 and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_torch20_forms"]
        assert len(fsdp1["optimizer reload"]) == 4 and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_optimizer_options"]
        assert len(fsdp1["losses"]) == 4 and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_wrapper_reads"]
        assert fsdp1["changed"] and fsdp1["after load"] == fsdp1["taken"] and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_checkpoint_check_fn"]
        assert fsdp1["checkpointed blocks"] == 2 and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_checkpoint_styles"]
        assert fsdp1 == fsdp2, (fsdp1["optimizer losses"], fsdp2["optimizer losses"])
    rank0, rank1 = (r["fsdp1_checkpoint_styles"][1] for r in results)
    assert {kind for kind, _ in rank0["sharded=True"].values()} == {"sharded"}
    assert {kind for kind, _ in rank0["sharded=False"].values()} == {"full"}
    assert rank1["sharded=False"] == {}  # rank0_only
    assert {kind for kind, _ in rank0["sharded, literal config in a variable"].values()} == {"sharded"}
    assert {kind for kind, _ in rank1["full, literal config in a variable"].values()} == {"full"}
    assert rank0["ddp"] == ["module.bias", "module.weight"]
    assert rank0["fsdp units"] == 1  # and the same count before the rewrite (fsdp1 == fsdp2 above)
    assert len(rank0["optimizer losses"]) == 4
    rank0, rank1 = (r["fsdp1_optimizer_options"][1] for r in results)
    assert rank1["rank 0 only"] == {} and rank0["rank 0 only"] == rank1["default"]
    assert {device for entry in rank1["default"].values() for device, _, _ in entry.values()} == {"cpu"}
