"""A model larger than one rank's memory: each rank's data segment is capped (`RLIMIT_DATA`,
set on every rank after a warm-up) below the model's unsharded fp32 weights, and under that cap
the model is built on meta, wrapped, trained 3 steps and checkpointed through FSDP1, YaFSDP and
fully_shard; then read back into a fresh model under the same cap. Its losses and parameter
digest match the same training without a cap at world 2.

Why the capped world has 3 ranks: a training rank holds its shard of the parameters and of their
gradients, 2 x (full model / world). At world 2 that is the whole model's size already, so a cap
below the unsharded weights could only be met at world 3 or more (CPU offload moves the shards
to the host, which on CPU ranks is the same memory). The cap leaves HEADROOM x (unsharded model) above what each
rank holds before building the model; allocating the unsharded model alone fails under it.

The cap counts memory mapped, not memory in use, and glibc keeps freed memory mapped for reuse
once its mmap threshold has grown (measured: 1.3 GiB mapped for 129 MiB in use after 3 steps).
The ranks therefore run with a fixed threshold (`MALLOC_MMAP_THRESHOLD_`): tensors above it are
mapped on allocation and unmapped on free, and what is mapped follows what is held.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.models import Block
from tests.world import device_type, run_world

WIDTH, BLOCKS = 1024, 24
FULL_NUMEL = BLOCKS * 2 * (WIDTH * WIDTH + WIDTH)  # 192 MiB in fp32
HEADROOM = 0.9
CAPPED_WORLD, REFERENCE_WORLD = 3, 2
STEPS, GLOBAL_BATCH = 3, 6  # divisible by both world sizes
FRONTENDS = ("fsdp1", "yafsdp", "fully_shard")
# Against world 2 (fp32 sums over 2 vs 3 ranks, in another order): losses and the sum of squares
# relatively; the plain sum of all elements, which cancels, within RTOL of the sum of their
# magnitudes (bounded by sqrt(numel x sum of squares)).
RTOL = 1e-5
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"


def _meta_model(blocks: int = BLOCKS) -> nn.Sequential:
    with torch.device("meta"):
        return nn.Sequential(*[Block(WIDTH, residual=True) for _ in range(blocks)])


def value_of(name: str, shape) -> torch.Tensor:
    """A parameter's initial value, from its name alone: the same at every world size."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=generator) * 0.02


def _named_init(model: nn.Module):
    """FSDP1 / YaFSDP `param_init_fn`: storage for a module's own tensors, filled by name."""
    names = {id(m): n for n, m in model.named_modules()}

    def init(module: nn.Module) -> None:
        module.to_empty(device=torch.device("cpu"), recurse=False)
        prefix = names[id(module)]
        with torch.no_grad():
            for attr, param in module.named_parameters(recurse=False):
                param.copy_(value_of(f"{prefix}.{attr}" if prefix else attr, param.shape))

    return init


def _wrap(frontend: str, model: nn.Sequential):
    if frontend == "fsdp1":
        from fsdp_bridge.fsdp import FullyShardedDataParallel
        from fsdp_bridge.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                        param_init_fn=_named_init(model))
    if frontend == "yafsdp":
        from fsdp_bridge.ya_fsdp import YaFSDP

        return YaFSDP(model, zero_stage=3, param_init_fn=_named_init(model),
                      modules_to_wrap_with_names=[(b, str(i)) for i, b in enumerate(model)])
    from fsdp_bridge.fsdp import fully_shard

    for block in model:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")  # FSDP2's recipe: shard on meta, then materialise the shards
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, param in model.named_parameters():
            chunk = value_of(name, param.shape).chunk(world)  # Shard(0)'s rows
            if rank < len(chunk):
                param.to_local().copy_(chunk[rank])
    return model


def _train(model) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(STEPS):
        batch = torch.randn(GLOBAL_BATCH, WIDTH, generator=torch.Generator().manual_seed(step))
        rows = batch.chunk(world)[rank]
        loss = model(rows).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def _digest(model) -> tuple[float, float]:
    from fsdp_bridge.harness.digest import global_digest

    digest = global_digest(model.parameters())
    return digest.sum, digest.sumsq


def _vm_data() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status")


def _warm_up(frontend: str) -> None:
    """A small wrap and step first: threads, arenas and gloo's state exist before the cap."""
    model = _wrap(frontend, _meta_model(blocks=2))
    _train(model)


def _capped(headroom: int):
    import resource

    previous = resource.getrlimit(resource.RLIMIT_DATA)
    resource.setrlimit(resource.RLIMIT_DATA, (_vm_data() + headroom, previous[1]))
    return previous


def _run(frontend: str, cap: bool, directory: str) -> dict:
    import gc
    import resource

    from fsdp_bridge import checkpoint

    _warm_up(frontend)
    gc.collect()
    out: dict = {}
    previous = _capped(int(HEADROOM * FULL_NUMEL * 4)) if cap else None
    try:
        if cap:
            try:
                torch.empty(FULL_NUMEL)  # the unsharded fp32 weights alone
                out["unsharded_refused"] = None
            except RuntimeError as error:
                out["unsharded_refused"] = str(error).splitlines()[0]
        model = _wrap(frontend, _meta_model())
        out["local_numel"] = sum(p.numel() if not hasattr(p, "to_local") else p.to_local().numel()
                                 for p in model.parameters())
        out["losses"] = _train(model)
        out["digest"] = _digest(model)
        path = os.path.join(directory, f"{frontend}-{dist.get_world_size()}")
        checkpoint.save_state(path, model)
        del model
        gc.collect()
        fresh = _wrap(frontend, _meta_model())
        checkpoint.load_state(path, fresh)
        out["loaded_digest"] = _digest(fresh)
    finally:
        if previous is not None:
            resource.setrlimit(resource.RLIMIT_DATA, previous)
    return out


def _world(rank, world, cap: bool, directory: str) -> dict:
    return {frontend: _run(frontend, cap, directory) for frontend in FRONTENDS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if device_type() != "cpu":
        pytest.skip("the cap is a CPU process limit; on CUDA the device memory is the bound")
    directory = str(tmp_path_factory.mktemp("capped"))
    previous = os.environ.get(MMAP_THRESHOLD)
    os.environ[MMAP_THRESHOLD] = "65536"  # read by glibc in each spawned rank
    try:
        capped = run_world(_world, CAPPED_WORLD, True, directory, fresh_interpreters=True)
    finally:
        if previous is None:
            os.environ.pop(MMAP_THRESHOLD)
        else:
            os.environ[MMAP_THRESHOLD] = previous
    reference = run_world(_world, REFERENCE_WORLD, False, directory)
    return capped, reference


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_a_model_over_the_cap_trains_and_checkpoints_like_the_uncapped_one(runs, frontend):
    capped, reference = runs
    expected = reference[0][frontend]
    for rank, rank_results in enumerate(capped):
        out = rank_results[frontend]
        assert out["unsharded_refused"] is not None, (
            f"rank {rank}: the unsharded model fits under the cap; the cap proves nothing")
        assert "can't allocate memory" in out["unsharded_refused"], out["unsharded_refused"]
        assert out["local_numel"] <= -(-FULL_NUMEL // CAPPED_WORLD) + WIDTH * 2 * BLOCKS, out
        torch.testing.assert_close(out["losses"], expected["losses"], rtol=RTOL, atol=0)
        (total, squares), (expected_total, expected_squares) = out["digest"], expected["digest"]
        assert abs(squares - expected_squares) <= RTOL * expected_squares, (squares, expected)
        magnitude = (FULL_NUMEL * expected_squares) ** 0.5
        assert abs(total - expected_total) <= RTOL * magnitude, (total, expected)
        assert out["loaded_digest"] == out["digest"], out
