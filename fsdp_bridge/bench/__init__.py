"""`fsdp-bridge bench`: native torch FSDP1, native torch FSDP2 and our engine (through the YaFSDP
and fully_shard front-ends), wrapping the same units of a tiny Llama, timed on CPU ranks over
gloo; `--sweep` repeats it at three model sizes, `--device cuda` runs a 1B Llama on GPUs.

- `cli`       the options, and which bench they run
- `options`   the options checked, each device's defaults for those left unset
- `models`    the configurations: the tiny Llama wrapped each way, its data, one step
- `probes`    the heap in use (glibc mallinfo2) and the collective counter
- `schedule`  the CPU bench's program on each rank, run in a spawned world
- `report`    figures, targets, the printed report, `--json`
- `sweep`     `--sweep`: the CPU bench at several sizes, its table and plot
- `cuda`      `--device cuda`: its own schedule, memory measure, profile and report

How the CPU bench measures, and why:
- One spawned world runs everything. The machine is shared and noisy, so the configurations
  are interleaved step by step: a repeat builds fresh models of all three configs, warms each
  up, then runs rounds of one step of each, the order rotating from round to round so that none
  always runs first or last. Every config thus sees the same load from other users.
- A step is forward + backward + AdamW step + zero_grad. Ranks meet at a barrier before each
  step (not timed); a step's time is the slowest rank's. The median is over every timed step of
  every repeat. The paired ratio is the median, over rounds, of ours / native in the same round
  (robust to load that changes between rounds).
- Memory and collectives come from one extra, untimed step per (dtype, config), after a
  warm-up step that creates the optimizer state:
  * memory: torch's CPU tensors are malloc'd, so glibc's `mallinfo2` (bytes in use, over all
    threads, gloo's included) counts every tensor the rank holds: parameters, optimizer state,
    gradients, activations, gather buffers. It is sampled before and after every op of the
    step; "peak" is the highest sample and "start" the value as the step begins, both minus
    the heap in use before the model was built. (torch.profiler's memory events were tried
    first; they miss frees made on gloo's threads, so they drifted by several MiB.) Missed:
    scratch memory inside a single op, and non-glibc platforms (reported as 0).
  * collectives: a TorchDispatchMode counts every op of the `c10d` and `_c10d_functional`
    namespaces (what `torch.distributed` calls and FSDP2's functional collectives become), so
    all three configs are counted by the same code. Bytes are those of the full tensor: the
    gathered output of an all-gather, the input of a reduce-scatter, the tensor of an
    all-reduce, and what an all-to-all sends plus what it receives (the engine's pairs swap
    halves with one; see `fsdp_bridge.engine.comm`). Ours is cross-checked against the
    engine's own counter.

Importing the package imports no torch: the command's `--help` stays fast.
"""

from fsdp_bridge.bench.cli import add_arguments, run
from fsdp_bridge.bench.models import CONFIGS, build_llama, llama_config
from fsdp_bridge.bench.options import settings
from fsdp_bridge.bench.probes import collective_bytes, heap_in_use, step_probe, wrap_peak
from fsdp_bridge.bench.report import format_report, summarize

__all__ = ["CONFIGS", "add_arguments", "build_llama", "collective_bytes", "format_report",
           "heap_in_use", "llama_config", "run", "settings", "step_probe", "summarize",
           "wrap_peak"]
