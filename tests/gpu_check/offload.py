"""`python -m tests.gpu_check.offload --json FILE [--smoke]`: what CPU offload saves on the device.

One rank (NCCL on CUDA; gloo on the CPU under `--smoke`, where nothing is measured on a device)
trains the same seeded Llama twice through the FSDP1 front-end, one unit per decoder layer:
without offload, and with `CPUOffload(offload_params=True)` (fp32 master shards, their
gradients and the optimizer state in pinned host memory). For each it records the device bytes
held once wrapped (the parameters), at the end of the steps (parameters, gradients, optimizer
state) and at the peak of the steps, and the losses. The losses are reported as they are, with
their largest difference: whether offload trains correctly is judged by tests/test_gpu.py.
"""

from __future__ import annotations

import argparse
import gc
import json

# An fp32 Llama of 187M parameters (0.7 GiB of weights): large enough that the
# figures are in GiB, small enough that the host-side AdamW steps take seconds.
GPU_SIZES = dict(vocab=32000, hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=4096,
                 seq=512, batch=2, steps=3)
SMOKE_SIZES = dict(vocab=128, hidden=32, layers=2, heads=2, kv_heads=2, intermediate=64, seq=16,
                   batch=2, steps=2)


def _config(sizes: dict):
    from fsdp_bridge import tiny

    return tiny.llama_config(vocab=sizes["vocab"], hidden=sizes["hidden"], layers=sizes["layers"],
                             heads=sizes["heads"], kv_heads=sizes["kv_heads"],
                             intermediate=sizes["intermediate"], positions=sizes["seq"])


def _device_bytes(kind: str, torch) -> dict:
    if not torch.cuda.is_available() or kind != "cuda":
        return {}
    return {"allocated": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated()}


def _train(offload: bool, sizes: dict) -> dict:
    import torch
    from torch.distributed.fsdp import CPUOffload
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_bridge import tiny
    from fsdp_bridge.fsdp import FullyShardedDataParallel
    from tests.world import device

    kind = device().type
    gc.collect()
    if kind == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = _device_bytes(kind, torch)
    model = FullyShardedDataParallel(
        tiny.build_llama(_config(sizes), seed=0, device="cpu"), device_id=device(), use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        cpu_offload=CPUOffload(offload_params=True) if offload else None)
    wrapped = _device_bytes(kind, torch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(sizes["steps"]):
        ids = torch.randint(0, sizes["vocab"], (sizes["batch"], sizes["seq"]), generator=generator)
        loss = model(input_ids=ids.to(device()), labels=ids.to(device())).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    after = _device_bytes(kind, torch)
    del model, optimizer
    gc.collect()
    return {"losses": losses, **_held(before, wrapped, after)}


def _held(before: dict, wrapped: dict, after: dict) -> dict:
    """Device bytes above what was allocated before the model was built (None off CUDA)."""
    if not before:
        return {"device_gib_after_wrap": None, "device_gib_after_steps": None,
                "device_gib_peak": None}
    gib = 2**30
    return {"device_gib_after_wrap": (wrapped["allocated"] - before["allocated"]) / gib,
            "device_gib_after_steps": (after["allocated"] - before["allocated"]) / gib,
            "device_gib_peak": (after["peak"] - before["allocated"]) / gib}


def offload_rank(rank: int, world: int, sizes: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")  # the FSDP1 front-end's notes on what it translated
    return {"full": _train(False, sizes), "offload": _train(True, sizes)}


def figures(sizes: dict) -> dict:
    from fsdp_bridge import tiny
    from tests.world import device_type, run_world

    result = run_world(offload_rank, 1, sizes)[0]
    full, offload = result["full"]["losses"], result["offload"]["losses"]
    return {"device": device_type(), "sizes": sizes, "parameters": tiny.parameter_count(_config(sizes)),
            **result, "losses_equal": full == offload,
            "largest_loss_difference": max(abs(a - b) for a, b in zip(full, offload))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_check.offload")
    parser.add_argument("--json", required=True, help="where to write the figures")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (on the CPU)")
    args = parser.parse_args(argv)
    result = figures(SMOKE_SIZES if args.smoke else GPU_SIZES)
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
