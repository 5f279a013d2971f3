"""Training cases run on spawned ranks by the engine tests (one world, many cases; gloo on CPU,
NCCL on CUDA, see tests/world.py).

Each case trains a tiny HF model on every rank with that rank's slice of one global batch and
returns, from rank 0, what the parent test compares with a single-process reference: the global
per-step losses (mean of the rank losses), grad norms where clipped, and the final full state
dict. Rank 1's results are returned too (some checks look at both ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests import models as M
from tests.world import device, device_type

STEPS = 5
GLOBAL_BATCH = 8


# -- wrapping helpers -------------------------------------------------------------------------


def yafsdp_llama(model, zero_stage=3, param_dtype=torch.float32, steps=1, **kwargs):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fsdp_bridge.ya_fsdp import YaFSDP

    return YaFSDP(
        model,
        zero_stage=zero_stage,
        modules_to_wrap_with_names=[
            (layer, f"model.layers.{i}") for i, layer in enumerate(model.model.layers)
        ],
        rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
        layer_norm_module_cls=LlamaRMSNorm,
        param_dtype=param_dtype,
        gradient_accumulation_steps=steps,
        **kwargs,
    )


def yafsdp_gpt2(model, zero_stage=3, **kwargs):
    from fsdp_bridge.ya_fsdp import YaFSDP

    return YaFSDP(
        model,
        zero_stage=zero_stage,
        modules_to_wrap_with_names=[
            (block, f"transformer.h.{i}") for i, block in enumerate(model.transformer.h)
        ],
        layer_norm_module_cls=nn.LayerNorm,
        param_dtype=torch.float32,
        gradient_accumulation_steps=1,
        **kwargs,
    )


def engine_plan(model, layer_prefix, mode, reshard=True):
    from fsdp_bridge.plan import Plan, ShardingMode, UnitSpec

    layers = model.get_submodule(layer_prefix)
    units = tuple(UnitSpec(f"{layer_prefix}.{i}", reshard) for i in range(len(layers)))
    return Plan(units=units + (UnitSpec(""),), mode=ShardingMode(mode))


# -- the training loop ------------------------------------------------------------------------


def train(rank, world, model, optimizer=None, micro_steps=1, divide_loss=True, no_sync=False,
          clip=None, steps=STEPS):
    """Train `model` (already sharded) on this rank's slice; returns losses and grad norms."""
    optimizer = optimizer or M.make_adamw(model.parameters())
    losses, norms = [], []
    for batch in M.global_batches(steps, GLOBAL_BATCH):
        micro = M.rank_slice(batch, rank, world).chunk(micro_steps)
        total = 0.0
        for index, ids in enumerate(micro):
            loss = M.lm_loss(model, ids)
            if divide_loss:
                loss = loss / micro_steps
            last = index == micro_steps - 1
            if no_sync and not last:
                with model.no_sync():
                    loss.backward()
            else:
                loss.backward()
            total += loss.item() / (1 if divide_loss else micro_steps)
        if clip is not None:
            norms.append(float(model.clip_grad_norm_(clip)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(M.global_mean(total))
    return losses, norms


def full_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def result(rank, world, model, **train_kwargs):
    losses, norms = train(rank, world, model, **train_kwargs)
    return {"losses": losses, "norms": norms, "state": full_state(model)}


# -- cases ------------------------------------------------------------------------------------


def case_llama_zero3(rank, world):
    return result(rank, world, yafsdp_llama(M.tiny_llama(), zero_stage=3))


def case_llama_zero2(rank, world):
    return result(rank, world, yafsdp_llama(M.tiny_llama(), zero_stage=2))


def _engine_wrapped(model, layer_prefix, mode):
    from fsdp_bridge import engine

    sharded = engine.shard_model(model, engine_plan(model, layer_prefix, mode))
    model.no_sync = sharded.no_sync
    model.clip_grad_norm_ = sharded.clip_grad_norm_
    return model, sharded


def case_llama_replicate(rank, world):
    from fsdp_bridge import engine

    model, sharded = _engine_wrapped(M.tiny_llama(), "model.layers", "replicate")
    out = result(rank, world, model)
    out["state"] = engine.full_state_dict(sharded)
    return out


def case_gpt2_zero3(rank, world):
    model = M.tiny_gpt2()
    wrapped = yafsdp_gpt2(model, zero_stage=3)
    out = result(rank, world, wrapped)
    out["tied_is_same"] = model.lm_head.weight is model.transformer.wte.weight
    return out


def case_gpt2_replicate(rank, world):
    from fsdp_bridge import engine

    model, sharded = _engine_wrapped(M.tiny_gpt2(), "transformer.h", "replicate")
    out = result(rank, world, model)
    out["state"] = engine.full_state_dict(sharded)
    return out


def case_accumulation_declared(rank, world):
    # YaFSDP style: 4 declared micro-steps; the loss is not divided, the engine divides by W*4.
    model = yafsdp_llama(M.tiny_llama(), steps=4)
    return result(rank, world, model, micro_steps=4, divide_loss=False)


def case_accumulation_no_sync(rank, world):
    # FSDP style: the user divides the loss and wraps all but the last micro-step in no_sync.
    model = yafsdp_llama(M.tiny_llama())
    out = result(rank, world, model, micro_steps=4, no_sync=True)
    # Inside no_sync, backward communicates nothing (gradients are summed locally).
    stats = model._sharded.comm.stats
    ids = M.rank_slice(M.global_batches(1, GLOBAL_BATCH)[0], rank, world)
    loss = M.lm_loss(model, ids)
    before = dict(stats.calls)
    with model.no_sync():
        loss.backward()
    out["no_sync_reductions"] = {
        kind: stats.calls.get(kind, 0) - before.get(kind, 0) for kind in ("reduce_scatter", "all_reduce")
    }
    return out


def case_clip(rank, world):
    return result(rank, world, yafsdp_llama(M.tiny_llama()), clip=0.5)


def case_frozen_embedding(rank, world):
    model = M.tiny_llama()
    model.model.embed_tokens.weight.requires_grad_(False)
    initial = model.model.embed_tokens.weight.detach().clone()
    wrapped = yafsdp_llama(model)
    optimizer = M.make_adamw([p for p in wrapped.parameters() if p.requires_grad])
    out = result(rank, world, wrapped, optimizer=optimizer)
    frozen_group = next(
        g for u in wrapped._sharded.units for g in u.groups if not g.requires_grad
    )
    out["frozen_initial"] = initial
    out["frozen_grad_is_none"] = model.model.embed_tokens.weight.grad is None
    out["frozen_has_grad_memory"] = (frozen_group.grad_shard is not None
                                     or frozen_group.grad_shard_ref is not None)
    return out


def case_meta_init(rank, world):
    source = M.tiny_llama()  # what the user's init produces (e.g. loaded weights)
    values = dict(source.named_parameters()) | dict(source.named_buffers())
    meta = M.tiny_llama(device="meta")
    prefixes = {id(m): name for name, m in meta.named_modules()}

    def param_init_fn(module):
        module.to_empty(device=device(), recurse=False)
        prefix = prefixes[id(module)]
        with torch.no_grad():
            for name, tensor in list(module.named_parameters(recurse=False)) + list(
                module.named_buffers(recurse=False)
            ):
                tensor.copy_(values[f"{prefix}.{name}" if prefix else name])

    return result(rank, world, yafsdp_llama(meta, param_init_fn=param_init_fn))


def case_sync_module_states(rank, world):
    # Every rank initialises differently; rank 0's weights (seed 0) must win.
    model = M.tiny_llama(seed=rank)
    return result(rank, world, yafsdp_llama(model, sync_module_states=True))


def _param_groups(model):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if "norm" in name or name.endswith("bias") else decay).append(param)
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


OPTIMIZERS = {
    "adamw_single": lambda groups: torch.optim.AdamW(groups, lr=1e-3, eps=1e-5, foreach=False),
    "adam_foreach": lambda groups: torch.optim.Adam(groups, lr=1e-3, eps=1e-5, foreach=True),
    "adam_single": lambda groups: torch.optim.Adam(groups, lr=1e-3, eps=1e-5, foreach=False),
    "sgd_foreach": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, foreach=True),
    "sgd_single": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, foreach=False),
}


def case_optimizers(rank, world):
    out = {}
    for name, make in OPTIMIZERS.items():
        model = yafsdp_llama(M.tiny_llama())
        out[name] = result(rank, world, model, optimizer=make(_param_groups(model)))
        out[name]["param_names"] = [n for n, _ in model.named_parameters()]
    return out


def case_bf16_vs_fsdp2(rank, world):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from tests.native_torch import fsdp2_unavailable

    ours = result(rank, world, yafsdp_llama(M.tiny_llama(), param_dtype=torch.bfloat16))
    if fsdp2_unavailable():
        return {"ours": ours, "unavailable": fsdp2_unavailable()}
    native = M.tiny_llama()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in native.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(native, mp_policy=policy)
    losses, _ = train(rank, world, native)
    state = {k: _gathered(v) if hasattr(v, "full_tensor") else v for k, v in native.state_dict().items()}
    return {"ours": ours, "native": {"losses": losses, "state": state}}


def _gathered(dtensor):
    """The full value of a dim-0-sharded DTensor, gathered with c10d's all_gather.
    `DTensor.full_tensor()` goes through torch's functional collectives, which crash (SIGSEGV)
    on CUDA tensors over gloo in torch 2.11; the plain collective does not."""
    local = dtensor.to_local()
    rows = -(-dtensor.shape[0] // dist.get_world_size())
    padded = local.new_zeros((rows, *dtensor.shape[1:]))
    padded[: local.shape[0]] = local
    pieces = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, padded)
    return torch.cat(pieces)[: dtensor.shape[0]]


def case_state_dict_api(rank, world):
    model = yafsdp_llama(M.tiny_llama(seed=3))
    reference = M.tiny_llama()
    model.load_state_dict(reference.state_dict())
    loaded = full_state(model)
    rank0_only = model.state_dict(rank0_only=True)
    return {
        "loaded": loaded,
        "rank0_only_len": len(rank0_only),
        "names": [n for n, _ in model.named_parameters()],
    }


def case_plan_disagreement(rank, world):
    model = M.tiny_llama()
    layers = list(model.model.layers)
    if rank == 1:
        layers = layers[:-1]  # rank 1 wraps one layer fewer
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fsdp_bridge.ya_fsdp import YaFSDP

    try:
        YaFSDP(
            model,
            zero_stage=3,
            modules_to_wrap_with_names=[(layer, f"model.layers.{i}") for i, layer in enumerate(layers)],
            layer_norm_module_cls=LlamaRMSNorm,
            param_dtype=torch.float32,
            gradient_accumulation_steps=1,
        )
    except ValueError as exc:
        return str(exc)
    return None


def case_collectives_of_a_pair(rank, world):
    """The engine's gather and reduce-scatter over a pair against torch's own collectives, in
    both dtypes, at an odd size, with the sent shard outside the output and inside its own place
    (on gloo a pair swaps halves with one all-to-all)."""
    from fsdp_bridge.engine.comm import Comm

    comm = Comm(dist.group.WORLD, None, dist.group.WORLD)
    checks = {"swaps_halves": comm.swaps_halves, "backend": dist.get_backend()}
    for dtype in (torch.float32, torch.bfloat16):
        half = 1001
        generator = torch.Generator().manual_seed(7 + rank)
        shard = torch.randn(half, generator=generator).to(dtype=dtype, device=device())
        expected = torch.empty(world * half, dtype=dtype, device=device())
        dist.all_gather_into_tensor(expected, shard)
        apart = torch.full_like(expected, float("nan"))
        comm.all_gather(apart, shard).wait()
        in_place = torch.full_like(expected, float("nan"))
        own = in_place[rank * half : (rank + 1) * half]
        own.copy_(shard)
        comm.all_gather(in_place, own).wait()
        full = torch.randn(world * half, generator=generator).to(dtype=dtype, device=device())
        summed = full.clone()
        dist.all_reduce(summed)
        mine = slice(rank * half, (rank + 1) * half)
        comm.stats.reset()
        if comm.reduce_scatter_in_place:
            reduced = full.clone()
            comm.reduce_scatter_in_buffer(reduced).wait()
            reduced = reduced[mine]
        else:
            reduced = torch.empty_like(shard)
            comm.reduce_scatter(reduced, full).wait()
        # the engine's own counter: one call moving the full tensor, as the bench counts it
        full_bytes = full.numel() * full.element_size()
        checks[str(dtype).split(".")[-1]] = {
            "gather_apart": torch.equal(apart, expected),
            "gather_in_place": torch.equal(in_place, expected),
            "reduced_slice": torch.equal(reduced, summed[mine]),
            "counted_once": list(comm.stats.calls.values()) == [1]
            and list(comm.stats.bytes.values()) == [full_bytes],
        }
    return checks


class _Awkward(nn.Module):
    """67 parameters: in the flat layout `a.weight` crosses the middle of the padded 68, in the
    row layout `a.weight`'s 5 rows split 3 / 2; `unused` gets no gradient."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.unused = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        return self.b(self.a(x))


def _wrapped_awkward(layout: str):
    from fsdp_bridge import engine
    from fsdp_bridge.fsdp import fully_shard
    from fsdp_bridge.plan import Plan, UnitSpec

    torch.manual_seed(0)
    model = _Awkward().to(device())
    if layout == "rows":
        fully_shard(model)
        with torch.no_grad():
            model(torch.zeros(1, 7, device=device()))  # the model is sharded at first use
        return engine.get_sharded(model)
    return engine.shard_model(model, Plan(units=(UnitSpec(""),)))


def case_pair_reduces_from_gradients(rank, world):
    """A unit's reduction started from its per-parameter gradients (on gloo a pair sends only
    the other rank's part and adds its own from the gradients) against torch's all-reduce of
    each gradient, cut into this rank's shard as the parameters are (`split`, `shard_of`), in
    both layouts: fp32 and bf16 gradients reduced in fp32, and fp32 gradients reduced in bf16
    (rounded before the sum)."""
    checks = {}
    f32, bf16 = torch.float32, torch.bfloat16
    for layout in ("flat", "rows"):
        (group,) = _wrapped_awkward(layout).flat_groups()
        for dtype, reduce_dtype in ((f32, f32), (bf16, f32), (f32, bf16)):
            group.reduce_dtype = reduce_dtype
            generator = torch.Generator().manual_seed(11 + rank)
            grads = tuple(None if slot.fqn == "unused" else
                          torch.randn(slot.shape, generator=generator).to(dtype=dtype,
                                                                          device=device())
                          for slot in group.slots)
            full = torch.zeros(group.padded_numel, dtype=reduce_dtype, device=device())
            for (_, view), grad in zip(group.split(full), grads):
                if grad is not None:
                    summed = grad.to(reduce_dtype, copy=True)
                    dist.all_reduce(summed)
                    view.copy_(summed)
            kept = group.grad_part_pieces(grads, rank)
            work, output, source = group.start_reduce_of_grads(grads)
            work.wait()
            checks[f"{layout}/{dtype} into {reduce_dtype}"] = {
                "reduced": torch.equal(output, group.shard_of(full)),
                "source_numel": source.numel(),
                "kept_bytes": sum(t.untyped_storage().nbytes() for _, t in kept),
                "part_bytes": group.shard_numel * max(dtype.itemsize, reduce_dtype.itemsize),
                "shard_numel": group.shard_numel, "padded_numel": group.padded_numel,
            }
    return checks


WORLD2_CASES = [
    case_collectives_of_a_pair,
    case_pair_reduces_from_gradients,
    case_llama_zero3,
    case_llama_zero2,
    case_llama_replicate,
    case_gpt2_zero3,
    case_gpt2_replicate,
    case_accumulation_declared,
    case_accumulation_no_sync,
    case_clip,
    case_frozen_embedding,
    case_meta_init,
    case_sync_module_states,
    case_optimizers,
    case_bf16_vs_fsdp2,
    case_state_dict_api,
    case_plan_disagreement,
]


def run_cases(rank, world, case_names):
    torch.manual_seed(0)
    out = {}
    for name in case_names:
        out[name] = globals()[name](rank, world)
        dist.barrier()
    return out


# -- world 4: hybrid 2 x 2 ----------------------------------------------------------------------


def _hybrid(model, layer_prefix):
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_bridge import engine
    from fsdp_bridge.plan import Plan, ShardingMode, UnitSpec

    mesh = init_device_mesh(device_type(), (2, 2), mesh_dim_names=("replicate", "shard"))
    layers = model.get_submodule(layer_prefix)
    plan = Plan(
        units=tuple(UnitSpec(f"{layer_prefix}.{i}") for i in range(len(layers))) + (UnitSpec(""),),
        mode=ShardingMode.HYBRID,
    )
    sharded = engine.shard_model(
        model, plan, shard_group=mesh.get_group("shard"), replicate_group=mesh.get_group("replicate")
    )
    model.clip_grad_norm_ = sharded.clip_grad_norm_
    return model, sharded


def case_hybrid_llama(rank, world):
    from fsdp_bridge import engine

    model, sharded = _hybrid(M.tiny_llama(), "model.layers")
    out = result(rank, world, model, clip=1.0)
    out["state"] = engine.full_state_dict(sharded)
    return out


def case_hybrid_gpt2(rank, world):
    from fsdp_bridge import engine

    model, sharded = _hybrid(M.tiny_gpt2(), "transformer.h")
    out = result(rank, world, model)
    out["state"] = engine.full_state_dict(sharded)
    return out


def case_zero3_world4(rank, world):
    return result(rank, world, yafsdp_llama(M.tiny_llama()))


def case_hybrid_replica_reduces_wait_for_the_end(rank, world):
    """When each reduction of a hybrid backward joins its gradient (its replica all-reduce
    waited on), counted in post-backwards run so far: all at the end of backward, none in a
    later unit's post-backward (as FSDP2 keeps HSDP's all-reduce off the critical path). The
    deferred shards are counted too: they pile up until the end."""
    model, sharded = _hybrid(M.tiny_llama(), "model.layers")
    seen = {"post_backwards": 0, "finished_after": [], "deferred_peak": 0}
    post_backward, finish = sharded.post_backward, sharded._finish_reduce

    def counting_post_backward(group, grads):
        seen["post_backwards"] += 1
        post_backward(group, grads)
        seen["deferred_peak"] = max(seen["deferred_peak"], len(sharded.replica_reduces))

    def recording_finish(pending):
        seen["finished_after"].append(seen["post_backwards"])
        finish(pending)

    sharded.post_backward, sharded._finish_reduce = counting_post_backward, recording_finish
    M.lm_loss(model, M.rank_slice(M.global_batches(1, GLOBAL_BATCH)[0], rank, world)).backward()
    return seen


WORLD4_CASES = [case_hybrid_llama, case_hybrid_gpt2, case_zero3_world4,
                case_hybrid_replica_reduces_wait_for_the_end]
