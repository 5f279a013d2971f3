"""`fabric.save` / `fabric.load` with the "fsdp_bridge" Fabric strategy, world 2 on CPU/gloo,
tiny Llama: a full checkpoint saved after 2 of 4 steps and loaded into a fresh model (another
seed) and optimizer resumes with the losses of the uninterrupted run; the file is laid out as
Fabric's FSDPStrategy writes full checkpoints (model keys without wrapper parts, optimizer state
keyed by name, the rest as given); an optimizer state keyed by parameter index (as Lightning's
own FSDP strategies may write) loads the same. Torch's FSDP1 cannot write a full checkpoint on
a CPU-only machine (it crashes offloading), so no native file is loaded here."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from tests import models as M  # noqa: E402
from tests.integrations.common import same  # noqa: E402
from tests.world import run_world  # noqa: E402

STEPS, SAVED_AT, PER_DEVICE = 4, 2, 4


def _train(fabric, model, optimizer, steps, rank, world):
    from tests.integrations.lightning_cases import fabric_steps

    batches = M.global_batches(STEPS, PER_DEVICE * world)
    return fabric_steps(fabric, model, optimizer, batches, steps, rank, world)


def _set_up(fabric, seed):
    from tests.integrations.lightning_cases import fabric_set_up

    return fabric_set_up(fabric, seed)


def _by_index(checkpoint: dict) -> dict:
    """The checkpoint with its optimizer state keyed by parameter index."""
    names = list(checkpoint["model"])
    index = {name: names.index(name) for name in names}
    optim = checkpoint["optimizer"]
    return dict(checkpoint, optimizer={
        "state": {index[name]: value for name, value in optim["state"].items()},
        "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in optim["param_groups"]]})


def save_and_resume(rank, world, folder):
    import torch
    from lightning.fabric import Fabric

    import fsdp_bridge.integrations.lightning  # noqa: F401  (registers "fsdp_bridge")
    from tests.integrations.lightning_cases import as_torchrun_rank

    as_torchrun_rank()
    fabric = Fabric(accelerator="cpu", devices=world, strategy="fsdp_bridge")
    fabric.launch()
    path = os.path.join(folder, "fabric.ckpt")
    model, optimizer = _set_up(fabric, 0)
    losses = _train(fabric, model, optimizer, range(SAVED_AT), rank, world)
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": SAVED_AT})
    losses += _train(fabric, model, optimizer, range(SAVED_AT, STEPS), rank, world)
    out = {"losses": losses}
    saved = torch.load(path, weights_only=False)
    out["layout"] = {"keys": sorted(saved), "model": list(saved["model"]),
                     "optimizer": sorted(saved["optimizer"]["state"]), "step": saved["step"]}
    if rank == 0:
        torch.save(_by_index(saved), os.path.join(folder, "by_index.ckpt"))
    fabric.barrier()
    for name in ("fabric.ckpt", "by_index.ckpt"):
        model, optimizer = _set_up(fabric, 1)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        rest = fabric.load(os.path.join(folder, name), state)
        out[name] = {"step": state["step"], "rest": rest,
                     "resumed": _train(fabric, model, optimizer, range(SAVED_AT, STEPS), rank, world)}
    return out


def test_fabric_save_and_load_resume_equal(tmp_path):
    names = list(M.tiny_llama().state_dict())
    for out in run_world(save_and_resume, 2, str(tmp_path)):
        assert out["layout"] == {"keys": ["model", "optimizer", "step"], "model": names,
                                 "optimizer": sorted(n for n in names if "rotary" not in n),
                                 "step": SAVED_AT}
        for name in ("fabric.ckpt", "by_index.ckpt"):
            assert out[name]["step"] == SAVED_AT and out[name]["rest"] == {}
            same(out[name]["resumed"], out["losses"][SAVED_AT:], f"resumed from {name}")


def test_fabric_strategy_refuses_sharded_checkpoints():
    from fsdp_bridge.integrations.lightning import FabricFSDPStrategy

    with pytest.raises(ValueError, match="state_dict_type='sharded' is not accepted"):
        FabricFSDPStrategy(state_dict_type="sharded")
