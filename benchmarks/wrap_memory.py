"""Memory a rank gains while a model built on meta is wrapped: native FSDP1, our FSDP1 and our
YaFSDP side by side, under whatever malloc settings the shell has (glibc's defaults unless
`MALLOC_*` variables are set; the line before the table says which).

The model: BLOCKS residual MLP blocks of WIDTH (64 x 8 MiB = 512 MiB of fp32 weights by
default), every block a unit, `param_init_fn` giving each module storage and its own
`reset_parameters()` (the llama-recipes pattern), at world 2 on gloo. Each (round, config) is a
fresh spawned world, the configs in turn within a round, so all three see the same load. Two
figures per rank, the larger rank's reported:

  heap: glibc's bytes in use (mallinfo2), the highest sample around every op of the wrap, above
        the value before it (what `fsdp-bridge bench` calls init);
  rss:  the resident set's high-water mark (VmHWM, reset just before the wrap) above the
        resident set before it: what the kernel sees, freed memory glibc keeps included.

    .venv/bin/python benchmarks/wrap_memory.py [--rounds 3] [--blocks 64] [--width 1024]

Prints every round, then per config the median and range over rounds, and ours / native on
the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

CONFIGS = ("native", "fsdp1", "yafsdp")


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _blocks(count: int, width: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(width, width)
            self.down = nn.Linear(width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    with torch.device("meta"):
        return nn.Sequential(*[Block() for _ in range(count)]), Block


def _init(module) -> None:
    import torch
    from torch import nn

    module.to_empty(device=torch.device("cpu"), recurse=False)
    if isinstance(module, nn.Linear):
        module.reset_parameters()


def _wrap(config: str, model, block):
    import torch

    if config == "yafsdp":
        from fsdp_bridge.ya_fsdp import YaFSDP

        return YaFSDP(model, zero_stage=3, param_init_fn=_init,
                      modules_to_wrap_with_names=[(b, str(i)) for i, b in enumerate(model)])
    if config == "native":
        from torch.distributed.fsdp import FullyShardedDataParallel
    else:
        from fsdp_bridge.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}),
                                    device_id=torch.device("cpu"), use_orig_params=True,
                                    param_init_fn=_init)


def rank_program(rank: int, world: int, config: str, blocks: int, width: int) -> dict:
    import gc
    import warnings

    from fsdp_bridge.bench import wrap_peak

    warnings.filterwarnings("ignore")
    small, block = _blocks(1, width)  # first-use allocations are nobody's wrap
    _wrap(config, small, block)
    del small
    model, block = _blocks(blocks, width)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident set
    rss_before = _status("VmRSS")
    heap, wrapped = wrap_peak(lambda: _wrap(config, model, block))
    return {"heap": heap, "rss": _status("VmHWM") - rss_before}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fsdp_bridge.harness.world import RankSetup, spawn

    model_mib = args.blocks * 2 * (args.width * args.width + args.width) * 4 / 2**20
    tuned = sorted(name for name in os.environ if name.startswith("MALLOC_"))
    print(f"{model_mib:.0f} MiB fp32 model on meta, world 2; malloc: "
          + (", ".join(f"{n}={os.environ[n]}" for n in tuned) if tuned else "glibc defaults"))
    figures: dict[str, dict[str, list[float]]] = {c: {"heap": [], "rss": []} for c in CONFIGS}
    for round_index in range(args.rounds):
        for config in CONFIGS:
            ranks = spawn(rank_program, 2, (config, args.blocks, args.width), RankSetup())
            for what in ("heap", "rss"):
                figures[config][what].append(max(r[what] for r in ranks) / 2**20)
            print(f"round {round_index + 1} {config:7s} heap {figures[config]['heap'][-1]:7.1f}"
                  f" MiB  rss {figures[config]['rss'][-1]:7.1f} MiB", flush=True)
    print(f"{'config':8s}{'heap MiB median (range)':>28s}{'rss MiB median (range)':>28s}")
    medians = {c: {w: statistics.median(v) for w, v in f.items()} for c, f in figures.items()}
    for config in CONFIGS:
        cells = [f"{medians[config][w]:8.1f} ({min(v):.0f}-{max(v):.0f})"
                 for w, v in figures[config].items()]
        print(f"{config:8s}{cells[0]:>28s}{cells[1]:>28s}")
    for config in ("fsdp1", "yafsdp"):
        print(f"{config}/native: heap {medians[config]['heap'] / medians['native']['heap']:.2f}, "
              f"rss {medians[config]['rss'] / medians['native']['rss']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
