"""Run one function on every rank of a real torch.distributed world (spawned by
`fsdp_bridge.harness.world`, the package's one spawner), on the test device.

The suite runs on CPU + gloo by default, on CUDA + NCCL with `FSDP_BRIDGE_DEVICE=cuda` (see
`device_type`), and on CUDA + gloo with `FSDP_BRIDGE_DEVICE=cuda FSDP_BRIDGE_BACKEND=gloo`: gloo
lets several ranks share one GPU, so a machine with a single GPU still runs multi-rank worlds on
CUDA tensors (the engine's multi-rank CUDA path: real collectives, device copies, streams).
Tests take the device from `device()` wherever they build models or tensors; rank results come
back to the parent on the CPU, so comparisons there never mix devices.

Spawning costs a few seconds, so a test module runs *many cases inside one world*: the rank
function loops over its cases and returns a dict of results; the parent asserts on them.

    results = run_world(my_cases, world_size=2)   # -> [rank0_result, rank1_result]

`fn(rank, world_size, *args)` must be importable (a module-level function). Exceptions on any
rank are re-raised in the parent with that rank's traceback.

On CUDA each rank gets the GPU `rank % device_count`. NCCL refuses two ranks on one GPU, so on
NCCL a world larger than the number of GPUs is not run: its tests are skipped with a reason that
names how many GPUs they need (never run on fewer ranks in disguise). On gloo ranks share GPUs.
"""

from __future__ import annotations

import copy
import os
import traceback

import torch
import torch.distributed as dist

from fsdp_bridge.harness.world import RankSetup, WorldFailed, spawn

DEVICE_VARIABLE = "FSDP_BRIDGE_DEVICE"
DEVICE_TYPES = ("cpu", "cuda")
BACKEND_VARIABLE = "FSDP_BRIDGE_BACKEND"
BACKENDS = ("gloo", "nccl")


def device_type() -> str:
    """"cpu" (the default) or "cuda", from the environment variable FSDP_BRIDGE_DEVICE."""
    value = os.environ.get(DEVICE_VARIABLE, "").strip().lower() or "cpu"
    if value not in DEVICE_TYPES:
        raise ValueError(f"{DEVICE_VARIABLE}={os.environ[DEVICE_VARIABLE]!r} is not a test device: "
                         f"use one of {DEVICE_TYPES} (unset means cpu).")
    return value


def backend() -> str:
    """The process-group backend: FSDP_BRIDGE_BACKEND when set (gloo, or nccl on CUDA), else
    NCCL on CUDA and gloo on CPU."""
    value = os.environ.get(BACKEND_VARIABLE, "").strip().lower()
    if not value:
        return "nccl" if device_type() == "cuda" else "gloo"
    if value not in BACKENDS or (value == "nccl" and device_type() != "cuda"):
        accepted = BACKENDS if device_type() == "cuda" else ("gloo",)
        raise ValueError(f"{BACKEND_VARIABLE}={os.environ[BACKEND_VARIABLE]!r} is not a backend "
                         f"for {DEVICE_VARIABLE}={device_type()}: use one of {accepted} (unset "
                         "means nccl on cuda, gloo on cpu).")
    return value


def device() -> torch.device:
    """Where tests put models and tensors: the CPU, or this process's current CUDA device."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def require_cuda(world_size: int = 1, backend_name: str = "nccl") -> None:
    """Under FSDP_BRIDGE_DEVICE=cuda: fail when there is no CUDA device at all (a misconfigured
    run), skip (by name, with the count needed) when an NCCL world needs more GPUs than there
    are (gloo ranks share GPUs)."""
    if not torch.cuda.is_available():
        raise RuntimeError(f"{DEVICE_VARIABLE}=cuda but torch sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}): "
                           "run on a machine with an NVIDIA GPU and a CUDA build of torch, "
                           f"or unset {DEVICE_VARIABLE} to test on the CPU.")
    found = torch.cuda.device_count()
    if backend_name == "nccl" and world_size > found:
        import pytest

        pytest.skip(f"needs {world_size} CUDA devices (one per NCCL rank), found {found}")


def to_cpu(value):
    """`value` with every tensor in it (nested in dicts, lists, tuples) moved to the CPU, so the
    parent compares CPU tensors whatever the test device (CPU results are returned as they are)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        moved = copy.copy(value)  # keeps the mapping's type (OrderedDict, defaultdict)
        for key, item in value.items():
            moved[key] = to_cpu(item)
        return moved
    if isinstance(value, list):
        return [to_cpu(item) for item in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # namedtuples kept as they are
        return tuple(to_cpu(item) for item in value)
    return value


# What nearly every test world imports: ranks are forked from a server that imported these
# once (see RankSetup.preload), rather than each importing them (3-6 s a rank).
PRELOAD = ("torch", "torch.distributed.fsdp", "fsdp_bridge.fsdp", "tests.world", "tests.models",
           "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2")


def _setup(backend_name: str, fresh_interpreters: bool):
    """How a test rank joins its world: on CUDA with the GPU `rank % device_count` (its own on
    NCCL, shared on gloo), else on the CPU."""
    return RankSetup(backend=backend_name, one_gpu_per_rank=device_type() == "cuda",
                     preload=() if fresh_interpreters else PRELOAD)


def _test_rank(rank, world_size, fn, args):
    value = fn(rank, world_size, *args)
    return to_cpu(value) if device_type() == "cuda" else value


def run_world(fn, world_size: int = 2, *args, timeout: float = 600.0, backend_name=None,
              fresh_interpreters: bool = False):
    """Run `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results.
    `backend_name`: the process-group backend (default: `backend()`). `fresh_interpreters`:
    each rank a new interpreter rather than a fork of the preloaded server, for tests of what
    a process reads when it starts (glibc's malloc settings) or of its memory from the start.
    (`timeout` is accepted for the callers that pass it: a hung rank is ended by the process
    group's own timeout.)"""
    backend_name = backend_name or backend()
    if device_type() == "cuda":
        require_cuda(world_size, backend_name)
    try:
        return spawn(_test_rank, world_size, (fn, args), _setup(backend_name, fresh_interpreters))
    except WorldFailed as failed:
        raise AssertionError("distributed run failed:\n" + "\n".join(failed.errors)) from None


def run_case_table(table: dict, names=None) -> dict:
    """On every rank: run the named cases (all by default) of `table` (name -> fn(rank,
    world)) one after another, each ended by a barrier; a case that raises records
    {"error": traceback} and the world goes on. Warnings are silenced (they are not results)."""
    import warnings

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names or table:
            torch.manual_seed(0)
            try:
                out[name] = table[name](rank, world)
            except Exception:  # noqa: BLE001 - reported per case; the world goes on
                out[name] = {"error": traceback.format_exc()}
            dist.barrier()
    return out


def case_result(results: list, name: str, rank: int = 0):
    """Rank `rank`'s result of case `name` from `run_case_table`; fails the test with the case's
    traceback when the case raised (cases may also return an {"error": message} of their own)."""
    import pytest

    assert name in results[rank], f"case {name} did not run on rank {rank}"
    value = results[rank][name]
    if (isinstance(value, dict) and isinstance(value.get("error"), str)
            and value["error"].startswith("Traceback")):
        pytest.fail(f"case {name} failed on rank {rank}:\n{value['error']}")
    if isinstance(value, dict) and value.get("unavailable"):  # see tests/native_torch.py
        pytest.skip(f"native comparison not run: {value['unavailable']}")
    return value
