"""Every ordered pair (inner wrapper, outer wrapper) of the sharding dialects in one model, run
in one CPU/gloo world of two ranks (see test_mixed_dialects.py): the blocks wrapped by the inner
one, the root by the outer one, then three training steps. Each case records where it stopped
on this rank (the wrap, the first forward, or the end of training) and what it raised."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.native_torch import fsdp2_unavailable
from tests.world import run_case_table

STEPS = 3

OURS_FSDP1 = "fsdp_bridge.fsdp.FullyShardedDataParallel"
OURS_FULLY_SHARD = "fsdp_bridge.fsdp.fully_shard"
TORCH_FSDP1 = "torch.distributed.fsdp.FullyShardedDataParallel"
TORCH_FULLY_SHARD = "torch.distributed.fsdp.fully_shard"
YAFSDP = "fsdp_bridge.ya_fsdp.YaFSDP"
ZETA = "fsdp_bridge.zeta.fsdp"
TORCHACC = "fsdp_bridge.torchacc.accelerate"
OURS = (OURS_FSDP1, OURS_FULLY_SHARD, YAFSDP, ZETA, TORCHACC)
FLAT_LAYOUT = (OURS_FSDP1, YAFSDP, ZETA, TORCHACC)
TORCH = (TORCH_FSDP1, TORCH_FULLY_SHARD)
DIALECTS = OURS + TORCH


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class OddBlock(Block):
    """63 elements: its flat shards differ in size between the two ranks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 7)

    def forward(self, x):
        return torch.relu(torch.cat([self.lin(x), x[:, :1]], dim=1))


class Net(nn.Module):
    def __init__(self, block=Block):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([block(), block()])
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def wrap(dialect: str, module: nn.Module, use_orig_params: bool = False,
         policy=None) -> nn.Module:
    """`module` wrapped by `dialect` with its defaults (the wrapper, or the module itself for
    the in-place fully_shard). Zeta and TorchAcc default to replication (NO_SHARD). `policy`:
    torch FSDP1's auto_wrap_policy."""
    if dialect == OURS_FSDP1:
        from fsdp_bridge.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(module)
    if dialect == OURS_FULLY_SHARD:
        from fsdp_bridge.fsdp import fully_shard
        return fully_shard(module)
    if dialect == YAFSDP:
        from fsdp_bridge.ya_fsdp import YaFSDP
        return YaFSDP(module, zero_stage=3)
    if dialect == ZETA:
        from fsdp_bridge.zeta import fsdp
        return fsdp(module)
    if dialect == TORCHACC:
        from fsdp_bridge.torchacc import accelerate
        return accelerate(module)
    if dialect == TORCH_FSDP1:
        from torch.distributed.fsdp import FullyShardedDataParallel
        return FullyShardedDataParallel(module, device_id=torch.device("cpu"),
                                        use_orig_params=use_orig_params,
                                        auto_wrap_policy=policy)
    from torch.distributed.fsdp import fully_shard
    return fully_shard(module)


def _stopped(phase: str, error: Exception) -> dict:
    return {"phase": phase, "type": type(error).__name__, "message": str(error)}


def run_pair(inner: str, outer: str, use_orig_params: bool = False, block=Block,
             policy=None, compiled=None) -> dict:
    """Wrap the blocks with `inner` and the root with `outer` (with `policy` as torch FSDP1's
    auto_wrap_policy), then train STEPS steps (each rank its own data) under `compiled` (see
    `_compiled`). Returns where it stopped, or the losses and the full final weights."""
    if TORCH_FULLY_SHARD in (inner, outer) and fsdp2_unavailable():
        return {"unavailable": fsdp2_unavailable()}
    torch.manual_seed(0)
    net = Net(block)
    try:
        for index, block in enumerate(net.blocks):
            net.blocks[index] = wrap(inner, block, use_orig_params)
        model = wrap(outer, net, use_orig_params, policy)
    except Exception as error:  # noqa: BLE001 - the outcome under test
        return _stopped("wrap", error)
    return _train(model, _compiled(model, net, compiled))


def _compiled(model: nn.Module, net: Net, how):
    """What the training loop calls: `model` itself (None), `torch.compile(model)` ("whole"),
    or `model` with each of `net`'s blocks compiled in place ("blocks"). aot_eager: Dynamo
    and AOTAutograd without code generation, fast on the CPU."""
    if how is None:
        return model
    torch._dynamo.reset()  # a fresh compile per case, never the cache of an earlier model's
    if how == "whole":
        return torch.compile(model, backend="aot_eager")
    for block in net.blocks:
        block.compile(backend="aot_eager")
    return model


def _train(model: nn.Module, run) -> dict:
    """STEPS SGD steps of `model`, its forward called through `run`; where it stopped, or the
    losses and the full final weights."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for step in range(STEPS):
        try:
            loss = run(torch.randn(4, 8, generator=data)).pow(2).mean()
        except Exception as error:  # noqa: BLE001 - the outcome under test
            return _stopped("forward" if step == 0 else f"forward {step}", error)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"phase": "trained", "losses": losses, "weights": _full_weights(model)}


def _full_weights(model: nn.Module) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: value.detach().clone() for name, value in state.items()}


def forward_inside_summon() -> dict:
    """Our FSDP1 model run inside `summon_full_params` (generation under summon, as RLHF code
    does): the full parameters summon puts in place are the model's own, not a takeover."""
    from fsdp_bridge.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = wrap(OURS_FSDP1, Net())
    x = torch.randn(4, 8)
    plain = model(x).detach()
    with torch.no_grad(), FullyShardedDataParallel.summon_full_params(model):
        summoned = model(x)
    return {"equal": torch.equal(plain, summoned)}


def parameter_assigned_after_wrap(compiled=None) -> dict:
    """A parameter assigned to a module after our FSDP1 wrapped it: the engine would go on with
    its own shards (the new parameter never trained), so the forward refuses it too."""
    torch.manual_seed(0)
    net = Net()
    model = wrap(OURS_FSDP1, net)
    net.head.weight = nn.Parameter(torch.zeros(8, 8))
    if compiled is None:
        return _first_forward(model)
    return _train(model, _compiled(model, net, compiled))


def wrapper_added_after_fully_shard(compiled=None) -> dict:
    """A torch FSDP1 module put into the model after our fully_shard calls, before the first
    forward: refused when the forward builds the sharding, on every rank."""
    from fsdp_bridge.fsdp import fully_shard

    torch.manual_seed(0)
    net = Net()
    fully_shard(net)
    net.blocks[1] = wrap(TORCH_FSDP1, Block())
    if compiled is None:
        return _first_forward(net)
    return _train(net, _compiled(net, net, compiled))


def _first_forward(model: nn.Module) -> dict:
    try:
        model(torch.randn(4, 8))
    except (RuntimeError, ValueError) as error:
        return _stopped("forward", error)
    return {"phase": "ran"}


def inner_wrapped_after_outer() -> dict:
    """Our FSDP1 on the root first, then our fully_shard on a block inside it: refused at the
    fully_shard call, naming both (not "this module's model has already run")."""
    torch.manual_seed(0)
    net = Net()
    wrap(OURS_FSDP1, net)
    try:
        wrap(OURS_FULLY_SHARD, net.blocks[0])
    except ValueError as error:
        return _stopped("wrap", error)
    return {"phase": "wrapped"}


def case_name(inner: str, outer: str) -> str:
    return f"{inner} in {outer}"


def _block_policy():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return ModuleWrapPolicy({Block})


def auto_wrapped_in_torch_fsdp1(inner: str) -> str:
    return f"odd-sized {inner} blocks in torch FSDP1 with an auto-wrap policy"


def odd_in_torch_fsdp1(inner: str, use_orig_params: bool) -> str:
    return f"odd-sized {inner} blocks in torch FSDP1, use_orig_params={use_orig_params}"


def cases() -> dict:
    table = {}
    for inner in DIALECTS:
        for outer in DIALECTS:
            table[case_name(inner, outer)] = (
                lambda rank, world, inner=inner, outer=outer: run_pair(inner, outer))
    table["use_orig_params=True"] = lambda rank, world: run_pair(OURS_FSDP1, TORCH_FSDP1, True)
    table["odd-sized blocks in fully_shard"] = (
        lambda rank, world: run_pair(OURS_FSDP1, TORCH_FULLY_SHARD, block=OddBlock))
    # Under torch's FSDP1 (with either use_orig_params): our pieces differ in size between
    # ranks, which torch's first gather could not complete if it took them in (and it cannot
    # flatten fully_shard's DTensors at all).
    for inner in FLAT_LAYOUT + (OURS_FULLY_SHARD,):
        for orig in (False, True):
            table[odd_in_torch_fsdp1(inner, orig)] = (
                lambda rank, world, inner=inner, orig=orig: run_pair(
                    inner, TORCH_FSDP1, orig, block=OddBlock))
    # torch's FSDP1 with an auto-wrap policy also wraps the blocks inside ours.
    for inner in FLAT_LAYOUT + (OURS_FULLY_SHARD,):
        table[auto_wrapped_in_torch_fsdp1(inner)] = (
            lambda rank, world, inner=inner: run_pair(inner, TORCH_FSDP1, block=OddBlock,
                                                      policy=_block_policy()))
    for case in (forward_inside_summon, parameter_assigned_after_wrap,
                 wrapper_added_after_fully_shard, inner_wrapped_after_outer):
        table[case.__name__] = lambda rank, world, case=case: case()
    # The same refusals when torch.compile runs the model: the whole model compiled, or each
    # block compiled in place.
    for how in COMPILED:
        for inner, outer in COMPILED_PAIRS:
            table[compiled_name(case_name(inner, outer), how)] = (
                lambda rank, world, inner=inner, outer=outer, how=how: run_pair(
                    inner, outer, compiled=how))
        for case in (parameter_assigned_after_wrap, wrapper_added_after_fully_shard):
            table[compiled_name(case.__name__, how)] = (
                lambda rank, world, case=case, how=how: case(how))
    return table


COMPILED = ("whole", "blocks")
# Our flat-layout wrappers under torch's root wrappers (YaFSDP's forward has a check of its
# own), and our fully_shard under torch's FSDP1.
COMPILED_PAIRS = ((OURS_FSDP1, TORCH_FULLY_SHARD), (OURS_FSDP1, TORCH_FSDP1),
                  (YAFSDP, TORCH_FULLY_SHARD), (OURS_FULLY_SHARD, TORCH_FSDP1))


def compiled_name(name: str, how: str) -> str:
    return f"{name}, compiled ({how})"


def run_cases(rank, world, names=None):
    return run_case_table(cases(), names)
