"""Every public import path of torch's FSDP modules has ours: changing `torch.distributed.fsdp`
to `fsdp_bridge.fsdp` in an import line never breaks it. Names we do not replace are torch's
own objects (user code mixes them with ours)."""

from __future__ import annotations

import importlib
import inspect
import sys

import pytest

# Ours, not torch's: the wrapper, FSDP2's entry points, and share_comm_ctx (torch's refuses
# modules that are not torch's FSDPModule).
REPLACED = {"FullyShardedDataParallel", "fully_shard", "FSDPModule", "UnshardHandle",
            "register_fsdp_forward_method", "share_comm_ctx"}

PAIRS = [
    ("torch.distributed.fsdp", "fsdp_bridge.fsdp"),
    ("torch.distributed.fsdp.fully_sharded_data_parallel",
     "fsdp_bridge.fsdp.fully_sharded_data_parallel"),
    ("torch.distributed.fsdp.api", "fsdp_bridge.fsdp.api"),
    ("torch.distributed.fsdp.wrap", "fsdp_bridge.fsdp.wrap"),
]


def _public(module) -> dict:
    """Public names a script may import from `module`: not modules, not what it merely
    imported from the standard library (typing, enum, contextlib ...)."""
    names = {}
    for name in dir(module):
        if name.startswith("_"):
            continue
        value = getattr(module, name)
        if inspect.ismodule(value):
            continue
        origin = getattr(value, "__module__", None) or ""
        if origin.split(".")[0] in sys.stdlib_module_names and not isinstance(value, (str, list)):
            continue
        names[name] = value
    return names


@pytest.mark.parametrize("torch_path, our_path", PAIRS)
def test_all_matches_torch(torch_path, our_path):
    theirs, ours = importlib.import_module(torch_path), importlib.import_module(our_path)
    assert sorted(getattr(ours, "__all__", [])) == sorted(getattr(theirs, "__all__", []))


@pytest.mark.parametrize("torch_path, our_path", PAIRS)
def test_every_public_name_is_importable_and_torchs_own_where_not_replaced(torch_path, our_path):
    theirs, ours = importlib.import_module(torch_path), importlib.import_module(our_path)
    missing = sorted(set(_public(theirs)) - set(dir(ours)))
    assert not missing, f"{our_path} lacks {missing}"
    for name, value in _public(theirs).items():
        if name in REPLACED:
            assert getattr(ours, name) is not value, f"{our_path}.{name} should be ours"
        else:
            assert getattr(ours, name) is value, f"{our_path}.{name} is not torch's object"


def test_submodules_of_torchs_package_exist_under_ours():
    import torch.distributed.fsdp as theirs

    public_modules = [n for n in dir(theirs) if not n.startswith("_")
                      and inspect.ismodule(getattr(theirs, n))]
    assert public_modules, "torch's package lists no public submodule"
    for name in public_modules:
        importlib.import_module(f"fsdp_bridge.fsdp.{name}")


def test_the_import_line_from_the_fsdp1_module_works():
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    from fsdp_bridge.fsdp.fully_sharded_data_parallel import (  # noqa: F401
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
        StateDictType,
    )

    assert StateDictType is TorchStateDictType
