"""FSDP2 with DTensor parameters: rank functions run once with `torch.distributed.fsdp` and once
with `fsdp_bridge.fsdp` (one spawned world, many cases; see test_fsdp2_dtensor.py).

Each case returns {"native": ..., "ours": ...} (or plain facts about ours) holding what a user
sees: parameter and gradient layouts, losses, norms from torch's own clipping functions, full
values (`full_tensor()`), optimizer state, and what loading / checkpointing gives back.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Bound before any model is sharded, as a training script does at its top: torch's own
# functions must give global norms on DTensor gradients without being rebound.
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_, get_total_norm

from tests import models as M
from tests.frontends.parity_cases import _model, dialect
from tests.native_torch import fsdp2_case
from tests.world import run_case_table

WHICH = ("native", "ours")
STEPS = 3
GLOBAL_BATCH = 8


def _batch(step: int, rank: int, world: int, steps: int = STEPS) -> torch.Tensor:
    return M.rank_slice(M.global_batches(steps, GLOBAL_BATCH)[step], rank, world)


def _full(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _full_state(model) -> dict:
    return {k: _full(v).detach().clone() for k, v in model.state_dict().items()}


def _shard_llama(which, model=None, **kwargs):
    fsdp = dialect(which)
    model = model if model is not None else _model("llama")
    for layer in model.model.layers:
        fsdp.fully_shard(layer, **kwargs)
    fsdp.fully_shard(model, **kwargs)
    return model


# -- a small transformer in the style of the FSDP2 tutorial's -------------------------------------


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn_norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int = M.VOCAB, dim: int = 32, layers: int = 4, heads: int = 4):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(M.SEQ, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok_embeddings(ids) + self.pos_embeddings(positions)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)).float()

    def reset_parameters(self):
        for module in self.modules():
            if module is not self and hasattr(module, "reset_parameters"):
                module.reset_parameters()


class EncoderDecoder(nn.Module):
    """Decoder layers read the encoder's output, so backward reaches encoder layers (their
    outputs get gradients) while decoder layers are still running theirs."""

    def __init__(self, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(M.VOCAB, dim)
        self.encoder = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.decoder = nn.ModuleList(CrossLayer(dim) for _ in range(layers))
        self.head = nn.Linear(dim, M.VOCAB)

    def forward(self, ids):
        memory = x = self.embed(ids)
        for layer in self.encoder:
            memory = torch.tanh(layer(memory))
        for layer in self.decoder:
            x = layer(x, memory)
        return self.head(x)


class CrossLayer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.own = nn.Linear(dim, dim)
        self.cross = nn.Linear(dim, dim)

    def forward(self, x, memory):
        return torch.tanh(self.own(x) + self.cross(memory))


# -- cases ----------------------------------------------------------------------------------------


def dtensor_surface(which, rank, world):
    """Parameter and gradient layouts, and the DTensor API on them."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    reference = _model("llama")
    model = _shard_llama(which)
    facts = {"all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
             "placements": sorted({str(p.placements) for p in model.parameters()}),
             "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
             "numel": {n: p.numel() for n, p in model.named_parameters()},
             "mesh_sizes": sorted({p.device_mesh.size() for p in model.parameters()})}
    full_ok = all(torch.equal(p.full_tensor(), reference.get_parameter(n))
                  for n, p in model.named_parameters())
    replicated_ok = all(
        torch.equal(p.redistribute(p.device_mesh, [Replicate()]).to_local(),
                    reference.get_parameter(n)) for n, p in model.named_parameters())
    M.lm_loss(model, _batch(0, rank, world)).backward()
    facts["grads"] = {n: (type(p.grad).__name__, str(p.grad.placements),
                          tuple(p.grad.to_local().shape)) for n, p in model.named_parameters()}
    facts["full_ok"], facts["replicated_ok"] = full_ok, replicated_ok
    facts["shard0"] = all(p.placements == (Shard(0),) for p in model.parameters())
    return facts


def _optimizer(kind, model):
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if kind == "adamw_foreach":
        return torch.optim.AdamW(groups, lr=1e-3, eps=1e-5, foreach=True)
    if kind == "adamw_single":
        return torch.optim.AdamW(groups, lr=1e-3, eps=1e-5, foreach=False)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-3, eps=1e-5)
    if kind == "sgd_foreach":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=True)
    return torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=False)


def training(which, rank, world, optimizer="adamw_foreach", mp_policy=None):
    """Losses, torch's own clip norms and final full parameters, per optimizer."""
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    model = _shard_llama(which, **kwargs)
    optim = _optimizer(optimizer, model)
    losses, norms = [], []
    for step in range(STEPS):
        loss = M.lm_loss(model, _batch(step, rank, world))
        loss.backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        norms.append((type(norm).__name__, _full(norm).item()))
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss.item()))
    state = optim.state_dict()["state"]
    optim_full = {f"{i}.{k}": _full(v).clone() for i, entry in state.items()
                  for k, v in entry.items() if torch.is_tensor(v) and v.dim() > 0}
    return {"losses": losses, "norms": norms, "state": _full_state(model),
            "optim": optim_full,
            "optim_types": sorted({type(v).__name__ for entry in state.values()
                                   for k, v in entry.items() if k != "step"})}


def total_norm_functions(which, rank, world):
    """get_total_norm + clip_grads_with_norm_, inf norm too."""
    model = _shard_llama(which)
    M.lm_loss(model, _batch(0, rank, world)).backward()
    grads = [p.grad for p in model.parameters()]
    total = get_total_norm(grads, 2.0)
    inf = get_total_norm(grads, float("inf"))
    clip_grads_with_norm_(model.parameters(), 0.5, total)
    return {"total": _full(total).item(), "inf": _full(inf).item(),
            "after": _full(get_total_norm([p.grad for p in model.parameters()])).item()}


def reference_norms(rank, world):
    """The single-process reference on the global batch (what both must match)."""
    model = _model("llama")
    M.lm_loss(model, M.global_batches(STEPS, GLOBAL_BATCH)[0]).backward()
    grads = [p.grad for p in model.parameters()]
    return {"total": get_total_norm(grads).item(),
            "inf": get_total_norm(grads, float("inf")).item()}


def state_dict_cost(which, rank, world):
    """`state_dict()` is sharded and communication-free."""
    from torch.distributed.tensor.debug import CommDebugMode

    model = _shard_llama(which)
    M.lm_loss(model, _batch(0, rank, world)).backward()  # after the runtime exists
    with CommDebugMode() as comm:
        state = model.state_dict()
    local = sum(v.to_local().numel() for v in state.values() if hasattr(v, "to_local"))
    full = sum(v.numel() for v in state.values() if hasattr(v, "to_local"))
    return {"collectives": comm.get_total_counts(), "local_numel": local, "full_numel": full,
            "keys": list(state)}


def loading(which, rank, world):
    """load_state_dict with full tensors, replicated DTensors, sharded DTensors, and with
    assign=True from distribute_tensor; each followed by one training step."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    source = _model("llama", seed=7).state_dict()
    out = {}
    for kind in ("full", "replicated", "sharded", "assign"):
        model = _shard_llama(which)
        if kind == "assign":  # the tutorial's meta-device path
            with torch.device("meta"):
                model = _shard_llama(which, _model("llama"))
        sharded = model.state_dict()
        if kind == "full":
            values = source
        elif kind == "replicated":
            values = {k: distribute_tensor(v, sharded[k].device_mesh, [Replicate()])
                      for k, v in source.items()}
        else:
            values = {k: nn.Parameter(distribute_tensor(v, sharded[k].device_mesh,
                                                        sharded[k].placements))
                      for k, v in source.items()}
        try:
            model.load_state_dict(values, assign=kind == "assign")
        except RuntimeError as exc:  # native FSDP2 takes DTensors only
            out[kind] = {"refused": str(exc)[:200]}
            continue
        equal = all(torch.equal(_full(v), source[k]) for k, v in model.state_dict().items())
        optim = M.make_adamw(model.parameters())
        loss = M.lm_loss(model, _batch(0, rank, world))
        loss.backward()
        optim.step()
        out[kind] = {"equal": equal, "loss": M.global_mean(loss.item()),
                     "state": _full_state(model)}
    return out


def meta_recipe(which, rank, world):
    """The tutorial's program: meta init, fully_shard, inspect parameters (before they have
    storage), to_empty + reset_parameters, train."""
    from torch.distributed.tensor import Shard

    fsdp = dialect(which)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer()
    for layer in model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    inspected = all(p.placements == (Shard(0),) and p.dtype == torch.float32
                    for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    model.reset_parameters()
    initial = _full_state(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = _tutorial_steps(model, optim, rank, world)
    return {"inspected": inspected, "initial": initial, "losses": losses,
            "state": _full_state(model)}


def _tutorial_steps(model, optim, rank, world, before_each=None):
    """The tutorial's loop: the sum of the logits as the loss, clipping, Adam."""
    losses = []
    for step in range(STEPS):
        if before_each is not None:
            before_each()
        loss = model(_batch(step, rank, world)).sum()
        loss.backward()
        clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss.item()))
    return losses


def layers_only(which, rank, world):
    """fully_shard on the layers but not on the root; the optimizer built right away."""
    model = _model("llama")
    fsdp = dialect(which)
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    optim = M.make_adamw(model.parameters())
    before = {k: _full(v).clone() for k, v in model.model.layers.state_dict().items()}
    losses = []
    for step in range(STEPS):
        loss = M.lm_loss(model, _batch(step, rank, world))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss.item()))
    after = {k: _full(v) for k, v in model.model.layers.state_dict().items()}
    changed = sum(not torch.equal(before[k], after[k]) for k in before)
    return {"losses": losses, "layer_params_changed": changed, "layer_params": len(before),
            "layers": {k: v.clone() for k, v in after.items()}}


def sub_container_optimizer(which, rank, world):
    """An optimizer over one sub-container's parameters, built after fully_shard."""
    model = _shard_llama(which)
    optim = M.make_adamw(model.model.layers.parameters())
    for step in range(STEPS):
        M.lm_loss(model, _batch(step, rank, world)).backward()
        optim.step()
        optim.zero_grad()
    return {k: _full(v).clone() for k, v in model.model.layers.state_dict().items()}


def encoder_decoder(which, rank, world):
    """Units whose backward runs out of forward order train as native."""
    fsdp = dialect(which)
    torch.manual_seed(0)
    model = EncoderDecoder()
    for layer in [*model.encoder, *model.decoder]:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)
    optim = M.make_adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        ids = _batch(step, rank, world)
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, M.VOCAB), ids.reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss.item()))
    return {"losses": losses, "state": _full_state(model)}


def dcp_round_trip(which, rank, world, directory):
    """dcp.save of model.state_dict() and of get_model_/get_optimizer_state_dict, written by
    `which`; every dialect then loads each of the others' checkpoints (see `dcp_cross`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _shard_llama(which)
    optim = M.make_adamw(model.parameters())
    for step in range(2):
        M.lm_loss(model, _batch(step, rank, world)).backward()
        optim.step()
        optim.zero_grad()
    dcp.save(model.state_dict(), checkpoint_id=os.path.join(directory, f"{which}_plain"))
    model_sd, optim_sd = get_state_dict(model, optim)
    dcp.save({"model": model_sd, "optim": optim_sd},
             checkpoint_id=os.path.join(directory, f"{which}_dsd"))
    return {"state": _full_state(model)}


def dcp_cross(which, rank, world, directory):
    """Load every checkpoint `dcp_round_trip` wrote into a fresh `which` model; continue one
    step from the optimizer state too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for writer in WHICH:
        model = _shard_llama(which, _model("llama", seed=3))
        state = model.state_dict()
        dcp.load(state, checkpoint_id=os.path.join(directory, f"{writer}_plain"))
        model.load_state_dict(state)
        out[f"plain_from_{writer}"] = _full_state(model)

        model = _shard_llama(which, _model("llama", seed=3))
        optim = M.make_adamw(model.parameters())
        M.lm_loss(model, _batch(0, rank, world)).backward()  # create optimizer state
        optim.step()
        optim.zero_grad()
        model_sd, optim_sd = get_state_dict(model, optim)
        target = {"model": model_sd, "optim": optim_sd}
        dcp.load(target, checkpoint_id=os.path.join(directory, f"{writer}_dsd"))
        set_state_dict(model, optim, model_state_dict=target["model"],
                       optim_state_dict=target["optim"])
        loaded = _full_state(model)
        loss = M.lm_loss(model, _batch(2, rank, world))
        loss.backward()
        optim.step()
        out[f"dsd_from_{writer}"] = {"loaded": loaded, "loss": M.global_mean(loss.item()),
                                     "stepped": _full_state(model)}
    return out


# -- the FSDP2 tutorial's program, and the torchtune / torchtitan idioms ----------------------------


def _save_full(model, optim, folder, dcp_api):
    """The tutorial's checkpoint: full model and optimizer state, written by rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    if dcp_api:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = get_model_state_dict(model, options=options)
        optim_sd = get_optimizer_state_dict(model, optim, options=options)
    else:
        model_sd = {k: _full(v).cpu() for k, v in model.state_dict().items()}
        plain = optim.state_dict()
        optim_sd = {"param_groups": plain["param_groups"],
                    "state": {i: {k: _full(v).cpu() for k, v in entry.items()}
                              for i, entry in plain["state"].items()}}
    if dist.get_rank() == 0:
        torch.save(model_sd, os.path.join(folder, "model.pt"))
        torch.save(optim_sd, os.path.join(folder, "optim.pt"))
    dist.barrier()


def _load_model(model, folder, dcp_api):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import distribute_tensor

    full = torch.load(os.path.join(folder, "model.pt"), weights_only=True, map_location="cpu")
    if dcp_api:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
        return
    meta = model.state_dict()
    sharded = {k: nn.Parameter(distribute_tensor(v, meta[k].device_mesh, meta[k].placements))
               for k, v in full.items()}
    model.load_state_dict(sharded, strict=False, assign=True)


def _load_optim(model, optim, folder, dcp_api):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, _init_optim_state, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = torch.load(os.path.join(folder, "optim.pt"), weights_only=True, map_location="cpu")
    if dcp_api:
        set_optimizer_state_dict(model, optim, full, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        return
    _init_optim_state(optim)
    current = optim.state_dict()
    for index, entry in current["state"].items():
        for key, value in entry.items():
            saved = full["state"][index][key]
            entry[key] = (distribute_tensor(saved, value.device_mesh, value.placements)
                          if isinstance(value, DTensor) else saved)
    optim.load_state_dict({"param_groups": full["param_groups"], "state": current["state"]})


def tutorial(which, rank, world, folder, mode):
    """The FSDP2 tutorial's training program in one of its modes, run twice: from scratch,
    then resumed from the checkpoint the first run saved."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.tensor import Shard

    fsdp = dialect(which)
    folder = os.path.join(folder, f"tutorial_{mode}_{which}")
    os.makedirs(folder, exist_ok=True)
    dist.barrier()
    out = {}
    for run in ("first", "resumed"):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = Transformer()
        kwargs = {}
        if mode == "mixed_precision":
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                       reduce_dtype=torch.float32)
        for layer in model.layers:
            fsdp.fully_shard(layer, **kwargs)
        fsdp.fully_shard(model, **kwargs)
        assert all(p.placements == (Shard(0),) and p.dtype == torch.float32
                   for p in model.parameters()), "inspect_model"
        if mode == "explicit_prefetching":
            layers = list(model.layers)
            for i, layer in enumerate(layers):
                if layers[i + 1 : i + 3]:
                    layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 3])
                if i >= 2:
                    layer.set_modules_to_backward_prefetch([layers[i - 1], layers[i - 2]])
        dcp_api = mode == "dcp_api"
        if run == "first":
            model.to_empty(device="cpu")
            model.reset_parameters()
        else:
            _load_model(model, folder, dcp_api)
        if mode == "mixed_precision":  # inspect_mixed_precision
            model.unshard()
            root_params = [model.output.weight, model.norm.weight, model.tok_embeddings.weight]
            assert all(p.dtype == torch.bfloat16 for p in root_params), "unsharded in bf16"
            model.reshard()
            assert all(p.dtype == torch.float32 for p in model.parameters()), "resharded"
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        if run == "resumed":
            _load_optim(model, optim, folder, dcp_api)
        prefetch = model.unshard if mode == "explicit_prefetching" else None
        losses = _tutorial_steps(model, optim, rank, world, before_each=prefetch)
        _save_full(model, optim, folder, dcp_api)
        out[run] = {"losses": losses, "state": _full_state(model)}
    return out


def torchtune_round_trip(which, rank, world):
    """torchtune's load_from_full_model_state_dict (meta model, distribute_tensor, assign) and
    gather_cpu_state_dict (full_tensor on rank 0), around one training step."""
    from torch.distributed.tensor import distribute_tensor

    full = _model("llama", seed=5).state_dict()
    with torch.device("meta"):
        model = _shard_llama(which, _model("llama"))
    meta = model.state_dict()
    sharded = {k: nn.Parameter(distribute_tensor(v.to(meta[k].dtype), meta[k].device_mesh,
                                                 meta[k].placements)) for k, v in full.items()}
    model.load_state_dict(sharded, strict=False, assign=True)

    def gather_cpu_state_dict():
        gathered = {}
        for name, value in model.state_dict().items():
            value = _full(value)
            if rank == 0:
                gathered[name] = value.cpu().clone()
        return gathered

    loaded = gather_cpu_state_dict()
    optim = M.make_adamw(model.parameters())
    loss = M.lm_loss(model, _batch(0, rank, world))
    loss.backward()
    optim.step()
    return {"round_trip": rank != 0 or all(torch.equal(loaded[k], v) for k, v in full.items()),
            "loss": M.global_mean(loss.item()), "after_step": gather_cpu_state_dict()}


def torchtitan_parallelize(which, rank, world):
    """torchtitan's parallelize: a named data-parallel mesh, a mixed-precision policy on every
    call, per-block fully_shard with reshard_after_forward as an int (the shard size) or False
    for the last block, the root last."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    fsdp = dialect(which)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    model = _model("llama")
    layers = list(model.model.layers)
    for index, block in enumerate(layers):
        reshard = world if index < len(layers) - 1 else False
        fsdp.fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fsdp.fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    optim = M.make_adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        loss = M.lm_loss(model, _batch(step, rank, world))
        loss.backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        losses.append(M.global_mean(loss.item()))
    return {"losses": losses, "state": _full_state(model)}


def bad_inputs(rank, world):
    """What ours refuses, and how it says so."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    fsdp = dialect("ours")
    out = {}

    def caught(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the exception is the result
            return exc
        return None

    def described(exc):
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    def error(fn):
        return described(caught(fn))

    model = _shard_llama("ours")
    key = "model.layers.0.mlp.up_proj.weight"
    wrong_shape = {key: torch.zeros(3, 3)}
    out["wrong_shape"] = error(lambda: model.load_state_dict(wrong_shape, strict=False))
    other_mesh = init_device_mesh("cpu", (1, world))
    value = distribute_tensor(torch.zeros(model.get_parameter(key).shape), other_mesh,
                              [Shard(0), Shard(0)])
    out["other_mesh"] = error(lambda: model.load_state_dict({key: value}, strict=False))
    out["shard_dim2"] = error(lambda: fsdp.fully_shard(
        nn.Linear(4, 4), shard_placement_fn=lambda p: Shard(2)))
    tp = nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (world,))
    tp.weight = nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(1)]))
    out["tensor_parallel"] = error(lambda: fsdp.fully_shard(tp))
    scalar = nn.Module()
    scalar.scale = nn.Parameter(torch.tensor(1.0))
    out["scalar"] = error(lambda: fsdp.fully_shard(scalar))
    cast = _shard_llama("ours")
    M.lm_loss(cast, _batch(0, rank, world))  # the runtime is built in float32
    cast.to(torch.float64)
    out["cast_after"] = error(lambda: M.lm_loss(cast, _batch(0, rank, world)))
    out["post_optim_event"] = error(lambda: model.set_post_optim_event(object()))
    uneven = nn.Sequential(nn.Linear(4, 4))
    uneven.register_buffer("table", torch.zeros(2 + rank))  # differs by rank
    fsdp.fully_shard(uneven)
    out["rank_dependent_buffer"] = error(lambda: uneven(torch.zeros(1, 4)))
    twice = nn.Linear(2, 2)
    fsdp.fully_shard(twice)
    twice_error = caught(lambda: fsdp.fully_shard(twice))
    out["twice"] = described(twice_error)
    out["twice_is_assertion"] = isinstance(twice_error, AssertionError)
    import copy

    deepcopy_error = caught(lambda: copy.deepcopy(twice))
    out["deepcopy"] = described(deepcopy_error)
    out["deepcopy_is_assertion"] = isinstance(deepcopy_error, AssertionError)
    nested = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for layer in nested:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(nested)
    states = [fsdp.fully_shard.state(m) for m in (nested, *nested)]
    out["distinct_states"] = len(set(states))
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).to(torch.bfloat16))
    out["mixed_dtypes"] = error(lambda: fsdp.fully_shard(mixed))
    stranger = nn.Parameter(torch.zeros(3))
    out["ignored_not_in_module"] = error(lambda: fsdp.fully_shard(nn.Linear(2, 2),
                                                                  ignored_params={stranger}))
    return out


# -- the world ------------------------------------------------------------------------------------


def _both(fn, *args, **kwargs):
    @fsdp2_case
    def run(rank, world):
        out = {}
        for which in WHICH:
            torch.manual_seed(0)
            out[which] = fn(which, rank, world, *args, **kwargs)
            dist.barrier()
        return out
    return run


def _dcp(rank, world, directory):
    out = {"written": _both(dcp_round_trip, directory)(rank, world)}
    out["read"] = _both(dcp_cross, directory)(rank, world)
    return out


def cases(directory):
    bf16 = dict(mp_policy=_bf16_policy())
    return {
        "surface": _both(dtensor_surface),
        **{f"train_{kind}": _both(training, optimizer=kind)
           for kind in ("adamw_foreach", "adamw_single", "adam", "sgd_foreach", "sgd_single")},
        "train_bf16": _both(training, **bf16),
        "total_norm": _both(total_norm_functions),
        "reference_norms": reference_norms,
        "state_dict_cost": _both(state_dict_cost),
        "loading": _both(loading),
        "meta_recipe": _both(meta_recipe),
        "layers_only": _both(layers_only),
        "encoder_decoder": _both(encoder_decoder),
        "sub_container_optimizer": _both(sub_container_optimizer),
        "dcp": lambda rank, world: _dcp(rank, world, directory),
        **{f"tutorial_{mode}": _both(tutorial, directory, mode)
           for mode in ("default", "explicit_prefetching", "mixed_precision", "dcp_api")},
        "torchtune": _both(torchtune_round_trip),
        "torchtitan": _both(torchtitan_parallelize),
        "bad_inputs": bad_inputs,
    }


def _bf16_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def run_cases(rank, world, directory, names=None):
    return run_case_table(cases(directory), names)
