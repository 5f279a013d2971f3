"""Upstream FSDP1, Zeta and TorchAcc examples with only the import changed, on 2 CPU ranks
(one spawned world).

- FSDP1: the training snippet (lambda policy over embed / layers / lm_head, MixedPrecision,
  sync_module_states, BACKWARD_PRE, forward_prefetch, use_orig_params) on a tiny Llama;
- Zeta: its three examples. Their `TransformerBlock` never calls
  `super().__init__()` and has no `forward`, so it cannot run under any FSDP; the block here is
  the smallest fix (a residual Linear);
- TorchAcc: its GPT-2 example (tiny GPT2Config, synthetic data) and its checkpoint
  save / consolidate / load sequence.

Each example also trains a single-process reference on the global batch where the run is fp32.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from tests import models as M

STEPS = 4


def _global_mean(value):
    return M.global_mean(value)


# -- FSDP1 snippet ------------------------------------------------------------------------------


def seed000_fsdp1(rank, world):
    import fsdp_bridge.fsdp as fsdp_module
    from fsdp_bridge.fsdp import (
        BackwardPrefetch,
        MixedPrecision,
        ShardingStrategy,
    )
    from fsdp_bridge.fsdp import (
        FullyShardedDataParallel as FSDP,
    )
    from fsdp_bridge.fsdp.wrap import lambda_auto_wrap_policy

    model = M.tiny_llama(seed=rank)  # sync_module_states makes rank 0's weights win
    sharding_strategy, param_dtype = ShardingStrategy.FULL_SHARD, torch.float32
    sync_module_states, param_init_fn, device = True, None, torch.device("cpu")
    model = FSDP(
        model,
        sharding_strategy=sharding_strategy,
        auto_wrap_policy=partial(
            lambda_auto_wrap_policy,
            lambda_fn=lambda m: (
                m is model.model.embed_tokens
                or m in model.model.layers
                or m is model.lm_head
            ),
        ),
        mixed_precision=MixedPrecision(param_dtype=param_dtype, reduce_dtype=torch.float32),
        sync_module_states=sync_module_states,
        param_init_fn=param_init_fn,
        device_id=device,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=True,
        use_orig_params=True,
    )
    optimizer = M.make_adamw(model.parameters())
    losses = []
    for batch in M.global_batches(STEPS, 8):
        loss = M.lm_loss(model, M.rank_slice(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(loss.item()))
    with FSDP.state_dict_type(model, fsdp_module.StateDictType.FULL_STATE_DICT):
        state = model.state_dict()
    return {"losses": losses, "state": state, "units": model.plan.unit_names}


# -- Zeta -------------------------------------------------------------------------------------


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ff = nn.Linear(256, 256)

    def forward(self, x):
        return x + torch.relu(self.ff(x))


def _zeta_model(kind):
    torch.manual_seed(0)
    if kind == "auto":
        return nn.Sequential(nn.Linear(784, 256), TransformerBlock(), nn.Linear(256, 10))
    return nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))


def _zeta_train(model, rank, world):
    generator = torch.Generator().manual_seed(7)
    optimizer = M.make_adamw(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(8, 784, generator=generator)
        y = torch.randint(0, 10, (8,), generator=generator)
        if world > 1:
            x, y = M.rank_slice(x, rank, world), M.rank_slice(y, rank, world)
        loss = nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_global_mean(loss.item()) if world > 1 else loss.item())
    return losses


def seed001_zeta(rank, world):
    from fsdp_bridge.zeta import fsdp

    out = {}
    # Basic FSDP wrapper (no sharding, fp32)
    fsdp_model = fsdp(_zeta_model("basic"))
    out["basic"] = _zeta_train(fsdp_model, rank, world)
    # Automatic layer wrapping
    fsdp_model = fsdp(_zeta_model("auto"), auto_wrap=True, TransformerBlock=TransformerBlock)
    out["auto_units"] = fsdp_model.plan.unit_names
    out["auto"] = _zeta_train(fsdp_model, rank, world)
    # Advanced configuration (full sharding, bf16)
    fsdp_model = fsdp(_zeta_model("basic"), mp="bf16", shard_strat="FULL_SHARD")
    out["advanced"] = _zeta_train(fsdp_model, rank, world)
    # Zeta rejects its own torch name; we accept it
    fsdp_model = fsdp(_zeta_model("basic"), shard_strat="SHARD_GRAD_OP")
    out["shard_grad_op"] = _zeta_train(fsdp_model, rank, world)
    out["reference_basic"] = _zeta_train(_zeta_model("basic"), 0, 1)
    out["reference_auto"] = _zeta_train(_zeta_model("auto"), 0, 1)
    return out


# -- TorchAcc ---------------------------------------------------------------------------------


def seed003_torchacc(rank, world, tmp_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    import fsdp_bridge.torchacc as torchacc

    os.chdir(tmp_dir)
    # Model and synthetic data (the original downloads gpt2 + wikitext; same shapes, tiny)
    torch.manual_seed(0)
    model_config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    model = GPT2LMHeadModel(model_config)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (32, 16), generator=generator)
    dataset = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
    train_dataloader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=False)

    config = torchacc.Config()
    config.compute.bf16 = True
    config.dist.fsdp.size = world
    config.dist.fsdp.wrap_layer_cls = {"GPT2Block"}
    model, train_dataloader = torchacc.accelerate(model, train_dataloader, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)

    model.train()
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.cuda.amp.autocast on a CPU-only build
        for step, batch in enumerate(train_dataloader):
            optimizer.zero_grad()
            with torch.cuda.amp.autocast(dtype=torch.bfloat16):
                loss = model(**batch)["loss"]
            loss.backward()
            optimizer.step()
            lr_scheduler.step()
            losses.append(_global_mean(loss.item()))

    # Checkpoint save (as in the TorchAcc example, with CKPT_DIR the run directory)
    CKPT_DIR, OPTIMIZER_DIR, LR_SCHEDULER_DIR = ".", f"optim-rank{rank}.pth", "lr.pth"
    torchacc.dist.rendezvous("saving_model")
    torchacc.dist.mark_step()
    ckpt = {
        "model": model.state_dict(),
        "shard_metadata": model.get_shard_metadata(),
    }
    torchacc.save(ckpt, CKPT_DIR, master_only=False)
    torchacc.dist.rendezvous("saving_optimizer_states")
    torchacc.save(optimizer.state_dict(), OPTIMIZER_DIR, master_only=False)
    torchacc.save(lr_scheduler.state_dict(), LR_SCHEDULER_DIR)

    from torch.distributed.fsdp import StateDictType

    from fsdp_bridge.wrapper import ShardedWrapper

    with ShardedWrapper.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full_before = model.state_dict()

    # Load from checkpoint
    ckpt_suffix = "rank*-of-*-model.pth"
    torchacc.dist.rendezvous("before_consolidation")
    if torchacc.dist.is_master_ordinal(local=False):
        torchacc.dist.fsdp.consolidate_sharded_model_checkpoints(CKPT_DIR, ckpt_suffix)
    torchacc.dist.rendezvous("ckpt_consolidation")
    ckpt_consolidated = torch.load("consolidated.pth")
    # Scramble, then load: the load must restore every value.
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict(ckpt_consolidated["model"])
    optimizer_state = torch.load(OPTIMIZER_DIR)
    lr_scheduler_state = torch.load(LR_SCHEDULER_DIR)
    optimizer.load_state_dict(optimizer_state)
    lr_scheduler.load_state_dict(lr_scheduler_state)
    with ShardedWrapper.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full_after = model.state_dict()
    # One more step trains.
    batch = next(iter(train_dataloader))
    loss = model(**batch)["loss"]
    loss.backward()
    optimizer.step()
    return {"losses": losses, "before": full_before, "after": full_after,
            "consolidated_keys": list(ckpt_consolidated["model"]),
            "model_keys": list(full_before), "extra_loss": float(loss)}


# -- the repository's examples/ of each dialect -------------------------------------------------

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")
DIALECT_EXAMPLES = ("fsdp1_llama", "fsdp2_llama", "zeta_llama", "torchacc_llama")


def repository_examples(rank, world):
    """Each dialect example's `shard` on the examples' shared model, data and training loop
    (examples/common.py): the global losses, by example."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import common

    out = {}
    for name in DIALECT_EXAMPLES:
        shard = importlib.import_module(name).shard
        out[name] = common.train(shard(common.tiny_llama()))
        dist.barrier()
    return out


def run_all(rank, world, tmp_dir):
    out = {"examples": repository_examples(rank, world)}
    dist.barrier()
    out["seed000"] = seed000_fsdp1(rank, world)
    dist.barrier()
    out["seed001"] = seed001_zeta(rank, world)
    dist.barrier()
    out["seed003"] = seed003_torchacc(rank, world, tmp_dir)
    return out
