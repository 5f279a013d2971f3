"""Each side of each front-end pair, configured by one cell: the harness's backends with every
setting of the matrix's axes.

`cell_backend(cell, side)` gives the Backend that trains `cell` as `side` ("native": torch's
FSDP1 / fully_shard, or Zeta's FSDP1 build; "ours": fsdp-bridge's front-end; "reference": the
single-process reference). The same code runs both sides of a pair; only the dialect's module
differs, as in the harness's torch-* / bridge-* backends.

The order of a wrap: build (real, meta, or rank 0 real), activation checkpointing "before",
the dialect's wrap, activation checkpointing "after", a Parameter assigned late, compile.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import shutil
import tempfile
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from fsdp_bridge.harness.backends import (
    BRIDGE_FSDP,
    TORCH_FSDP,
    Backend,
    RankEnv,
    ReferenceBackend,
    _cpu_fp32,
)
from fsdp_bridge.harness.matrix import model as M
from fsdp_bridge.harness.matrix.axes import Cell
from fsdp_bridge.harness.recipes import DTYPES, Recipe

COMPILE_BACKEND = os.environ.get("FSDP_BRIDGE_MATRIX_COMPILE_BACKEND", "aot_eager")


def _dtype(name: str) -> Optional[torch.dtype]:
    return None if name == "default" else DTYPES[name]


# --- meshes, made once per world shape --------------------------------------------------------

_MESHES: dict = {}


def _mesh(env: RankEnv, strategy: str):
    from torch.distributed.device_mesh import init_device_mesh

    shape = {"hybrid": (2, env.world_size // 2), "no_shard": (env.world_size, 1)}.get(
        strategy, (env.world_size,))
    key = (env.device.type, shape)
    if key not in _MESHES:
        names = ("replicate", "shard") if len(shape) == 2 else None
        _MESHES[key] = init_device_mesh(env.device.type, shape, mesh_dim_names=names)
    return _MESHES[key]


# --- steps shared by every dialect ------------------------------------------------------------


def _blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, M.Block)]


def _checkpoint(model: nn.Module, mode: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    impl = CheckpointImpl.REENTRANT if mode.endswith("reentrant") else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda module: isinstance(module, M.Block))


def _average_gradients_of(module: nn.Module) -> None:
    """[Note: an ignored module's user keeps it in sync] The wrap leaves an ignored module
    alone: nothing reduces its gradients, so each rank would train its copy on its own data and
    the copies drift apart, natively too. Which copy a sharded checkpoint keeps then depends on
    the layout (DCP writes a replicated tensor from the rank that writes least so far), and so
    does a hybrid clip's coefficient. As its user would (with DDP, or by hand), each backward's
    gradient is averaged over the ranks as it accumulates, on both sides of a cell."""
    def average(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)

    for param in module.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(average)


def _unwrapped(model: nn.Module) -> nn.Module:
    """The model under torch.compile's OptimizedModule."""
    return getattr(model, "_orig_mod", model)


def _shared_folder(env: RankEnv) -> str:
    """A fresh temporary folder every rank of the world agrees on."""
    name = [tempfile.mkdtemp(prefix="fsdp-bridge-matrix-") if env.rank == 0 else None]
    if env.world_size > 1:
        dist.broadcast_object_list(name, src=0)
    return name[0]


def _remove_folder(env: RankEnv, folder: str) -> None:
    if env.world_size > 1:
        dist.barrier()
    if env.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


class CellBackend(Backend):
    """One side of one cell. Subclasses define the dialect's wrap and its ways to skip sync,
    clip, and checkpoint."""

    def __init__(self, cell: Cell, side: str, module_name: Optional[str] = None):
        self.cell, self.side = cell, side
        self.name = side
        self.module_name = module_name
        self._rank0_state: Optional[dict] = None

    user_divides_loss = True

    # -- building ------------------------------------------------------------------------------

    def build_model(self, recipe: Recipe, env: RankEnv) -> nn.Module:
        init = self.cell.init
        if init == "meta" or (init == "rank0" and self.meta_off_rank0 and env.rank != 0):
            torch.manual_seed(recipe.seed)
            with torch.device("meta"):
                model = recipe.make_model()
            if self.cell.ignored:  # the wrap leaves an ignored module alone: its user inits it
                model.side.to_empty(device=env.device)
                model.side.reset_parameters()
        elif init == "rank0" and env.rank != 0:  # other weights: the broadcast must replace them
            torch.manual_seed(recipe.seed + 1000 + env.rank)
            model = recipe.make_model()
            if self.cell.ignored:  # the broadcast leaves an ignored module alone: its user
                model.side.load_state_dict(recipe.build_model().side.state_dict())  # syncs it
        else:
            model = recipe.build_model()
        if self.cell.ac.startswith("before"):
            _checkpoint(model, self.cell.ac)
        return model

    meta_off_rank0 = False  # rank0 init: other ranks build on meta (FSDP2's recipe)

    def wrap(self, model, recipe, env):
        torch.manual_seed(recipe.seed)  # initialisation from meta draws from here
        wrapped = self.shard(model, recipe, env)
        if self.cell.ignored and env.world_size > 1:
            _average_gradients_of(model.side)
        if self.cell.ac.startswith("after"):
            _checkpoint(wrapped, self.cell.ac)
        if self.cell.late_param:  # a new Parameter in place of one the wrap already holds
            block = _blocks(wrapped)[0]  # (its bias may be a shard: the buffer has its size)
            block.down.bias = nn.Parameter(torch.full(block.gain.shape, 0.01, device=env.device))
        if self.cell.compile == "blocks":
            for block in _blocks(wrapped):
                block.compile(backend=COMPILE_BACKEND, fullgraph=True)
        elif self.cell.compile == "whole":
            wrapped = torch.compile(wrapped, backend=COMPILE_BACKEND)
        return wrapped

    def shard(self, model: nn.Module, recipe: Recipe, env: RankEnv) -> nn.Module:
        raise NotImplementedError

    # -- training ------------------------------------------------------------------------------

    def no_sync(self, model):
        if self.cell.accumulate == "skip":
            return self.skip_sync(_unwrapped(model))
        return contextlib.nullcontext()

    def skip_sync(self, model) -> contextlib.AbstractContextManager:
        return model.no_sync()

    def after_step(self, model, optimizer, recipe, env, step):
        if self.cell.resume == "off" or step != recipe.steps // 2:
            return model, optimizer
        folder = _shared_folder(env)
        try:
            saved = self.save(_unwrapped(model), optimizer, folder, env)
            del model, optimizer
            model = self.wrap(self.build_model(recipe, env), recipe, env)
            optimizer = self.build_optimizer(model, recipe, env)
            self.load(_unwrapped(model), optimizer, saved, folder, env)
        finally:
            _remove_folder(env, folder)
        return model, optimizer

    def save(self, model, optimizer, folder: str, env: RankEnv):
        """Save model and optimizer state (the `resume` axis); returns what `load` needs."""
        if self.cell.resume == "sharded":
            return _dcp_save(model, optimizer, folder)
        raise NotImplementedError

    def load(self, model, optimizer, saved, folder: str, env: RankEnv) -> None:
        if self.cell.resume == "sharded":
            return _dcp_load(model, optimizer, folder)
        raise NotImplementedError


def _dcp_save(model, optimizer, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)


def _dcp_load(model, optimizer, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


# --- FSDP1 (ours against torch's) and Zeta (ours against torch FSDP1 as Zeta builds it) -----

_STRATEGY_FSDP1 = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD_OP", "no_shard": "NO_SHARD",
                   "hybrid": "HYBRID_SHARD"}


class FSDP1CellBackend(CellBackend):
    def fsdp_kwargs(self, fsdp, env: RankEnv) -> dict:
        cell = self.cell
        mixed = None
        if (cell.param, cell.reduce, cell.buffer) != ("fp32", "default", "default"):
            mixed = fsdp.MixedPrecision(param_dtype=DTYPES[cell.param],
                                        reduce_dtype=_dtype(cell.reduce),
                                        buffer_dtype=_dtype(cell.buffer))
        kwargs = dict(
            sharding_strategy=getattr(fsdp.ShardingStrategy, _STRATEGY_FSDP1[cell.strategy]),
            mixed_precision=mixed,
            use_orig_params=cell.orig_params,
            device_id=env.device,
            sync_module_states=cell.init == "rank0",
        )
        if cell.strategy == "hybrid":
            kwargs["device_mesh"] = _mesh(env, "hybrid")
        if cell.offload:
            kwargs["cpu_offload"] = fsdp.CPUOffload(offload_params=True)
        if cell.init == "meta":
            kwargs["param_init_fn"] = M.param_init_fn
        return kwargs

    def shard(self, model, recipe, env):
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        fsdp = self.dialect()
        kwargs = self.fsdp_kwargs(fsdp, env)
        if self.cell.ignored:
            kwargs["ignored_states"] = [model.side]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # NO_SHARD / HYBRID deprecations
            if self.cell.outer != "none":
                return self._nested(fsdp, model, kwargs, env)
            return fsdp.FullyShardedDataParallel(
                model, auto_wrap_policy=ModuleWrapPolicy({M.Block}), **kwargs)

    def _nested(self, fsdp, model, kwargs, env):
        """Blocks wrapped by this side's FSDP1, the root by torch's own wrapper (`outer`), in
        the same mixed precision."""
        for index, block in enumerate(model.blocks):
            model.blocks[index] = fsdp.FullyShardedDataParallel(block, **kwargs)
        torch_fsdp = importlib.import_module(TORCH_FSDP)
        if self.cell.outer == "torch-fsdp1":
            mixed = kwargs["mixed_precision"]
            if mixed is not None:
                mixed = torch_fsdp.MixedPrecision(param_dtype=mixed.param_dtype,
                                                  reduce_dtype=mixed.reduce_dtype,
                                                  buffer_dtype=mixed.buffer_dtype)
            return torch_fsdp.FullyShardedDataParallel(model, device_id=env.device,
                                                       use_orig_params=self.cell.orig_params,
                                                       mixed_precision=mixed)
        torch_fsdp.fully_shard(model, mesh=_mesh(env, "full"), mp_policy=torch_fsdp.
                               MixedPrecisionPolicy(param_dtype=DTYPES[self.cell.param],
                                                    reduce_dtype=_dtype(self.cell.reduce)))
        return model

    def _root_class(self, model):
        return type(model)

    def skip_sync(self, model):
        if self.cell.outer == "torch-fsdp2":
            return _fsdp2_no_sync(model)
        return model.no_sync()

    def clip_grad_norm(self, model, max_norm):
        if self.cell.outer == "torch-fsdp2":
            return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return _unwrapped(model).clip_grad_norm_(max_norm)

    def full_state_dict(self, model):
        model = _unwrapped(model)
        if self.cell.outer == "torch-fsdp2":
            # torch's FSDP1 units under torch's fully_shard train but cannot write their state
            # back (fully_shard replaced their parameters): the steps' digests compare them.
            return {}
        fsdp = self.dialect()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with type(model).state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT,
                                             fsdp.FullStateDictConfig()):
                return _cpu_fp32(model.state_dict())

    def save(self, model, optimizer, folder, env):
        if self.cell.resume != "full":
            return super().save(model, optimizer, folder, env)
        fsdp, cls = self.dialect(), type(model)
        config = fsdp.ShardedStateDictConfig() if self.cell.odd_args else fsdp.FullStateDictConfig()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with cls.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT, config,
                                     fsdp.FullOptimStateDictConfig()):
                return model.state_dict(), cls.optim_state_dict(model, optimizer)

    def load(self, model, optimizer, saved, folder, env):
        if self.cell.resume != "full":
            return super().load(model, optimizer, saved, folder, env)
        fsdp, cls = self.dialect(), type(model)
        model_state, optim_state = saved
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            with cls.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT,
                                     fsdp.FullStateDictConfig(),
                                     fsdp.FullOptimStateDictConfig()):
                model.load_state_dict(model_state)
                optimizer.load_state_dict(cls.optim_state_dict_to_load(model, optimizer,
                                                                       optim_state))


_ZETA_STRATEGY = {"full": "FULL_SHARD", "grad_op": "SHARD_GRAD", "no_shard": "NO_SHARD"}


class ZetaNativeBackend(FSDP1CellBackend):
    """torch FSDP1 as Zeta's `fsdp(model, auto_wrap=True, mp, shard_strat, TransformerBlock)`
    builds it: transformer_auto_wrap_policy, param / reduce / buffer dtype all `mp`,
    BACKWARD_PRE, forward_prefetch, use_orig_params=True (and device_id, which FSDP1 needs on
    a CPU-only torch)."""

    def shard(self, model, recipe, env):
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        fsdp = self.dialect()
        dtype = DTYPES[self.cell.param]
        mixed = None if self.cell.param == "fp32" else fsdp.MixedPrecision(
            param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return fsdp.FullyShardedDataParallel(
                model,
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                   transformer_layer_cls={M.Block}),
                mixed_precision=mixed,
                sharding_strategy=getattr(fsdp.ShardingStrategy,
                                          _STRATEGY_FSDP1[self.cell.strategy]),
                backward_prefetch=fsdp.BackwardPrefetch.BACKWARD_PRE,
                forward_prefetch=True,
                use_orig_params=True,
                device_id=env.device,
            )


class ZetaOursBackend(FSDP1CellBackend):
    def shard(self, model, recipe, env):
        from fsdp_bridge.zeta import fsdp as zeta_fsdp

        return zeta_fsdp(model, auto_wrap=True, mp=self.cell.param,
                         shard_strat=_ZETA_STRATEGY[self.cell.strategy], TransformerBlock=M.Block)


# --- FSDP2: ours against torch's fully_shard --------------------------------------------------


@contextlib.contextmanager
def _fsdp2_no_sync(model, off=False, on=True):
    model.set_requires_gradient_sync(off)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(on)


def _full_dtensor_state(model) -> dict:
    state = {key: value.full_tensor() if hasattr(value, "full_tensor") else value
             for key, value in model.state_dict().items()}
    return _cpu_fp32(state)


class FSDP2CellBackend(CellBackend):
    meta_off_rank0 = True

    def build_model(self, recipe, env):
        if self.cell.init == "rank0" and env.rank == 0:
            self._rank0_state = recipe.build_model().state_dict()
        return super().build_model(recipe, env)

    def shard(self, model, recipe, env):
        fsdp = self.dialect()
        cell = self.cell
        if cell.init == "real":
            model = model.to(env.device)
        kwargs = dict(
            mesh=_mesh(env, cell.strategy),
            reshard_after_forward=cell.strategy != "grad_op",
            mp_policy=fsdp.MixedPrecisionPolicy(
                param_dtype=None if cell.param == "fp32" else DTYPES[cell.param],
                reduce_dtype=_dtype(cell.reduce)),
            offload_policy=(fsdp.CPUOffloadPolicy(pin_memory=False) if cell.offload
                            else fsdp.OffloadPolicy()),
        )
        if cell.ignored:
            kwargs["ignored_params"] = set(model.side.parameters())
        for block in _blocks(model):
            fsdp.fully_shard(block, **kwargs)
        fsdp.fully_shard(model, **kwargs)
        if cell.init == "meta":
            model.to_empty(device=env.device)
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
        elif cell.init == "rank0":
            self._broadcast_rank0(model, env)
        return model

    def _broadcast_rank0(self, model, env):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        model.to_empty(device=env.device)
        state = self._rank0_state if env.rank == 0 else {}
        set_model_state_dict(model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        self._rank0_state = None

    def skip_sync(self, model):
        return _fsdp2_no_sync(model, 0, 1) if self.cell.odd_args else _fsdp2_no_sync(model)

    def clip_grad_norm(self, model, max_norm):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

    def full_state_dict(self, model):
        return _full_dtensor_state(_unwrapped(model))

    def save(self, model, optimizer, folder, env):
        if self.cell.resume != "full":
            return super().save(model, optimizer, folder, env)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        return get_state_dict(model, optimizer,
                              options=StateDictOptions(full_state_dict=True))

    def load(self, model, optimizer, saved, folder, env):
        if self.cell.resume != "full":
            return super().load(model, optimizer, saved, folder, env)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        set_state_dict(model, optimizer, model_state_dict=saved[0], optim_state_dict=saved[1],
                       options=StateDictOptions(full_state_dict=True))


# --- YaFSDP and TorchAcc: ours against the single-process reference ---------------------------


class YaFSDPCellBackend(CellBackend):
    def __init__(self, cell: Cell):
        super().__init__(cell, "ours", "fsdp_bridge.ya_fsdp")
        self.user_divides_loss = cell.accumulate != "skip"  # YaFSDP divides declared steps

    def shard(self, model, recipe, env):
        from fsdp_bridge.ya_fsdp import YaFSDP

        cell = self.cell
        units = [(module, name) for name, module in model.named_modules()
                 if isinstance(module, M.Block)]
        inside = tuple(name + "." for _, name in units)
        rogue = {module: name for name, module in model.named_modules()
                 if isinstance(module, nn.LayerNorm) and not name.startswith(inside)}
        return YaFSDP(
            model.to(env.device),
            zero_stage={"full": 3, "grad_op": 2}[cell.strategy],
            param_dtype=DTYPES[cell.param],
            modules_to_wrap_with_names=units,
            layer_norm_module_cls=nn.LayerNorm,
            gradient_accumulation_steps=cell.micro if cell.accumulate == "skip" else 1,
            rogue_layer_norm_modules_with_names=rogue,
            bit16_reduce_scatter=cell.reduce != "default",
            sync_module_states=cell.init == "rank0",
        )

    def skip_sync(self, model):
        return contextlib.nullcontext()  # the declared steps say when to reduce

    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=False)

    def clip_grad_norm(self, model, max_norm):
        return _unwrapped(model).clip_grad_norm_(max_norm)

    def full_state_dict(self, model):
        return _cpu_fp32(_unwrapped(model).state_dict())

    def save(self, model, optimizer, folder, env):
        return model.state_dict(), optimizer.state_dict()

    def load(self, model, optimizer, saved, folder, env):
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])


class TorchAccCellBackend(CellBackend):
    def __init__(self, cell: Cell):
        super().__init__(cell, "ours", "fsdp_bridge.torchacc")

    def shard(self, model, recipe, env):
        import fsdp_bridge.torchacc as torchacc

        config = torchacc.Config()
        config.compute.bf16 = self.cell.param == "bf16"
        config.compute.fp16 = self.cell.param == "fp16"
        config.dist.fsdp.size = {"full": env.world_size, "no_shard": 1, "hybrid": 2}[
            self.cell.strategy]
        config.dist.fsdp.wrap_layer_cls = {M.Block.__name__}
        config.dist.fsdp.sync_module_states = self.cell.init == "rank0"
        return torchacc.accelerate(model, None, config)

    def clip_grad_norm(self, model, max_norm):
        return _unwrapped(model).clip_grad_norm_(max_norm)

    def full_state_dict(self, model):
        from torch.distributed.fsdp import StateDictType

        model = _unwrapped(model)
        with type(model).state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return _cpu_fp32(model.state_dict())


class CellReference(ReferenceBackend):
    """The single-process reference of a cell: its model (tied, frozen), its accumulation and
    clipping; wrapping, checkpointing and compiling change no number, so it does none."""

    def __init__(self, cell: Cell):
        self.cell = cell


def cell_backend(cell: Cell, side: str) -> Backend:
    """The backend that trains `cell` as `side` ("native", "ours" or "reference")."""
    if side == "reference":
        return CellReference(cell)
    frontend = cell.frontend
    if frontend == "fsdp1":
        return FSDP1CellBackend(cell, side, TORCH_FSDP if side == "native" else BRIDGE_FSDP)
    if frontend == "fsdp2":
        return FSDP2CellBackend(cell, side, TORCH_FSDP if side == "native" else BRIDGE_FSDP)
    if frontend == "zeta":
        if side == "native":
            return ZetaNativeBackend(cell, side, TORCH_FSDP)
        return ZetaOursBackend(cell, side, TORCH_FSDP)  # torch's enums name the settings
    if side == "native":
        raise ValueError(f"front-end {frontend} has no native side: compare it with the "
                         "reference.")
    return YaFSDPCellBackend(cell) if frontend == "yafsdp" else TorchAccCellBackend(cell)


def cell_recipe(cell: Cell, seed: int = 0) -> Recipe:
    recipe = M.matrix_recipe(cell.world, cell.micro, cell.tied, cell.frozen, cell.clip, seed)
    return recipe.replace(mp=cell.param)
