"""Rank-side cases of test_lightning.py: a Lightning Trainer with `ModelParallelStrategy` whose
LightningModule shards in `configure_model`, with torch's `fully_shard` and with ours."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests import models as M
from tests.frontends.parity_cases import dialect
from tests.integrations.common import engine_of, full_state
from tests.world import run_case_table

STEPS = 3
PER_DEVICE = 4


def as_torchrun_rank() -> None:
    """Describe this spawned rank as torchrun does: Lightning then joins the process group
    that is already there instead of launching processes of its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0", GROUP_RANK="0")


def lightning_module(which):
    import lightning as L

    class TinyLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = M.tiny_llama()
            self.losses = []

        def configure_model(self):
            fsdp = dialect(which)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.model.model.layers:
                fsdp.fully_shard(layer, mesh=mesh)
            fsdp.fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(M.global_mean(loss.item()))
            return loss

        def configure_optimizers(self):
            return M.make_adamw(self.model.parameters())

    return TinyLlama()


def model_parallel_strategy(rank, world, folder):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    as_torchrun_rank()
    data = M.global_batches(STEPS, PER_DEVICE * world).reshape(-1, M.SEQ)
    out = {}
    for which in ("native", "ours"):
        module = lightning_module(which)
        trainer = L.Trainer(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(),
                            max_steps=STEPS, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        loader = torch.utils.data.DataLoader(list(data), batch_size=PER_DEVICE)
        trainer.fit(module, loader)
        path = os.path.join(folder, which)
        trainer.save_checkpoint(path)
        out[which] = {"losses": module.losses, "state": full_state(module.model),
                      "engine": engine_of(module.model), "saved": os.path.isdir(path)}
    return out


def _native_wrap_on_cpu(strategy, module, kwargs):
    """What Lightning's FSDP strategies do to a module, with torch's FSDP1 given the CPU as its
    device (Lightning passes the device index, None on the CPU, which FSDP1 refuses)."""
    from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
    from torch.distributed.fsdp import FullyShardedDataParallel

    module = FullyShardedDataParallel(
        module=module, cpu_offload=strategy.cpu_offload,
        mixed_precision=strategy.mixed_precision_config,
        sharding_strategy=strategy.sharding_strategy, device_id=torch.device("cpu"), **kwargs)
    _setup_activation_checkpointing(module, strategy._activation_checkpointing_kwargs)
    return module


def fsdp_strategy(which):
    """Ours, or native: Lightning's FSDPStrategy under a test-only subclass, which Lightning's
    refusal of FSDP on the CPU (a check of the exact class) lets by and which hands torch's
    FSDP1 the CPU as its device (Lightning passes the device index, None on the CPU)."""
    from lightning.pytorch.strategies import FSDPStrategy

    from fsdp_bridge.integrations.lightning import FSDPStrategy as Ours

    class NativeOnCpu(FSDPStrategy):
        # Norm clipping as FSDP1 does it (Lightning's FSDP refuses it): the reference ours is
        # compared with.
        def setup(self, trainer):
            super().setup(trainer)
            self.precision_plugin.clip_grad_by_norm = lambda _, value: self.model.clip_grad_norm_(
                value)

        def _setup_model(self, model):
            return _native_wrap_on_cpu(self, model, self.kwargs)

    return (Ours if which == "ours" else NativeOnCpu)(auto_wrap_policy=llama_policy())


def llama_policy():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {LlamaDecoderLayer}


def plain_module():
    import lightning as L

    class TinyLlama(L.LightningModule):
        def __init__(self, seed=0):
            super().__init__()
            self.model = M.tiny_llama(seed)
            self.losses = []

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(M.global_mean(loss.item()))
            return loss

        def configure_optimizers(self):
            return M.make_adamw(self.trainer.model.parameters())

    return TinyLlama


def _fit(which, world, data, steps, ckpt_path=None, seed=0, precision="32-true", clip=None):
    import lightning as L

    strategy = fsdp_strategy(which)
    module = plain_module()(seed)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps,
                        precision=precision, gradient_clip_val=clip, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loader = torch.utils.data.DataLoader(list(data), batch_size=PER_DEVICE)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def _native_full_state(trainer) -> dict:
    """Native FSDP1's full state dict without offloading (offload_to_cpu, which Lightning's
    own checkpointing sets, crashes torch's FSDP1 on a CPU-only build)."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.state_dict_type(trainer.strategy.model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        return {k: v.detach().float().clone() for k, v in trainer.strategy.model.state_dict().items()}


def lightning_fsdp_strategy(rank, world, folder, precision="32-true"):
    """Native and ours trained STEPS + 2 steps uninterrupted; ours also STEPS steps, saved by
    `save_checkpoint` and resumed to STEPS + 2 from the file."""
    as_torchrun_rank()
    # One step per epoch: a resume at an epoch's end continues exactly (Lightning restarts a
    # plain data loader's epoch from its start).
    data = M.global_batches(1, PER_DEVICE * world).reshape(-1, M.SEQ)
    out = {}
    trainer, module = _fit("native", world, data, STEPS + 2, precision=precision)
    out["native"] = {"losses": module.losses, "state": _native_full_state(trainer)}
    trainer, module = _fit("ours", world, data, STEPS + 2, precision=precision)
    with trainer.strategy._full_state_dicts(rank0_only=False):
        state = {k: v.detach().float().clone() for k, v in trainer.strategy.model.state_dict().items()}
    out["ours"] = {"losses": module.losses, "state": state,
                   "engine": type(trainer.strategy.model).__module__.split(".")[0]}
    trainer, _ = _fit("ours", world, data, STEPS, precision=precision)
    path = os.path.join(folder, f"ours-{precision}.ckpt")
    trainer.save_checkpoint(path)
    _, module = _fit("ours", world, data, STEPS + 2, ckpt_path=path, seed=1,
                     precision=precision)
    out["ours"]["resumed"] = module.losses
    return out


def fabric_strategy(which):
    """Ours by its registered name; native: Fabric's FSDPStrategy under a test-only subclass
    handing torch's FSDP1 the CPU as its device (as fsdp_strategy does for the Trainer)."""
    if which == "ours":
        import fsdp_bridge.integrations.lightning  # noqa: F401  (registers "fsdp_bridge")
        return "fsdp_bridge"
    from lightning.fabric.strategies import FSDPStrategy

    class NativeOnCpu(FSDPStrategy):
        def setup_module(self, module):
            return _native_wrap_on_cpu(self, module, self._fsdp_kwargs)

    return NativeOnCpu(auto_wrap_policy=llama_policy())


def fabric_training(rank, world, folder):
    """A Fabric loop (setup, backward, norm clipping, one accumulation step under
    no_backward_sync) with Fabric's FSDP on torch's FSDP1 and with strategy="fsdp_bridge"."""
    from lightning.fabric import Fabric

    as_torchrun_rank()
    batches = M.global_batches(STEPS, PER_DEVICE * world)
    out = {}
    for which in ("native", "ours"):
        fabric = Fabric(accelerator="cpu", devices=world, strategy=fabric_strategy(which))
        fabric.launch()
        model = fabric.setup_module(M.tiny_llama())
        optimizer = fabric.setup_optimizers(M.make_adamw(model.parameters()))
        losses, norms = [], []
        for step in range(STEPS):
            first, second = M.rank_slice(batches[step], rank, world).chunk(2)
            with fabric.no_backward_sync(model, enabled=True):
                fabric.backward(model(input_ids=first, labels=first).loss / 2)
            loss = model(input_ids=second, labels=second).loss / 2
            fabric.backward(loss)
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=1.0)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(M.global_mean(loss.item()))
        state, engine = _full_state_of(which, model)
        out[which] = {"losses": losses, "norms": norms, "state": state, "engine": engine}
        if which == "ours":  # resuming from it: test_fabric_checkpoint.py
            fabric.save(os.path.join(folder, "fabric.ckpt"), {"model": model})
            out["ours"]["saved"] = os.path.isfile(os.path.join(folder, "fabric.ckpt"))
    return out


def _full_state_of(which, model) -> dict:
    """The full state dict of a model Fabric set up, without offloading."""
    from torch.distributed.fsdp import FullStateDictConfig, StateDictType

    wrapper = model._forward_module  # the FSDP wrapper inside Fabric's module
    fsdp = dialect(which)
    with fsdp.FullyShardedDataParallel.state_dict_type(
            wrapper, StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=False)):
        state = {k: v.detach().float().clone() for k, v in wrapper.state_dict().items()}
    return state, type(wrapper).__module__.split(".")[0]


def lightning_norm_clipping(rank, world, folder):
    as_torchrun_rank()
    data = M.global_batches(STEPS, PER_DEVICE * world).reshape(-1, M.SEQ)
    out = {}
    for which in ("native", "ours"):
        trainer, module = _fit(which, world, data, STEPS, clip=0.5)
        out[which] = {"losses": module.losses}
    out["ours"]["unclipped"] = _fit("ours", world, data, STEPS)[1].losses
    return out


CASES = {"model_parallel_strategy": model_parallel_strategy,
         "lightning_norm_clipping": lightning_norm_clipping,
         "fabric_training": fabric_training,
         "lightning_fsdp_strategy": lightning_fsdp_strategy,
         "lightning_fsdp_strategy_bf16": lambda rank, world, folder: lightning_fsdp_strategy(
             rank, world, folder, precision="bf16-mixed")}


def run_cases(rank, world, names, folder):
    table = {name: (lambda fn: lambda r, w: fn(r, w, folder))(CASES[name]) for name in names}
    return run_case_table(table)


# -- Fabric ------------------------------------------------------------------------------------


def fabric_set_up(fabric, seed):
    """A tiny Llama (seeded) and its AdamW, set up by `fabric`."""
    model = fabric.setup_module(M.tiny_llama(seed))
    return model, fabric.setup_optimizers(M.make_adamw(model.parameters()))


def fabric_steps(fabric, model, optimizer, batches, steps, rank, world):
    """Train on `batches[step]` (this rank's slice, on Fabric's device) for each of `steps`;
    the global-batch losses."""
    losses = []
    for step in steps:
        ids = M.rank_slice(batches[step], rank, world).to(fabric.device)
        loss = model(input_ids=ids, labels=ids).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(M.global_mean(loss.item()))
    return losses
