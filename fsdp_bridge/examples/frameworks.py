"""What the three framework examples share: the tiny Llama, its random token data, the command
line, and how each framework is set to FSDP on a machine without a GPU.

Each example (`hf_trainer_llama`, `accelerate_llama`, `lightning_llama`) has a native twin
(`*_native.py`) that differs from it in one import line; `fsdp-bridge compare-scripts` runs the
two and compares them step by step.

[Note: FSDP on a CPU-only machine]
On a GPU the frameworks take their FSDP path as configured and nothing here changes them. On a
CPU-only machine the native ones do not: accelerate (and so the HF Trainer) silently falls back
to multi-CPU data parallelism without FSDP, and Lightning refuses its FSDP strategy and hands
torch's FSDP1 no device. fsdp_bridge's Accelerator, Trainer and Lightning strategy shard on the
CPU as they are (see fsdp_bridge.integrations.accelerate, [Note: FSDP on the CPU]). So that the
native twins shard on the CPU too, for the comparison, `on_this_machine` and `fsdp_accelerator`
set accelerate's shared state to FSDP with the plugin as ours does, and give Lightning's own
FSDPStrategy the CPU as its device. Only the frameworks' objects are touched, never torch; our
classes are passed through untouched.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

VOCAB, SEQ, PER_DEVICE = 128, 16, 4
SAVE_STEP = 2  # an --out run saves its checkpoint after this optimizer step
PROMPT, NEW_TOKENS = [1, 2, 3, 4], 4
LLAMA_LAYER = "LlamaDecoderLayer"


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument("--out", default=None,
                        help=f"save a checkpoint in this folder after step {SAVE_STEP}")
    parser.add_argument("--resume", default=None, metavar="CHECKPOINT",
                        help="resume from the checkpoint an --out run saved, training on to "
                             "--steps")
    parser.add_argument("--generate", action="store_true",
                        help="after training, generate a few tokens greedily and print them")
    args = parser.parse_args()
    if args.resume and not os.path.exists(args.resume):
        parser.error(f"--resume {args.resume!r} does not exist; pass the checkpoint an earlier "
                     "run saved with --out")
    return args


def require_torchrun(script: str) -> None:
    if "RANK" not in os.environ:
        sys.exit(f"{os.path.basename(script)}: run it under torchrun, one process per rank, "
                 f"e.g. torchrun --nproc_per_node 2 {script}")


def world_size() -> int:
    return int(os.environ["WORLD_SIZE"])


def tiny_llama():
    """A 2-layer Llama with random weights, the same on every rank."""
    from fsdp_bridge.tiny import build_llama, llama_config

    config = llama_config(vocab=VOCAB, hidden=64, intermediate=128, layers=2, heads=4,
                          kv_heads=2, positions=64)
    return build_llama(config, seed=0, device="cpu")


def token_rows(steps: int) -> torch.Tensor:
    """`steps` global batches of random tokens, one row per sample, in order: a sampler that
    does not shuffle gives each rank its slice of every global batch."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (steps * PER_DEVICE * world_size(), SEQ), generator=generator)


def global_mean(value: torch.Tensor) -> float:
    """The mean of a per-rank value over the ranks (every rank must call it)."""
    import torch.distributed as dist

    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def on_this_machine(cls):
    """`cls` (an HF Trainer or Lightning FSDPStrategy class) as it runs FSDP here: itself on a
    GPU, or when it is fsdp_bridge's; a native one on a CPU-only machine, a subclass set to FSDP
    (see [Note: FSDP on a CPU-only machine])."""
    if torch.cuda.is_available() or _ours(cls):
        return cls
    if _is_subclass(cls, "transformers", "Trainer"):
        return _trainer_on_cpu(cls)
    if _is_subclass(cls, "lightning.pytorch.strategies", "FSDPStrategy"):
        return _lightning_strategy_on_cpu(cls)
    return cls


def _ours(cls) -> bool:
    return cls.__module__.startswith("fsdp_bridge.")


def _is_subclass(cls, module: str, name: str) -> bool:
    import importlib

    return issubclass(cls, getattr(importlib.import_module(module), name))


def fsdp_plugin():
    from accelerate import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=[LLAMA_LAYER])


def fsdp_accelerator(accelerator_class, mixed_precision: str):
    """`accelerator_class` with an FSDP2 plugin wrapping each Llama layer, built as a user
    builds it (fsdp_bridge's shards on a CPU-only machine as it is); a native one on a CPU-only
    machine is told `cpu=True` and set to FSDP (see [Note: FSDP on a CPU-only machine])."""
    plugin = fsdp_plugin()
    if torch.cuda.is_available() or _ours(accelerator_class):
        return accelerator_class(fsdp_plugin=plugin, mixed_precision=mixed_precision)
    from fsdp_bridge.integrations.accelerate import shard_on_cpu

    accelerator = accelerator_class(fsdp_plugin=plugin, mixed_precision=mixed_precision,
                                    cpu=True)
    shard_on_cpu(accelerator, plugin)
    return accelerator


def _trainer_on_cpu(trainer_class):
    from accelerate import FullyShardedDataParallelPlugin

    from fsdp_bridge.integrations.accelerate import shard_on_cpu

    class TrainerOnCpuFsdp(trainer_class):
        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            shard_on_cpu(self.accelerator,
                         FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    return TrainerOnCpuFsdp


def _lightning_strategy_on_cpu(strategy_class):
    from lightning.pytorch.strategies import FSDPStrategy

    if strategy_class is not FSDPStrategy:  # another subclass: left as it is
        return strategy_class

    class FSDPStrategyOnCpu(FSDPStrategy):
        """Lightning's refusal of FSDP on the CPU checks this exact class; torch's FSDP1 gets
        the CPU as its device (Lightning passes the device index, None on the CPU)."""

        def _setup_model(self, model):
            from lightning.fabric.strategies.fsdp import _setup_activation_checkpointing
            from torch.distributed.fsdp import FullyShardedDataParallel

            model = FullyShardedDataParallel(
                module=model, cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy, device_id=torch.device("cpu"),
                **self.kwargs)
            _setup_activation_checkpointing(model, self._activation_checkpointing_kwargs)
            return model

    return FSDPStrategyOnCpu


def prompt(device) -> torch.Tensor:
    return torch.tensor([PROMPT], device=device)


def generate(model, ids: torch.Tensor) -> torch.Tensor:
    """Greedy generation of NEW_TOKENS tokens after `ids`. Every rank must call it: a sharded
    model gathers its parameters in each forward."""
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def print_generated(tokens: torch.Tensor, model: torch.nn.Module) -> None:
    """Rank 0 prints the tokens generated after PROMPT and the devices of the model's (local)
    parameters: `generated [a, b, ...] parameters on ['cuda:0']`."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        devices = sorted({str(parameter.device) for parameter in model.parameters()})
        print(f"generated {tokens[0, len(PROMPT):].tolist()} parameters on {devices}", flush=True)


class Progress:
    """The number of optimizer steps taken, saved and restored with a checkpoint (accelerate's
    `register_for_checkpointing` takes any object with `state_dict` / `load_state_dict`)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
