"""The test device (tests/world.py): CPU + gloo unless FSDP_BRIDGE_DEVICE=cuda, a clear error for
a bad value or a missing GPU, and rank results brought back to the CPU."""

from __future__ import annotations

import collections

import pytest
import torch

from tests import world as W


def test_cpu_and_gloo_by_default(monkeypatch):
    monkeypatch.delenv(W.DEVICE_VARIABLE, raising=False)
    assert (W.device_type(), W.backend(), W.device()) == ("cpu", "gloo", torch.device("cpu"))
    monkeypatch.setenv(W.DEVICE_VARIABLE, " CPU ")
    assert W.device_type() == "cpu"


def test_cuda_asks_for_nccl(monkeypatch):
    monkeypatch.setenv(W.DEVICE_VARIABLE, "cuda")
    assert (W.device_type(), W.backend()) == ("cuda", "nccl")


def test_a_bad_device_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(W.DEVICE_VARIABLE, "tpu")
    with pytest.raises(ValueError, match=r"FSDP_BRIDGE_DEVICE='tpu'.*'cpu', 'cuda'"):
        W.device_type()
    with pytest.raises(ValueError, match="FSDP_BRIDGE_DEVICE"):
        W.run_world(W.to_cpu, 1)


def test_cuda_without_a_gpu_fails_clearly_and_too_few_gpus_skip_by_name(monkeypatch):
    monkeypatch.setenv(W.DEVICE_VARIABLE, "cuda")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="FSDP_BRIDGE_DEVICE=cuda but torch sees no CUDA"):
            W.run_world(W.to_cpu, 1)
        return
    W.require_cuda(torch.cuda.device_count())  # enough GPUs: nothing raised
    with pytest.raises(pytest.skip.Exception, match=r"needs \d+ CUDA devices"):
        W.require_cuda(torch.cuda.device_count() + 1)


def test_to_cpu_moves_nested_tensors_and_keeps_containers():
    counts = collections.defaultdict(int, a=1)
    value = {"t": torch.ones(2), "list": [torch.zeros(1), 3], "tuple": (torch.ones(1),),
             "counts": counts, "text": "x"}
    moved = W.to_cpu(value)
    assert moved["t"] is value["t"]  # already on the CPU: returned as is
    assert moved["list"][1] == 3 and isinstance(moved["tuple"], tuple)
    assert isinstance(moved["counts"], collections.defaultdict) and moved["counts"]["a"] == 1
    assert moved["text"] == "x"
    if torch.cuda.is_available():
        assert W.to_cpu([torch.ones(1, device="cuda")])[0].device.type == "cpu"


def test_the_fixture_gives_the_test_device(test_device):
    assert test_device == W.device()


def test_the_backend_follows_the_device_unless_named(monkeypatch):
    monkeypatch.delenv(W.DEVICE_VARIABLE, raising=False)
    monkeypatch.setenv(W.BACKEND_VARIABLE, " GLOO ")
    assert W.backend() == "gloo"
    monkeypatch.setenv(W.BACKEND_VARIABLE, "nccl")  # NCCL needs CUDA tensors
    with pytest.raises(ValueError, match=r"FSDP_BRIDGE_BACKEND='nccl'.*FSDP_BRIDGE_DEVICE=cpu.*'gloo'"):
        W.backend()
    monkeypatch.setenv(W.DEVICE_VARIABLE, "cuda")
    assert W.backend() == "nccl"
    monkeypatch.setenv(W.BACKEND_VARIABLE, "gloo")  # ranks share a GPU
    assert W.backend() == "gloo"
    monkeypatch.setenv(W.BACKEND_VARIABLE, "mpi")
    with pytest.raises(ValueError, match=r"FSDP_BRIDGE_BACKEND='mpi'.*'gloo', 'nccl'"):
        W.backend()


def test_gloo_worlds_share_gpus_and_nccl_worlds_do_not(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    W.require_cuda(2, "gloo")  # ranks share the GPU: nothing raised
    with pytest.raises(pytest.skip.Exception, match=r"needs 2 CUDA devices .*found 1"):
        W.require_cuda(2, "nccl")
