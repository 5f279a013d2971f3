"""Checkpoints written by Lightning's own FSDP strategies (torch's FSDP1, full state dicts) load
into the "fsdp_bridge" strategies, and ours load into Lightning's, on CUDA
(`FSDP_BRIDGE_DEVICE=cuda`, one rank per GPU): after the resume, each side's losses equal the
uninterrupted run of the side that wrote the file, in fp32 and under bf16 mixed precision.

Trainer: `trainer.save_checkpoint` / `fit(ckpt_path=...)`, Lightning's FSDPStrategy against
ours. Fabric: `fabric.save` / `fabric.load` with Fabric's FSDPStrategy(state_dict_type="full")
against strategy="fsdp_bridge".

On the CPU every test here is skipped: torch's FSDP1 crashes when it offloads a full state dict
on a CPU-only torch, so no native file can be written there (test_lightning_cross_load.py
covers the native-to-ours direction on the CPU with a subclass that skips the offload)."""

from __future__ import annotations

import os

import pytest
import torch

from tests import models as M
from tests.integrations.common import same
from tests.world import device_type, run_world

pytest.importorskip("lightning", reason="the lightning extra is not installed")

pytestmark = pytest.mark.skipif(
    device_type() != "cuda",
    reason="needs FSDP_BRIDGE_DEVICE=cuda: torch's FSDP1 cannot save a full state dict on a "
           "CPU-only torch")

STEPS, SAVED_AT, PER_DEVICE = 4, 2, 4
ACCELERATOR = "cuda"
PRECISIONS = ("32-true", "bf16-mixed")
TOLERANCE = {"32-true": dict(rtol=1e-5, atol=1e-6), "bf16-mixed": dict(rtol=2e-2, atol=2e-2)}


def _strategy(which: str, fabric: bool):
    from fsdp_bridge.integrations.lightning import FabricFSDPStrategy
    from fsdp_bridge.integrations.lightning import FSDPStrategy as OursTrainer
    from tests.integrations.lightning_cases import llama_policy

    if fabric:
        from lightning.fabric.strategies import FSDPStrategy as NativeFabric

        kind = FabricFSDPStrategy if which == "ours" else NativeFabric
        return kind(auto_wrap_policy=llama_policy(), state_dict_type="full")
    from lightning.pytorch.strategies import FSDPStrategy as NativeTrainer

    kind = OursTrainer if which == "ours" else NativeTrainer
    return kind(auto_wrap_policy=llama_policy(), state_dict_type="full")


# -- Trainer ---------------------------------------------------------------------------------


def _fit(which, world, precision, steps, ckpt_path=None, seed=0):
    import lightning as L

    from tests.integrations.lightning_cases import plain_module

    # One step per epoch: a resume then starts at an epoch boundary, as Lightning restores it.
    data = M.global_batches(1, PER_DEVICE * world).reshape(-1, M.SEQ)
    module = plain_module()(seed)
    trainer = L.Trainer(accelerator=ACCELERATOR, devices=world, strategy=_strategy(which, False),
                        precision=precision, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(list(data), batch_size=PER_DEVICE),
                ckpt_path=ckpt_path)
    return trainer, module.losses


def trainer_cross_load(rank, world, folder, precision):
    """Each side writes after SAVED_AT steps; the other side resumes from that file."""
    out = {}
    for writer, reader in (("native", "ours"), ("ours", "native")):
        _, uninterrupted = _fit(writer, world, precision, STEPS)
        trainer, _ = _fit(writer, world, precision, SAVED_AT)
        path = os.path.join(folder, f"trainer-{writer}-{precision}.ckpt")
        trainer.save_checkpoint(path)
        _, resumed = _fit(reader, world, precision, STEPS, ckpt_path=path, seed=1)
        out[f"{writer} to {reader}"] = {"expected": uninterrupted[SAVED_AT:], "resumed": resumed}
    return out


# -- Fabric ----------------------------------------------------------------------------------


def _fabric_steps(fabric, model, optimizer, steps, rank, world):
    from tests.integrations.lightning_cases import fabric_steps

    batches = M.global_batches(STEPS, PER_DEVICE * world)
    return fabric_steps(fabric, model, optimizer, batches, steps, rank, world)


def _fabric(which, world, precision):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator=ACCELERATOR, devices=world, strategy=_strategy(which, True),
                    precision=precision)
    fabric.launch()
    return fabric


def fabric_cross_load(rank, world, folder, precision):
    from tests.integrations.lightning_cases import fabric_set_up

    out = {}
    for writer, reader in (("native", "ours"), ("ours", "native")):
        fabric = _fabric(writer, world, precision)
        model, optimizer = fabric_set_up(fabric, 0)
        losses = _fabric_steps(fabric, model, optimizer, range(SAVED_AT), rank, world)
        path = os.path.join(folder, f"fabric-{writer}-{precision}.ckpt")
        fabric.save(path, {"model": model, "optimizer": optimizer, "step": SAVED_AT})
        losses += _fabric_steps(fabric, model, optimizer, range(SAVED_AT, STEPS), rank, world)
        fabric.barrier()
        fabric = _fabric(reader, world, precision)
        model, optimizer = fabric_set_up(fabric, 1)
        state = {"model": model, "optimizer": optimizer, "step": 0}
        rest = fabric.load(path, state)
        resumed = _fabric_steps(fabric, model, optimizer, range(SAVED_AT, STEPS), rank, world)
        out[f"{writer} to {reader}"] = {"expected": losses[SAVED_AT:], "resumed": resumed,
                                        "step": state["step"], "rest": rest}
    return out


def all_cases(rank, world, folder):
    from tests.integrations.lightning_cases import as_torchrun_rank

    as_torchrun_rank()
    out = {}
    for precision in PRECISIONS:
        for name, case in (("trainer", trainer_cross_load), ("fabric", fabric_cross_load)):
            try:
                out[(name, precision)] = case(rank, world, folder, precision)
            except Exception as error:  # one case's failure fails only its own test
                import traceback

                out[(name, precision)] = {"error": f"{error!r}\n{traceback.format_exc()}"}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    world = max(1, min(torch.cuda.device_count(), 2))
    return run_world(all_cases, world, str(tmp_path_factory.mktemp("native-checkpoints")))


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("entry", ("trainer", "fabric"))
def test_native_and_ours_resume_from_each_others_checkpoints(ranks, entry, precision):
    for out in ranks:
        got = out[(entry, precision)]
        assert "error" not in got, got.get("error")
        for direction, result in got.items():
            assert len(result["resumed"]) == STEPS - SAVED_AT, direction
            if entry == "fabric":
                assert result["step"] == SAVED_AT and result["rest"] == {}, direction
            same(result["resumed"], result["expected"], f"{entry} {precision} {direction}",
                 TOLERANCE[precision])
