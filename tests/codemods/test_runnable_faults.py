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
  2.1+'s spellings;
- fsdp1_sharded_resume.py: FSDP1's sharded resume (`load_sharded_optimizer_state_dict`, and
  `optim_state_dict_to_load` reached through the model in an `isinstance` branch), and a load left
  under a TODO that names the state_dict_type it ran under;
- fsdp1_check_fn_class.py: check_fns and a walk that test a module's class by name and by bases
  (fully_shard's FSDP<Block> class would answer otherwise for every block);
- fsdp1_wrapped_clip.py: `no_sync()` and `clip_grad_norm_()` reached through torch's activation
  checkpoint wrapper around the model;
- fsdp1_param_groups.py: AdamW groups built from the wrapped model's names: the same with
  use_orig_params=True; with FSDP1's flat parameters the walk is flagged (FB216), and the groups
  do change (which is why);
- fsdp1_adapter_save.py: adapters saved unit by unit, found by name in a walk.
"""

import pathlib

from fsdp_bridge.migrate.driver import transform_source
from tests.codemods.runnable_loader import load_fixture as _load
from tests.world import run_world

RUNNABLE = pathlib.Path(__file__).parent / "runnable"
FIXTURES = ("fsdp1_meta_sync", "fsdp1_checkpoint_styles", "fsdp1_torch20_forms", "fsdp1_optimizer_options",
            "fsdp1_wrapper_reads", "fsdp1_checkpoint_check_fn", "fsdp1_sharded_resume", "fsdp1_check_fn_class",
            "fsdp1_wrapped_clip", "fsdp1_param_groups", "fsdp1_adapter_save")
# Arguments of both runs of a fixture.
ARGUMENTS = {"fsdp1_sharded_resume": {"reload_model": True}}


def _run_all(rank, world_size, pairs):
    results = {}
    for name, original, rewritten in pairs:
        # Native FSDP1 cannot sync module states on CPU: its reference run builds the model everywhere.
        kwargs = {"low_memory": False} if name == "fsdp1_meta_sync" else {}
        results[name] = (_load(original).train(rank, **kwargs, **ARGUMENTS.get(name, {})),
                         _load(rewritten).train(rank, **ARGUMENTS.get(name, {})))
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
        if name == "fsdp1_sharded_resume":  # FSDP1's sharded resume: the helper, on the model's DTensors
            assert "fsdp1_load_sharded_optimizer_state_dict(" in source and ".optim_state_dict_to_load(" not in source
            assert ("# TODO(fsdp-bridge FB299): model.load_state_dict(...): only load_state_dict(state_dict) and "
                    "load_state_dict(state_dict, strict=...) are translated (this ran inside `with "
                    "FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):`") in source
        if name == "fsdp1_check_fn_class":
            assert source.count("fsdp1_module_class(") == 3  # the walk and both check_fns
        if name == "fsdp1_param_groups":  # flagged where FSDP1 showed flat parameters only
            assert source.count("# TODO(fsdp-bridge FB216): model.named_parameters() walked: FSDP1 with "
                                "use_orig_params=False") == 1 and source.count("TODO(fsdp-bridge FB216)") == 1
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
        fsdp1, fsdp2 = rank_result["fsdp1_sharded_resume"]
        assert fsdp1["losses"][3:5] == fsdp1["losses"][5:7] == fsdp1["losses"][1:3] and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_check_fn_class"]
        assert fsdp1["by name"]["checkpointed"] == fsdp1["by name"]["layers found"] == 2
        assert fsdp1["by bases"]["checkpointed"] == 0 and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_wrapped_clip"]
        assert len(fsdp1["norms"]) == 2 and fsdp1 == fsdp2
        fsdp1, fsdp2 = rank_result["fsdp1_param_groups"]
        assert fsdp1["original names"]["group sizes"] == [3, 7] and fsdp1["original names"] == fsdp2["original names"]
        # FSDP1's flat parameters hold no "norm" nor "bias" in their names: one group, all decayed.
        assert fsdp1["flat"]["group sizes"] == [3, 0] and fsdp2["flat"]["group sizes"] == [3, 7]
        fsdp1, fsdp2 = rank_result["fsdp1_adapter_save"]
        assert fsdp1 == fsdp2 and len(fsdp1) == 2
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
