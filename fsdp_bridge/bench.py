"""`fsdp-bridge bench`: native torch FSDP1, native torch FSDP2 and our engine (through the YaFSDP
front-end), wrapping the same units of a tiny Llama, timed on CPU ranks over gloo.

How it measures, and why:
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
    all-reduce. Ours is cross-checked against the engine's own counter.
"""

from __future__ import annotations

import ctypes
import datetime
import functools
import gc
import json
import os
import statistics
import tempfile
import time
import traceback

HELP = ("time native FSDP1, FSDP2 and our engine (YaFSDP and fully_shard front-ends) on a "
        "tiny Llama (CPU ranks, gloo), or on a 1B Llama on CUDA (--device cuda)")
# "ours": our engine through the YaFSDP front-end (flat shards); "ours2": through
# fsdp_bridge.fsdp.fully_shard (DTensor parameters sharded by rows, one copy after each gather);
# "plain": the compute-only baseline, each rank's whole model on its own batch, no communication.
CONFIGS = ("fsdp1", "fsdp2", "ours", "ours2", "plain")
DTYPES = ("fp32", "bf16")
# The speed target: ours at most this fraction of the faster native step time.
SPEEDUP_TARGET = 0.85
# The memory target: ours' peak per rank at most this fraction of native FSDP2's.
MEMORY_TARGET = 0.97
# The goal for the cost of sharding: ours at most this multiple of the compute-only step.
COMPUTE_ONLY_GOAL = 1.15
DEFAULT_PLOT = "bench_sweep.png"  # where --sweep draws its plot unless --plot says otherwise
# What an option left unset means on the CPU (--device cuda has its own, in bench_cuda).
CPU_DEFAULTS = dict(dtype="fp32,bf16", nproc=2, hidden=256, layers=4, vocab=1000, seq=128,
                    batch=4, heads=4, kv_heads=None, intermediate=None)


def add_arguments(parser) -> None:
    parser.add_argument("--steps", type=int, default=10,
                        help="timed rounds per repeat, one step of each config (default 10)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps of each config per repeat (default 3)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="repeats, each with freshly built models (default 3)")
    parser.add_argument("--dtype",
                        help="comma-separated param dtypes: fp32, bf16 (default: both on cpu, "
                             "bf16 on cuda)")
    parser.add_argument("--nproc", type=int, help="ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: tiny Llama on gloo ranks (default); cuda: a 1.1B Llama on "
                             "NCCL, one GPU per rank, against the plain unsharded model too")
    parser.add_argument("--sweep", action="store_true",
                        help="cpu only: run the bench at three model sizes (hidden x layers, "
                             "vocab: 256x4 1000, 512x8 4000, 1024x8 8000; --hidden, --layers, "
                             "--vocab and --heads are set per size) and print the ratios per "
                             "size; takes several minutes per size at the default --steps, "
                             "e.g. add --steps 4 --warmup 1 --repeats 1")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="with --sweep: where to draw step time and peak memory against the "
                             "parameter count (default: bench_sweep.png)")
    parser.add_argument("--profile", metavar="DIR",
                        help="cuda only: export a torch.profiler trace of one step of each "
                             "config to DIR and report how much communication overlaps compute")
    model = parser.add_argument_group(
        "model (defaults: on cpu the tiny Llama hidden 256, 4 layers, 4 heads, vocab 1000, seq "
        "128, batch 4; on cuda hidden 2048, 16 layers, 32 heads (8 kv), intermediate 8192, "
        "vocab 32000, seq 2048, batch 2)")
    model.add_argument("--hidden", type=int)
    model.add_argument("--layers", type=int)
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    model.add_argument("--intermediate", type=int, help="MLP width (default: 4 x --hidden)")
    model.add_argument("--vocab", type=int)
    model.add_argument("--seq", type=int)
    model.add_argument("--batch", type=int, help="sequences per rank")


# -- settings -----------------------------------------------------------------------------------


def _option(args, name: str, defaults: dict):
    value = getattr(args, name, None)
    return defaults[name] if value is None else value


def _settings(args, defaults: dict = CPU_DEFAULTS) -> dict:
    """The run's settings: the options given, `defaults` for those left unset; checked."""
    given = {name: _option(args, name, defaults) for name in defaults}
    dtypes = [d.strip() for d in given["dtype"].split(",") if d.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes:
        raise ValueError(f"--dtype {given['dtype']!r}: expected a comma-separated list of {DTYPES}")
    if given["kv_heads"] is None:
        given["kv_heads"] = given["heads"]
    if given["intermediate"] is None:
        given["intermediate"] = 4 * given["hidden"]
    s = dict(steps=args.steps, warmup=args.warmup, repeats=args.repeats, dtypes=dtypes,
             **{k: v for k, v in given.items() if k != "dtype"})
    for name in ("steps", "repeats", "nproc", "hidden", "layers", "heads", "kv_heads",
                 "intermediate", "vocab", "seq", "batch"):
        if s[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} {s[name]}: must be at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup}: must be at least 0")
    if s["hidden"] % s["heads"] or (s["hidden"] // s["heads"]) % 2:
        raise ValueError(f"--hidden {s['hidden']}: must split into {s['heads']} attention heads "
                         "of an even size (for rotary embeddings); change --hidden or --heads")
    if s["heads"] % s["kv_heads"]:
        raise ValueError(f"--kv-heads {s['kv_heads']}: must divide --heads {s['heads']}")
    return s


# -- building each configuration (runs on every rank) -------------------------------------------


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _build_llama(s: dict):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)  # the same weights for every config and rank
    return LlamaForCausalLM(llama_config(s))


def llama_config(s: dict):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], max_position_embeddings=s["seq"],
        tie_word_embeddings=False,
    )


def _wrap_fsdp1(model, dtype):
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    mixed = None
    if dtype != torch.float32:
        mixed = MixedPrecision(param_dtype=dtype, reduce_dtype=torch.float32)
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={LlamaDecoderLayer})
    return FullyShardedDataParallel(
        model, sharding_strategy=ShardingStrategy.FULL_SHARD, auto_wrap_policy=policy,
        mixed_precision=mixed, device_id=_compute_device(),
    )


def _compute_device():
    """This rank's GPU on NCCL (`--device cuda`), else the CPU."""
    import torch
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@functools.lru_cache(maxsize=None)
def _world_mesh():
    """One 1-D mesh over the world, shared by every FSDP2 build (no new process groups)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(_compute_device().type, (dist.get_world_size(),))


def _fully_shard_layers_then_root(fully_shard, model, dtype):
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = _world_mesh()
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _wrap_fsdp2(model, dtype):
    from torch.distributed.fsdp import fully_shard

    return _fully_shard_layers_then_root(fully_shard, model, dtype)


def _wrap_ours(model, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fsdp_bridge.ya_fsdp import YaFSDP

    layers = [(layer, f"model.layers.{i}") for i, layer in enumerate(model.model.layers)]
    return YaFSDP(
        model, zero_stage=3, modules_to_wrap_with_names=layers,
        rogue_layer_norm_modules_with_names={model.model.norm: "model.norm"},
        layer_norm_module_cls=LlamaRMSNorm, param_dtype=dtype, gradient_accumulation_steps=1,
    )


def _wrap_ours_fsdp2(model, dtype):
    from fsdp_bridge.fsdp import fully_shard

    return _fully_shard_layers_then_root(fully_shard, model, dtype)


def _wrap_plain(model, dtype):
    """The compute-only baseline: the unsharded model in the compute dtype (under bf16 its
    parameters are bf16 too: the compute matches, the optimizer is a little cheaper)."""
    return model.to(dtype)


WRAPPERS = {"fsdp1": _wrap_fsdp1, "fsdp2": _wrap_fsdp2, "ours": _wrap_ours,
            "ours2": _wrap_ours_fsdp2, "plain": _wrap_plain}


def _build(config: str, dtype_name: str, s: dict):
    import torch

    model = WRAPPERS[config](_build_llama(s), _torch_dtype(dtype_name))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def _step(model, optimizer, ids) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _batch(s: dict, rank: int):
    import torch

    generator = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    return torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=generator)


# -- timing -------------------------------------------------------------------------------------


def _timed_step(model, optimizer, ids) -> float:
    import torch.distributed as dist

    dist.barrier()  # every rank starts the step together (not timed)
    start = time.perf_counter()
    _step(model, optimizer, ids)
    return time.perf_counter() - start


def _round_order(round_index: int) -> list[str]:
    """The configs in a rotating order, so none always runs first or last."""
    shift = round_index % len(CONFIGS)
    return list(CONFIGS[shift:] + CONFIGS[:shift])


def _timed_repeat(dtype_name: str, s: dict, ids, repeat_index: int) -> dict[str, list[float]]:
    """Fresh models of every config, warmed up, then `steps` rounds of one step of each.

    Interleaving single steps (rather than whole runs) exposes every config to the same load
    from the other users of the machine. Returns each step's time, the slowest rank's."""
    import torch
    import torch.distributed as dist

    runs = {config: _build(config, dtype_name, s) for config in CONFIGS}
    for _ in range(s["warmup"]):
        for config in CONFIGS:
            _step(*runs[config], ids)
    times = {config: [] for config in CONFIGS}
    for round_index in range(s["steps"]):
        for config in _round_order(repeat_index * s["steps"] + round_index):
            times[config].append(_timed_step(*runs[config], ids))
    slowest = torch.tensor([times[config] for config in CONFIGS], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    del runs
    gc.collect()
    return dict(zip(CONFIGS, slowest.tolist()))


# -- collectives and memory ---------------------------------------------------------------------


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def collective_bytes(namespace: str, name: str, args) -> int:
    """Bytes of the full tensor a collective moves (see the module docstring)."""
    if namespace == "c10d":
        # In-place c10d ops take (outputs, inputs, ...): the full side is the larger one.
        return max(_tensor_bytes(args[0]), _tensor_bytes(args[1]) if len(args) > 1 else 0)
    if name.startswith("all_gather"):  # functional: (input, group_size, group_name)
        return _tensor_bytes(args[0]) * int(args[1])
    return _tensor_bytes(args[0])


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.lru_cache(maxsize=None)
def _mallinfo2():
    """glibc's mallinfo2, or None where it does not exist (not glibc, or glibc < 2.33)."""
    try:
        function = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def heap_in_use() -> int:
    """Bytes the process has allocated with malloc and not freed, over all threads (torch's CPU
    tensors are malloc'd), or 0 where glibc's mallinfo2 is unavailable."""
    mallinfo2 = _mallinfo2()
    if mallinfo2 is None:
        return 0
    info = mallinfo2()
    return info.uordblks + info.hblkhd  # heap chunks in use + mmap'd chunks (large tensors)


def _probe_mode():
    """A TorchDispatchMode over one step: counts c10d and functional collectives, and samples
    the heap in use before and after every op (built lazily: it needs torch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class StepProbe(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: dict[str, int] = {}
            self.bytes: dict[str, int] = {}
            self.peak_heap = heap_in_use()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            namespace = func.namespace
            name = func._schema.name.split("::")[-1]
            if namespace == "c10d" or (namespace.endswith("c10d_functional") and name != "wait_tensor"):
                self.calls[name] = self.calls.get(name, 0) + 1
                self.bytes[name] = self.bytes.get(name, 0) + collective_bytes(namespace, name, args)
            self.peak_heap = max(self.peak_heap, heap_in_use())
            out = func(*args, **(kwargs or {}))
            self.peak_heap = max(self.peak_heap, heap_in_use())
            return out

    return StepProbe()


def _measured_step(config: str, dtype_name: str, s: dict, ids) -> dict:
    """One warm-up step (it creates the optimizer state), then one step under the probe."""
    gc.collect()
    baseline = heap_in_use()  # before this config's model exists
    model, optimizer = _build(config, dtype_name, s)
    _step(model, optimizer, ids)
    engine_stats = model._sharded.comm.stats if config == "ours" else None
    if engine_stats is not None:
        engine_stats.reset()
    gc.collect()
    start = heap_in_use()
    probe = _probe_mode()
    with probe:
        _step(model, optimizer, ids)
    result = {
        "step_start_bytes": start - baseline,
        "peak_bytes": probe.peak_heap - baseline,
        "collectives": {"calls": probe.calls, "bytes": probe.bytes},
    }
    if engine_stats is not None:
        result["engine_counter"] = {"calls": dict(engine_stats.calls), "bytes": dict(engine_stats.bytes)}
    del model, optimizer
    gc.collect()
    return result


# -- one rank -----------------------------------------------------------------------------------


def _log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"[bench] {message}", flush=True)


def _rank_work(rank: int, s: dict) -> dict:
    import warnings

    warnings.filterwarnings("ignore")  # FSDP1's deprecation notice, our YaFSDP notes
    ids = _batch(s, rank)
    times = {d: {c: [] for c in CONFIGS} for d in s["dtypes"]}
    for repeat_index in range(s["repeats"]):
        for dtype_name in s["dtypes"]:
            repeat = _timed_repeat(dtype_name, s, ids, repeat_index)
            for config, step_times in repeat.items():
                times[dtype_name][config].append(step_times)
            medians = ", ".join(
                f"{c} {1000 * statistics.median(t):.0f}" for c, t in repeat.items()
            )
            _log(rank, f"repeat {repeat_index + 1}/{s['repeats']} {dtype_name}: median ms {medians}")
    # After the timed repeats on purpose: the first use of some torch internals allocates
    # for good, which would otherwise be charged to whichever config is measured first.
    measured = {d: {c: _measured_step(c, d, s, ids) for c in CONFIGS} for d in s["dtypes"]}
    _log(rank, "memory and collectives measured")
    return {"times": times, "measured": measured}


def _rank_entry(rank: int, world: int, init_file: str, out_dir: str, s: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),  # a failed rank must not hang the others
    )
    try:
        result = {"ok": _rank_work(rank, s)}
    except BaseException:  # noqa: BLE001 - handed to the parent with its traceback
        result = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    from fsdp_bridge.harness.teardown import leave_world

    leave_world()  # the result is on disk; see [Note: gloo teardown abort]


def run_world(s: dict, entry=_rank_entry) -> list[dict]:
    """Spawn `s["nproc"]` ranks running `entry(rank, world, init_file, out_dir, s)`, each writing
    {"ok": result} or {"error": traceback} to out_dir/rank{rank}.json; the results, in rank order."""
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"  # read by the spawned ranks at start-up
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(
            entry, args=(s["nproc"], os.path.join(tmp, "init"), tmp, s),
            nprocs=s["nproc"], join=False, start_method="spawn",
        )
        errors = []
        try:
            while not context.join():
                pass
        except Exception as exc:  # a rank died hard
            errors.append(f"process failure: {exc}")
        results = []
        for rank in range(s["nproc"]):
            path = os.path.join(tmp, f"rank{rank}.json")
            if not os.path.exists(path):
                errors.append(f"rank {rank} produced no result")
                continue
            with open(path) as handle:
                result = json.load(handle)
            if "error" in result:
                errors.append(f"--- rank {rank} ---\n{result['error']}")
            else:
                results.append(result["ok"])
    if errors:
        raise RuntimeError("bench: a rank failed:\n" + "\n".join(errors))
    return results


# -- figures and report -------------------------------------------------------------------------


def _config_figures(times: list[list[float]], per_rank: list[dict]) -> dict:
    every_step = [t for run in times for t in run]
    collectives = per_rank[0]["collectives"]
    figures = {
        "median_step_ms": 1000 * statistics.median(every_step),
        "repeat_medians_ms": [1000 * statistics.median(run) for run in times],
        "step_times_ms": [[1000 * t for t in run] for run in times],
        "peak_bytes_per_rank": [r["peak_bytes"] for r in per_rank],
        "step_start_bytes_per_rank": [r["step_start_bytes"] for r in per_rank],
        "collective_calls_per_step": sum(collectives["calls"].values()),
        "collective_bytes_per_step": sum(collectives["bytes"].values()),
        "collectives_by_op": collectives,
    }
    if "engine_counter" in per_rank[0]:
        figures["engine_counter"] = per_rank[0]["engine_counter"]
    return figures


def _targets(figs: dict) -> dict:
    ours, f1, f2 = figs["ours"], figs["fsdp1"], figs["fsdp2"]
    faster = min(f1["median_step_ms"], f2["median_step_ms"])
    fsdp2_peak = max(f2["peak_bytes_per_rank"])
    measured = fsdp2_peak > 0  # False where the heap cannot be measured (see heap_in_use)
    compute_only = ours["median_step_ms"] / figs["plain"]["median_step_ms"]
    return {
        "speed_ratio_to_faster_native": ours["median_step_ms"] / faster,
        "speed_met": ours["median_step_ms"] <= SPEEDUP_TARGET * faster,
        "peak_ratio_to_fsdp2": max(ours["peak_bytes_per_rank"]) / fsdp2_peak if measured else None,
        "memory_met": (max(ours["peak_bytes_per_rank"]) <= MEMORY_TARGET * fsdp2_peak
                       if measured else None),
        "step_start_memory_met": (max(ours["step_start_bytes_per_rank"])
                                  <= max(f2["step_start_bytes_per_rank"]) if measured else None),
        "collectives_met": ours["collective_calls_per_step"] <= f2["collective_calls_per_step"],
        "compute_only_ratio": compute_only,
        "compute_only_goal_met": compute_only <= COMPUTE_ONLY_GOAL,
    }


def _paired_ratio(ours: list[list[float]], native: list[list[float]]) -> float:
    """The median over rounds of ours / native, each pair timed in the same round."""
    pairs = [o / n for ours_run, native_run in zip(ours, native) for o, n in zip(ours_run, native_run)]
    return statistics.median(pairs)


def summarize(s: dict, results: list[dict]) -> dict:
    """The figures of a finished run (rank 0's timings are already the max over ranks)."""
    report = {"settings": s, "dtypes": {}}
    for dtype_name in s["dtypes"]:
        figs = {
            config: _config_figures(
                results[0]["times"][dtype_name][config],
                [r["measured"][dtype_name][config] for r in results],
            )
            for config in CONFIGS
        }
        ours = figs["ours"]["median_step_ms"]
        for other in ("fsdp1", "fsdp2", "ours2", "plain"):
            figs["ours"][f"ratio_to_{other}"] = ours / figs[other]["median_step_ms"]
            figs["ours"][f"paired_ratio_to_{other}"] = _paired_ratio(
                results[0]["times"][dtype_name]["ours"], results[0]["times"][dtype_name][other]
            )
        faster = min(figs["fsdp1"]["median_step_ms"], figs["fsdp2"]["median_step_ms"])
        figs["ours2"]["ratio_to_faster_native"] = figs["ours2"]["median_step_ms"] / faster
        report["dtypes"][dtype_name] = {"configs": figs, "targets": _targets(figs)}
    return report


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def _verdict(met) -> str:
    return "n/a" if met is None else "MET" if met else "MISSED"


def format_report(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"tiny Llama: hidden {s['hidden']}, {s['layers']} layers, vocab {s['vocab']}, seq "
        f"{s['seq']}, batch {s['batch']}/rank; world {s['nproc']} on gloo, 1 thread/rank",
        f"{s['repeats']} repeats x ({s['warmup']} warmup steps + {s['steps']} rounds of one step "
        "per config, interleaved); step time = slowest rank; median over all timed steps",
        "peak = highest heap bytes in use (glibc mallinfo2, sampled at every op) during one "
        "step above the heap before the model was built, max over ranks; start = live bytes when the step begins; collectives = c10d ops per "
        "step on one rank, bytes of the full tensor; paired = median of per-round ours/this",
        "ours = our engine through the YaFSDP front-end; ours2 = through fully_shard "
        "(DTensor parameters); plain = compute only (each rank's unsharded model on its own "
        "batch, no communication)",
    ]
    for dtype_name, entry in report["dtypes"].items():
        figs, targets = entry["configs"], entry["targets"]
        lines += ["", f"{dtype_name}:",
                  f"  {'config':7s}{'median ms':>11s}{'ours/this':>11s}{'paired':>8s}{'peak MiB':>10s}"
                  f"{'start MiB':>11s}{'calls/step':>12s}{'MiB/step':>10s}"]
        ours = figs["ours"]["median_step_ms"]
        for config in CONFIGS:
            f = figs[config]
            paired = figs["ours"].get(f"paired_ratio_to_{config}", 1.0)
            lines.append(
                f"  {config:7s}{f['median_step_ms']:11.1f}{ours / f['median_step_ms']:11.2f}"
                f"{paired:8.2f}"
                f"{_mib(max(f['peak_bytes_per_rank'])):>10s}"
                f"{_mib(max(f['step_start_bytes_per_rank'])):>11s}"
                f"{f['collective_calls_per_step']:12d}{_mib(f['collective_bytes_per_step']):>10s}"
            )
        by_op = "; ".join(
            f"{config} " + " + ".join(f"{n} {op}" for op, n in figs[config]["collectives_by_op"]["calls"].items())
            for config in CONFIGS
        )
        lines.append(f"  calls by op: {by_op}")
        engine = figs["ours"].get("engine_counter")
        if engine:
            lines.append(f"  ours, engine's own counter: {sum(engine['calls'].values())} calls, "
                         f"{_mib(sum(engine['bytes'].values()))} MiB")
        peak_ratio = targets["peak_ratio_to_fsdp2"]
        lines.append(
            f"  targets: speed {_verdict(targets['speed_met'])} (ours/faster native "
            f"{targets['speed_ratio_to_faster_native']:.2f}, target <= {SPEEDUP_TARGET}); "
            f"peak {_verdict(targets['memory_met'])} (ours/fsdp2 "
            f"{'n/a' if peak_ratio is None else f'{peak_ratio:.3f}'}, target <= "
            f"{MEMORY_TARGET}); start <= fsdp2 {_verdict(targets['step_start_memory_met'])}; "
            f"calls <= fsdp2 {_verdict(targets['collectives_met'])}"
        )
        lines.append(
            f"  cost of sharding: ours/plain {targets['compute_only_ratio']:.2f} (goal <= "
            f"{COMPUTE_ONLY_GOAL}: {_verdict(targets['compute_only_goal_met'])})"
        )
        lines.append(f"  ours2 (fully_shard) / faster native: "
                     f"{figs['ours2']['ratio_to_faster_native']:.2f}")
    return "\n".join(lines)


def write_figures(path, figures: dict) -> None:
    """`--json FILE`: the figures as JSON (nothing when the option is not given)."""
    if path:
        with open(path, "w") as handle:
            json.dump(figures, handle, indent=2)
        print(f"figures written to {path}")


def _check_sweep_options(args) -> None:
    import importlib.util

    from fsdp_bridge.outputs import check_output_file

    if getattr(args, "plot", None) and not args.sweep:
        raise ValueError(f"--plot {args.plot!r}: the plot is drawn from a size sweep; add "
                         "--sweep, or drop --plot")
    if not args.sweep:
        return
    check_output_file("--plot", args.plot or DEFAULT_PLOT)
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--sweep draws its plot with matplotlib, which is not installed: pip "
                         "install 'fsdp-bridge[plot]' (or matplotlib)")


def _run_sweep(args, s: dict) -> int:
    from fsdp_bridge import bench_sweep

    reports = bench_sweep.run_sweep(s)
    for report in reports:
        print(format_report(report), end="\n\n")
    print(bench_sweep.format_sweep(reports))
    plot = args.plot or DEFAULT_PLOT
    bench_sweep.plot_sweep(reports, plot)
    print(f"plot written to {plot}")
    write_figures(args.json, {"sweep": reports})
    return 0


def run(args) -> int:
    if getattr(args, "device", "cpu") == "cuda":
        from fsdp_bridge import bench_cuda

        return bench_cuda.run(args)
    try:
        if getattr(args, "profile", None):
            raise ValueError(f"--profile {args.profile!r}: traces are taken on CUDA only; add "
                             "--device cuda, or drop --profile")
        s = _settings(args)
        _check_sweep_options(args)
    except ValueError as exc:
        print(f"fsdp-bridge bench: {exc}")
        return 2
    if args.sweep:
        return _run_sweep(args, s)
    report = summarize(s, run_world(s))
    print(format_report(report))
    write_figures(args.json, report)
    return 0
