"""Every writer owns only what it wrote: `save`, `save_state`, `CheckpointManager`, every
`convert-checkpoint` target and `hf.save_pretrained` replace their own files (those their
manifest lists, or their format's by name) and keep every other entry of the directory, the
same file, with symbolic links left as links and their targets untouched; with and without
`overwrite=True` / `--force`, and across a crash between the two renames of a replacement.
Without ranks, in this process."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from fsdp_bridge import checkpoint
from fsdp_bridge.checkpoint import atomic, manifest, ownership
from fsdp_bridge.checkpoint.validate import CheckpointError
from fsdp_bridge.cli import main as cli_main
from tests.checkpoint import user_files

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _load(path, size=3):
    state = {"w": torch.empty(size), "step": -1}
    checkpoint.load(state, str(path))
    return state


def _siblings(path) -> list:
    return sorted(n for n in os.listdir(os.path.dirname(str(path))) if ".tmp-" in n or ".old-" in n)


def test_save_keeps_the_users_files_and_links_with_and_without_overwrite(tmp_path):
    path = tmp_path / "ckpt"
    checkpoint.save({"w": torch.full((3,), 1.0), "step": 1}, str(path))
    planted = user_files.plant(path, tmp_path / "elsewhere")
    checkpoint.save({"w": torch.full((3,), 2.0), "step": 2}, str(path))
    assert user_files.intact(planted) and _load(path)["step"] == 2
    checkpoint.save({"w": torch.full((3,), 3.0), "step": 3}, str(path), overwrite=True)
    assert user_files.intact(planted) and _load(path)["step"] == 3
    assert torch.equal(_load(path)["w"], torch.full((3,), 3.0))
    assert manifest.read(str(path))["sha256"].keys() == {".metadata", "__0_0.distcp"}
    assert _siblings(path) == []


def test_overwrite_into_a_directory_another_tool_wrote_replaces_only_that_format(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "theirs"
    dcp.save({"w": torch.ones(3), "step": 0}, checkpoint_id=str(path))  # torch's, no manifest
    planted = user_files.plant(path, tmp_path / "elsewhere")
    with pytest.raises(CheckpointError, match="overwrite=True to write the checkpoint into it"):
        checkpoint.save({"w": torch.zeros(3), "step": 1}, str(path))
    assert user_files.intact(planted) and _load(path)["step"] == 0
    checkpoint.save({"w": torch.zeros(3), "step": 1}, str(path), overwrite=True)
    assert user_files.intact(planted) and _load(path)["step"] == 1


def test_save_state_and_the_manager_keep_the_users_files(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    path = tmp_path / "state"
    checkpoint.save_state(str(path), model, optimizer)
    planted = user_files.plant(path, tmp_path / "elsewhere")
    for overwrite in (False, True):
        with torch.no_grad():
            model.weight.add_(1.0)
        checkpoint.save_state(str(path), model, optimizer, overwrite=overwrite)
        assert user_files.intact(planted)
    other = torch.nn.Linear(3, 2)
    checkpoint.load_state(str(path), other)
    assert torch.equal(other.weight, model.weight)
    # keep=1: the old step loses our files; the user's file in it stays, and so does the folder.
    manager = checkpoint.CheckpointManager(str(tmp_path / "run"), keep=1)
    manager.save(1, model)
    kept = user_files.plant(manager.path(1), tmp_path / "elsewhere_run")
    manager.save(2, model)
    assert manager.steps() == [2] and user_files.intact(kept)
    assert sorted(os.listdir(manager.path(1))) == ["NOTES.md", "mine", "shared.txt"]


def test_a_crash_between_the_renames_loses_no_user_file(tmp_path):
    """What a save killed between its two renames leaves: no `path`, the previous directory
    (with the user's files) under `.old-`, the new one under `.tmp-` (our files, links to
    theirs). Loading reads the `.old-`; the next save puts the user's files back."""
    path = tmp_path / "ckpt"
    checkpoint.save({"w": torch.full((3,), 1.0), "step": 1}, str(path))
    planted = user_files.plant(path, tmp_path / "elsewhere")
    tmp = atomic.temporary_path(str(path), "0123456789ab")
    os.makedirs(tmp)
    ownership.carry(str(path), tmp, ownership.owner("dcp", [str(path)]))
    os.rename(path, f"{path}{atomic.OLD}0123456789ab")
    with pytest.warns(UserWarning, match="a save crashed while replacing it"):
        assert _load(path)["step"] == 1
    checkpoint.save({"w": torch.full((3,), 2.0), "step": 2}, str(path))
    assert user_files.intact(planted) and _load(path)["step"] == 2 and _siblings(path) == []


def test_a_replaced_directory_is_taken_apart_never_removed_whole(tmp_path):
    """Entries the new directory lacks move in; one it names with other contents (a file
    replaced while the save ran) stays in the old directory, named in a warning."""
    old, live = tmp_path / "ckpt.old-0123456789ab", tmp_path / "ckpt"
    for directory in (old, live):
        (directory / "sub").mkdir(parents=True)
        (directory / "notes.txt").write_text(f"{directory.name}'s notes")
    (old / ".metadata").write_text("ours")
    (old / "late.txt").write_text("written while the save ran")
    (old / "sub" / "late.txt").write_text("this one too")
    (old / "late_dir").mkdir()
    (old / "late_dir" / "x").write_text("x")
    with pytest.warns(UserWarning, match=r"kept .*ckpt.old-0123456789ab.* notes.txt"):
        kept = ownership.dismantle(str(old), str(live), ownership.owner("dcp"))
    assert kept == [str(old / "notes.txt")]
    assert sorted(os.listdir(old)) == ["notes.txt"]
    assert (live / "late.txt").read_text() == "written while the save ran"
    assert (live / "sub" / "late.txt").read_text() == "this one too"
    assert (live / "late_dir" / "x").read_text() == "x"
    assert (live / "notes.txt").read_text() == "ckpt's notes"


# -- convert-checkpoint ------------------------------------------------------------------------


def _convert(capsys, *argv):
    code = cli_main(["convert-checkpoint", *map(str, argv)])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return code, out


@pytest.mark.parametrize("to, name", [("torch", "out.pt"), ("safetensors", "out.safetensors"),
                                      ("dcp", "out_dcp"), ("safetensors", "out_hf")])
def test_every_convert_target_keeps_the_users_files(tmp_path, capsys, to, name):
    source = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.ones(4)}, "step": 1}, source)
    folder = tmp_path / "dst"
    folder.mkdir()
    target = folder / name
    assert _convert(capsys, source, target, "--to", to)[0] == 0
    # In the directory written, or beside the file written.
    planted = user_files.plant(target if target.is_dir() else folder, tmp_path / "elsewhere")
    code, out = _convert(capsys, source, target, "--to", to)
    assert code == 2 and "exists; pass --force" in out.err
    for again in range(2):
        torch.save({"model": {"w": torch.full((4,), 2.0 + again)}, "step": 2}, source)
        assert _convert(capsys, source, target, "--to", to, "--force")[0] == 0
        assert user_files.intact(planted)
    back = tmp_path / "back.pt"
    assert _convert(capsys, target, back, "--to", "torch")[0] == 0
    loaded = torch.load(back, weights_only=True)
    assert torch.equal(loaded["model"]["w"] if "model" in loaded else loaded["w"],
                       torch.full((4,), 3.0))
    assert _siblings(target) == []


def test_convert_over_a_sharded_hugging_face_directory_keeps_all_but_the_weights(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    for index, key in enumerate(("a", "b"), start=1):
        save_file({key: torch.zeros(2)}, hf_dir / f"model-0000{index}-of-00002.safetensors")
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors",
                        "b": "model-00002-of-00002.safetensors"}}))
    theirs = {"config.json": "{}", "tokenizer.json": "{}", "README.md": "# model card\n",
              "pytorch_model.bin.bak": "old"}
    for file, text in theirs.items():
        (hf_dir / file).write_text(text)
    planted = user_files.plant(hf_dir, tmp_path / "elsewhere")
    source = tmp_path / "full.pt"
    torch.save({"model": {"w": torch.ones(4)}}, source)
    assert _convert(capsys, source, hf_dir, "--to", "safetensors", "--force")[0] == 0
    assert user_files.intact(planted)
    assert all((hf_dir / file).read_text() == text for file, text in theirs.items())
    names = set(os.listdir(hf_dir))
    assert "model.safetensors" in names and not any(n.startswith("model-0") for n in names)
    assert "model.safetensors.index.json" not in names  # stale: would point at removed shards
    assert load_file(hf_dir / "model.safetensors").keys() == {"w"}


# -- save_pretrained ---------------------------------------------------------------------------


def _tiny_llama(seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2))


def _tokenizer():
    import tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(
        WordLevel({"<unk>": 0, "hello": 1}, unk_token="<unk>")))


def test_save_pretrained_writes_what_transformers_writes_and_keeps_the_rest(tmp_path):
    from fsdp_bridge.checkpoint import hf

    pytest.importorskip("transformers")
    model = _tiny_llama(0)
    model.save_pretrained(tmp_path / "native")
    native = sorted(os.listdir(tmp_path / "native"))
    ours = tmp_path / "ours"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf.save_pretrained(model, str(ours), max_shard_size="2KB")  # sharded first
        _tokenizer().save_pretrained(ours)  # Hugging Face's order: model, tokenizer, model
        (ours / "README.md").write_text("# model card\n")
        planted = user_files.plant(ours, tmp_path / "elsewhere")
        tokenizer_files = user_files.digests(ours, only={"tokenizer.json",
                                                         "tokenizer_config.json", "README.md"})
        for overwrite in (False, True):
            hf.save_pretrained(model, str(ours), overwrite=overwrite)
            assert user_files.intact(planted)
            assert user_files.unchanged(ours, tokenizer_files) and len(tokenizer_files) == 3
    written = sorted(set(os.listdir(ours)) - set(tokenizer_files) - {"NOTES.md", "mine",
                                                                    "shared.txt"})
    assert written == sorted(native + [manifest.MANIFEST])  # the shards and their index: gone
    loaded = type(model).from_pretrained(ours)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                 model.state_dict().values()))
    assert _siblings(ours) == []


def test_save_pretrained_into_a_model_it_did_not_write_needs_overwrite(tmp_path):
    from fsdp_bridge.checkpoint import hf

    pytest.importorskip("transformers")
    theirs = tmp_path / "theirs"
    _tiny_llama(1).save_pretrained(theirs)  # transformers' own: no manifest
    _tokenizer().save_pretrained(theirs)
    before = user_files.digests(theirs)
    model = _tiny_llama(2)
    with pytest.raises(CheckpointError, match=r"model files fsdp-bridge did not write \("
                                              r"config.json, generation_config.json"):
        hf.save_pretrained(model, str(theirs))
    assert user_files.digests(theirs) == before
    hf.save_pretrained(model, str(theirs), overwrite=True)
    assert user_files.unchanged(theirs, {k: v for k, v in before.items() if "token" in k})
    loaded = type(model).from_pretrained(theirs)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    # Only a tokenizer there: written into without overwrite, as transformers would.
    shared = tmp_path / "tokenizer_first"
    _tokenizer().save_pretrained(shared)
    hf.save_pretrained(model, str(shared))
    assert {"tokenizer.json", "config.json", "model.safetensors"} <= set(os.listdir(shared))


# -- interrupts --------------------------------------------------------------------------------


def test_ctrl_c_while_writing_leaves_the_old_checkpoint_and_says_one_line(tmp_path, capsys,
                                                                          monkeypatch):
    source = tmp_path / "full.pt"
    torch.save({"w": torch.ones(4)}, source)
    target = tmp_path / "dcp"
    assert _convert(capsys, source, target, "--to", "dcp")[0] == 0
    planted = user_files.plant(target, tmp_path / "elsewhere")
    before = user_files.digests(target)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest, "write", interrupted)  # the files are written, not published
    torch.save({"w": torch.zeros(4)}, source)
    code, out = _convert(capsys, source, target, "--to", "dcp", "--force")
    assert code == 130 and out.err.strip().splitlines() == [
        "fsdp-bridge convert-checkpoint: interrupted (Ctrl-C)."]
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save({"w": torch.zeros(4)}, str(target))
    monkeypatch.undo()
    assert user_files.digests(target) == before and user_files.intact(planted)
    state = {"w": torch.empty(4)}
    checkpoint.load(state, str(target))
    assert torch.equal(state["w"], torch.ones(4)) and _siblings(target) == []


def test_torchacc_consolidation_replaces_only_its_file(tmp_path):
    from fsdp_bridge import torchacc

    run = tmp_path / "run"
    run.mkdir()
    full = torch.arange(6.0).view(2, 3)
    for rank in range(2):  # what torchacc.save(..., master_only=False) writes on two ranks
        torch.save({"model": {"w": full.reshape(-1)[3 * rank:3 * rank + 3], "step": 7},
                    "shard_metadata": {"world_size": 2, "rank": rank, "shard_world_size": 2,
                                       "shard_rank": rank, "shard_shapes": {"w": (2, 3)}}},
                   run / f"rank{rank}-of-2-model.pth")
    planted = user_files.plant(run, tmp_path / "elsewhere")
    shards = user_files.digests(run, only={"rank0-of-2-model.pth", "rank1-of-2-model.pth"})
    for _ in range(2):
        torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(str(run))
        assert user_files.intact(planted) and user_files.unchanged(run, shards)
        assert torch.equal(torch.load(run / "consolidated.pth")["model"]["w"], full)
    assert sorted(os.listdir(run)) == ["NOTES.md", "consolidated.pth", "mine",
                                       "rank0-of-2-model.pth", "rank1-of-2-model.pth",
                                       "shared.txt"]
