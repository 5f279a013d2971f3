"""What differs between the torch releases we support: names of torch's FSDP modules that only
newer releases have are re-exported where torch has them and explained where it does not, and a
checkpoint save records its files whatever `dcp.save` returns (torch 2.11 returns metadata
without `storage_data`)."""

from __future__ import annotations

import importlib
import os
import types

import pytest
import torch

from fsdp_bridge import checkpoint
from fsdp_bridge.checkpoint import manifest
from fsdp_bridge.fsdp import _newer_torch


def test_newer_names_are_torchs_objects_where_torch_has_them_else_name_the_torch():
    import torch.distributed.fsdp as theirs

    import fsdp_bridge.fsdp as ours

    assert ours._NEWER_TORCH, "the table of newer names is empty"
    for name, needed in ours._NEWER_TORCH.items():
        if hasattr(theirs, name):
            assert getattr(ours, name) is getattr(theirs, name)
            assert (name in ours.__all__) == (name in theirs.__all__)
            continue
        assert not hasattr(ours, name) and name not in ours.__all__
        with pytest.raises(AttributeError) as err:
            getattr(ours, name)
        assert f"torch {needed}" in str(err.value) and torch.__version__ in str(err.value)


def test_reexport_takes_what_the_source_has_and_missing_names_the_release():
    source = types.SimpleNamespace(Old=object(), New=object())
    namespace: dict = {}
    newer = {"New": ">= 9.1", "Newest": ">= 9.2"}
    assert _newer_torch.reexport(namespace, source, newer) == ["New"]
    assert namespace == {"New": source.New}
    error = _newer_torch.missing("pkg.mod", "torch.mod", newer, "Newest")
    assert isinstance(error, AttributeError)
    assert "pkg.mod.Newest" in str(error) and "torch >= 9.2" in str(error)
    assert str(_newer_torch.missing("pkg.mod", "torch.mod", newer, "Typo")) == (
        "module 'pkg.mod' has no attribute 'Typo'")


def test_star_import_brings_what_torchs_module_lists():
    import torch.distributed.fsdp as theirs

    import fsdp_bridge.fsdp as ours

    assert sorted(ours.__all__) == sorted(theirs.__all__)


def test_save_records_the_files_the_checkpoint_holds(tmp_path):
    path = str(tmp_path / "ckpt")
    state = {"w": torch.arange(12.0).reshape(4, 3), "inner": {"b": torch.ones(5)}, "step": 7}
    checkpoint.save(state, path)
    recorded = set(manifest.read(path)["sha256"])
    on_disk = set(os.listdir(path)) - {manifest.MANIFEST}
    assert recorded == on_disk
    assert ".metadata" in recorded and any(name.endswith(".distcp") for name in recorded)
    loaded = {"w": torch.zeros(4, 3), "inner": {"b": torch.zeros(5)}, "step": -1}
    checkpoint.load(loaded, path)
    torch.testing.assert_close(loaded["w"], state["w"], rtol=0, atol=0)
    torch.testing.assert_close(loaded["inner"]["b"], state["inner"]["b"], rtol=0, atol=0)
    assert loaded["step"] == 7


def test_every_module_of_the_package_imports():
    """On every supported torch (a name torch added later breaks an import at once)."""
    import pkgutil

    import fsdp_bridge

    skipped = ("fsdp_bridge.__main__", "fsdp_bridge.harness._site")
    names = [info.name for info in pkgutil.walk_packages(fsdp_bridge.__path__, "fsdp_bridge.")
             if not info.name.startswith(skipped)]
    assert "fsdp_bridge.fsdp.fully_sharded_data_parallel" in names
    for name in names:
        importlib.import_module(name)
