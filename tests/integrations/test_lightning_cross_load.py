"""The "fsdp_bridge" Lightning strategy resumes from a checkpoint of Lightning's own
FSDPStrategy (torch's FSDP1, `state_dict_type="full"`: optimizer states keyed by parameter index),
world 2 on CPU/gloo, tiny Llama: its losses after the resume equal native's uninterrupted run.
Native writes its file through a test-only subclass that gathers the full state dicts without
offloading (torch's FSDP1 crashes offloading on a CPU-only machine); the file's layout is
Lightning's own."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lightning", reason="the lightning extra is not installed")

from tests import models as M  # noqa: E402
from tests.integrations import lightning_cases as C  # noqa: E402
from tests.integrations.common import same  # noqa: E402
from tests.world import run_world  # noqa: E402


def _native_writing_on_cpu():
    """Lightning's FSDPStrategy on the CPU (lightning_cases), its full state dicts gathered
    without offloading."""
    from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    native = type(C.fsdp_strategy("native"))

    def full(model):
        return FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                    FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
                                    FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True))

    class Writing(native):
        def lightning_module_state_dict(self):
            with full(self.model):
                return self.model.state_dict()

        def optimizer_state(self, optimizer):
            from torch.distributed.fsdp import OptimStateKeyType

            with full(self.model):
                state = FSDP.optim_state_dict(self.model, getattr(optimizer, "_optimizer", optimizer))
                if self.global_rank == 0:  # as Lightning stores it: keyed by parameter index
                    state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
                return state

    return Writing(auto_wrap_policy=C.llama_policy())


def _fit(strategy, world, data, steps, ckpt_path=None, seed=0):
    import lightning as L
    import torch

    module = C.plain_module()(seed)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(list(data), batch_size=C.PER_DEVICE),
                ckpt_path=ckpt_path)
    return trainer, module


def native_to_ours(rank, world, folder):
    from fsdp_bridge.integrations.lightning import FSDPStrategy

    C.as_torchrun_rank()
    data = M.global_batches(1, C.PER_DEVICE * world).reshape(-1, M.SEQ)  # one step per epoch
    _, native = _fit(C.fsdp_strategy("native"), world, data, C.STEPS + 2)
    trainer, _ = _fit(_native_writing_on_cpu(), world, data, C.STEPS)
    path = os.path.join(folder, "native.ckpt")
    trainer.save_checkpoint(path)
    import torch

    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["state"]
    _, ours = _fit(FSDPStrategy(auto_wrap_policy=C.llama_policy()), world, data, C.STEPS + 2,
                   ckpt_path=path, seed=1)
    return {"native": native.losses, "resumed": ours.losses,
            "by_index": all(isinstance(key, int) for key in saved) and bool(saved)}


def test_fsdp_bridge_strategy_resumes_from_lightning_fsdp_checkpoint(tmp_path):
    for out in run_world(native_to_ours, 2, str(tmp_path)):
        assert out["by_index"]  # the layout ours rekeys by name
        assert len(out["resumed"]) == 2
        same(out["resumed"], out["native"][C.STEPS:], "resumed from native's checkpoint")
