"""What happens around the wrap, as real training scripts do it, on spawned gloo ranks (one
world, many cases; see test_wrap_lifecycle.py): an optimizer built before wrapping, a cast of
the wrapped model (`.half()`, `.to(torch.float64)`), nested FSDP1 wrappers with a process group
of their own, a wrap that fails halfway, and `fully_shard` called after the first forward.

Each case returns plain data; the test module asserts on it. Native FSDP1 runs on this CPU-only
torch with `device_id=torch.device("cpu")`.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests import models as M
from tests.frontends.parity_cases import dialect
from tests.world import device as test_device
from tests.world import run_case_table

STEPS = 3
GLOBAL_BATCH = 8
CPU = torch.device("cpu")


def _batches():
    return M.global_batches(STEPS, GLOBAL_BATCH)


def loss_in_model_dtype(model, ids):
    """The language-model loss in the dtype of the logits. (Hugging Face computes its `loss`
    in fp32 whatever the model's dtype, which would hide a float64 run's precision.)"""
    ids = ids.to(test_device())
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _train(model, optimizer, rank, world, loss_fn=M.lm_loss):
    losses = []
    for batch in _batches():
        loss = loss_fn(model, M.rank_slice(batch, rank, world))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(loss.item()))
    return losses


def _fsdp1(fsdp, model, **kwargs):
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy = fsdp.wrap.ModuleWrapPolicy({LlamaDecoderLayer})
    return fsdp.FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True,
                                         device_id=CPU, **kwargs)


def _yafsdp(model, **kwargs):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fsdp_bridge.ya_fsdp import YaFSDP

    return YaFSDP(model, zero_stage=3, param_dtype=kwargs.pop("param_dtype", torch.float32),
                  modules_to_wrap_with_names=[(layer, f"model.layers.{i}")
                                              for i, layer in enumerate(model.model.layers)],
                  rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
                  layer_norm_module_cls=LlamaRMSNorm, gradient_accumulation_steps=1, **kwargs)


def _changed(before: dict, model: nn.Module) -> int:
    """How many of the parameters changed in value since `before` (full values, gathered)."""
    full = {k: v for k, v in model.state_dict().items() if k in before}
    return sum(not torch.equal(before[k], full[k]) for k in before)


def _initial(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


# -- an optimizer built before wrapping ---------------------------------------------------------


def fsdp1_optimizer_before_wrap(rank, world):
    out = {}
    for which in ("native", "ours"):
        torch.manual_seed(0)
        model = M.tiny_llama()
        params = list(model.parameters())
        initial = _initial(model)
        optimizer = M.make_adamw(model.parameters())
        wrapped = _fsdp1(dialect(which), model)
        out[which] = {
            "losses": _train(wrapped, optimizer, rank, world),
            "same_objects": all(a is b for a, b in zip(params, wrapped.parameters())),
            "changed": _changed(initial, wrapped),  # a full state dict (a collective)
            "params": len(initial),
        }
    return out


def yafsdp_optimizer_before_wrap(rank, world):
    model = M.tiny_llama()
    optimizer = M.make_adamw(model.parameters())
    return _train(_yafsdp(model), optimizer, rank, world)


def fsdp2_optimizer_before_fully_shard(rank, world):
    out = {}
    for which in ("native", "ours"):
        torch.manual_seed(0)
        fsdp = dialect(which)
        model = M.tiny_llama()
        initial = _initial(model)
        optimizer = M.make_adamw(model.parameters())
        for layer in model.model.layers:
            fsdp.fully_shard(layer)
        fsdp.fully_shard(model)
        try:
            _train(model, optimizer, rank, world)
            error = None
        except RuntimeError as exc:
            error = str(exc)
        full = {k: v.full_tensor() for k, v in model.state_dict().items() if k in initial}
        out[which] = {"error": error,
                      "changed": sum(not torch.equal(initial[k], full[k]) for k in initial)}
    return out


def reference(rank, world, dtype=None):
    """The single process on the global batch; with `dtype`, cast and with its loss in it."""
    model = M.tiny_llama()
    if dtype is None:
        return _train(model, M.make_adamw(model.parameters()), 0, 1)
    model = model.to(dtype)
    return _train(model, M.make_adamw(model.parameters()), 0, 1, loss_in_model_dtype)


# -- casting the wrapped model ------------------------------------------------------------------


def _cast(model, dtype):
    return model.half() if dtype is torch.float16 else model.to(dtype)


def fsdp1_cast_after_wrap(rank, world, dtype, sgd=False):
    """`.half()` / `.to(dtype)` on the wrapper, then an optimizer, then training. fp16 trains
    with SGD: Adam's second moment underflows in fp16 and both runs blow up."""
    out = {}
    for which in ("native", "ours"):
        torch.manual_seed(0)
        wrapped = _cast(_fsdp1(dialect(which), M.tiny_llama()), dtype)
        optimizer = (torch.optim.SGD(wrapped.parameters(), lr=0.05) if sgd
                     else M.make_adamw(wrapped.parameters()))
        # float64: the loss in float64 shows its precision; bf16 / fp16: Hugging Face's fp32
        # loss over low-precision logits keeps more digits to compare.
        loss_fn = loss_in_model_dtype if dtype is torch.float64 else M.lm_loss
        losses = _train(wrapped, optimizer, rank, world, loss_fn)
        out[which] = {"losses": losses,
                      "dtypes": sorted({str(p.dtype) for p in wrapped.parameters()}),
                      "logits_dtype": str(loss_in_model_dtype(wrapped, _batches()[0][:1]).dtype)}
    return out


def yafsdp_double_after_wrap(rank, world):
    # param_dtype=None: compute in the parameters' dtype, whatever it becomes.
    wrapped = _yafsdp(M.tiny_llama(), param_dtype=None).to(torch.float64)
    return _train(wrapped, M.make_adamw(wrapped.parameters()), rank, world, loss_in_model_dtype)


def fsdp1_cast_of_part_of_a_unit(rank, world):
    """Half a unit cast: the unit's flat shard cannot hold two dtypes: refused by name."""
    wrapped = _fsdp1(dialect("ours"), M.tiny_llama())
    wrapped.module.model.layers[0].mlp.half()
    try:
        M.lm_loss(wrapped, M.rank_slice(_batches()[0], rank, world))
    except ValueError as exc:
        return str(exc)
    return None


# -- nested FSDP1 wrappers with a process group of their own --------------------------------------


class _MoE(nn.Module):
    """A shared input and output layer, with one expert per rank (different weights on each
    rank, as expert parallelism has them)."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        torch.manual_seed(100 + rank)
        self.expert = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(torch.relu(self.expert(torch.relu(self.inp(x)))))


def _moe_train(model, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(7 + rank)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, 8, generator=generator)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(loss.item()))
    return losses


def fsdp1_nested_process_group(rank, world):
    """Native honours the expert's one-rank group; ours refuses it by name, leaves the model
    as it was, and the fix it names (the experts in ignored_modules) trains like native."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    native_fsdp, ours_fsdp = dialect("native"), dialect("ours")
    model = _MoE(rank)
    model.expert = native_fsdp.FullyShardedDataParallel(model.expert, process_group=groups[rank],
                                                        device_id=CPU)
    native = _moe_train(native_fsdp.FullyShardedDataParallel(model, device_id=CPU), rank)

    model = _MoE(rank)
    model.expert = ours_fsdp.FullyShardedDataParallel(model.expert, process_group=groups[rank])
    inner = model.expert
    try:
        ours_fsdp.FullyShardedDataParallel(model)
        error = None
    except ValueError as exc:
        error = str(exc)
    kept = model.expert is inner

    model = _MoE(rank)
    fixed = _moe_train(ours_fsdp.FullyShardedDataParallel(model, ignored_modules=[model.expert]),
                       rank)
    return {"native": native, "error": error, "inner_kept": kept, "ignored_modules": fixed}


def fsdp1_nested_same_ranks(rank, world):
    """A nested wrapper whose group is another object over the root's ranks is accepted and
    trains like native."""
    group = dist.new_group(list(range(world)))
    out = {}
    for which in ("native", "ours"):
        fsdp = dialect(which)
        model = M.tiny_llama()
        model.model.layers[1] = fsdp.FullyShardedDataParallel(model.model.layers[1],
                                                              process_group=group, device_id=CPU)
        wrapped = fsdp.FullyShardedDataParallel(model, device_id=CPU)
        out[which] = _train(wrapped, M.make_adamw(wrapped.parameters()), rank, world)
    return out


# -- a wrap that fails halfway ---------------------------------------------------------------------


def _state(model):
    """The state dict, and every buffer (non-persistent ones too), by name."""
    entries = dict(model.named_buffers())
    entries.update(model.state_dict())
    return {k: (v.dtype, v.device.type, v.detach().clone()) for k, v in entries.items()}


def _same_state(before, model):
    after = _state(model)
    return list(before) == list(after) and all(
        before[k][:2] == after[k][:2] and torch.equal(before[k][2], after[k][2]) for k in before)


def _fails_late(wrap, model):
    """Make the engine fail after every parameter is flattened (it raises while registering
    its hooks), wrap, and report what the model looks like afterwards."""
    from fsdp_bridge.engine import runtime

    params = list(model.parameters())
    before = _state(model)
    hooks_before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())

    def injected(self):
        assert all(p.dim() == 1 for p in params)  # flattened by now
        raise RuntimeError("injected late failure")

    original = runtime.ShardedModel._register_hooks
    runtime.ShardedModel._register_hooks = injected
    try:
        wrap(model)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    finally:
        runtime.ShardedModel._register_hooks = original
    return {
        "error": error,
        "same_state": _same_state(before, model),
        "same_objects": [id(p) for p in params] == [id(p) for p in model.parameters()],
        "same_hooks": hooks_before == sum(len(m._forward_pre_hooks) + len(m._forward_hooks)
                                          for m in model.modules()),
        "no_engine_state": not hasattr(model, "_fsdp_bridge"),
    }


def failed_wrap_fsdp1(rank, world):
    model = M.tiny_llama()
    out = _fails_late(lambda m: _fsdp1(dialect("ours"), m), model)
    # The model still trains, unwrapped, exactly like a fresh one.
    out["loss_after"] = M.lm_loss(model, _batches()[0]).item()
    out["loss_fresh"] = M.lm_loss(M.tiny_llama(), _batches()[0]).item()
    return out


def failed_wrap_yafsdp(rank, world):
    return _fails_late(_yafsdp, M.tiny_llama())


def failed_wrap_sync_module_states(rank, world):
    """sync_module_states broadcasts rank 0's buffers into every rank's before the failure:
    each rank gets its own values back."""
    model = M.tiny_llama()
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.add_(rank)  # rank-dependent values
    out = _fails_late(lambda m: _fsdp1(dialect("ours"), m, sync_module_states=True), model)
    out["inv_freq_sum"] = float(model.model.rotary_emb.inv_freq.sum())
    return out


def failed_wrap_over_a_nested_wrapper(rank, world):
    """The outer wrap fails after releasing the inner wrapper: the inner one is back in the
    tree, still sharded, and trains like an untouched copy of itself."""
    fsdp = dialect("ours")
    model = M.tiny_llama()
    model.model.layers[1] = fsdp.FullyShardedDataParallel(model.model.layers[1])
    inner = model.model.layers[1]
    out = _fails_late(lambda m: fsdp.FullyShardedDataParallel(m), model)
    out["inner_kept"] = model.model.layers[1] is inner and inner.check_is_root()
    twin = M.tiny_llama()
    twin.model.layers[1] = fsdp.FullyShardedDataParallel(twin.model.layers[1])
    ids = M.rank_slice(_batches()[0], rank, world)
    out["losses"] = [M.lm_loss(m, ids).item() for m in (model, twin)]
    return out


def failed_wrap_meta_init(rank, world):
    """A param_init_fn that fails halfway through a meta model: back on meta, as it was."""
    model = M.tiny_llama(device="meta")
    params = list(model.parameters())
    calls = []

    def init(module):
        calls.append(module)
        if len(calls) > 3:
            raise RuntimeError("init failed")
        module.to_empty(device=CPU, recurse=False)

    try:
        _fsdp1(dialect("ours"), model, param_init_fn=init)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "all_meta": all(p.is_meta for p in model.parameters()),
            "same_objects": [id(p) for p in params] == [id(p) for p in model.parameters()]}


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x * self.scale


def failed_fully_shard_with_a_scalar(rank, world):
    """fully_shard refuses a scalar parameter met after others were converted: none stays
    converted, the class is the original one."""
    fsdp = dialect("ours")
    model = nn.Sequential(nn.Linear(4, 4), _Scale())
    params = list(model.parameters())
    before = _state(model)
    try:
        fsdp.fully_shard(model)
        error = None
    except ValueError as exc:
        error = str(exc)
    from torch.distributed.tensor import DTensor

    return {"error": error, "same_state": _same_state(before, model),
            "same_objects": [id(p) for p in params] == [id(p) for p in model.parameters()],
            "no_dtensor": not any(isinstance(p, DTensor) for p in model.parameters()),
            "class": type(model).__name__}


# -- fully_shard after the first forward ---------------------------------------------------------


def fully_shard_after_first_forward(rank, world):
    fsdp = dialect("ours")
    model = M.tiny_llama()
    fsdp.fully_shard(model)
    M.lm_loss(model, M.rank_slice(_batches()[0], rank, world)).backward()
    try:
        fsdp.fully_shard(model.model.layers[0])
    except ValueError as exc:
        return str(exc)
    return None


CASES = {
    "fsdp1_optimizer_before_wrap": fsdp1_optimizer_before_wrap,
    "yafsdp_optimizer_before_wrap": yafsdp_optimizer_before_wrap,
    "fsdp2_optimizer_before_fully_shard": fsdp2_optimizer_before_fully_shard,
    "reference": reference,
    "reference_float64": functools.partial(reference, dtype=torch.float64),
    "fsdp1_float64_after_wrap": functools.partial(fsdp1_cast_after_wrap, dtype=torch.float64),
    "fsdp1_bfloat16_after_wrap": functools.partial(fsdp1_cast_after_wrap, dtype=torch.bfloat16),
    "fsdp1_half_after_wrap": functools.partial(fsdp1_cast_after_wrap, dtype=torch.float16,
                                               sgd=True),
    "yafsdp_float64_after_wrap": yafsdp_double_after_wrap,
    "fsdp1_cast_of_part_of_a_unit": fsdp1_cast_of_part_of_a_unit,
    "fsdp1_nested_process_group": fsdp1_nested_process_group,
    "fsdp1_nested_same_ranks": fsdp1_nested_same_ranks,
    "failed_wrap_fsdp1": failed_wrap_fsdp1,
    "failed_wrap_yafsdp": failed_wrap_yafsdp,
    "failed_wrap_sync_module_states": failed_wrap_sync_module_states,
    "failed_wrap_over_a_nested_wrapper": failed_wrap_over_a_nested_wrapper,
    "failed_wrap_meta_init": failed_wrap_meta_init,
    "failed_fully_shard_with_a_scalar": failed_fully_shard_with_a_scalar,
    "fully_shard_after_first_forward": fully_shard_after_first_forward,
}


def run_cases(rank, world):
    return run_case_table(CASES)
