"""`fsdp-bridge bench`: its options, and which bench they run (the CPU bench, its size sweep,
or the CUDA bench)."""

from __future__ import annotations

from fsdp_bridge.bench.options import settings
from fsdp_bridge.bench.report import format_report, summarize, write_figures
from fsdp_bridge.bench.schedule import run_world
from fsdp_bridge.outputs import check_output_file, human_stream

DEFAULT_PLOT = "bench_sweep.png"  # where --sweep draws its plot unless --plot says otherwise
DEFAULT_CAP_MIB = 512.0  # --sweep's per-rank cap: below the largest size's 573 MiB of fp32 weights


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
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE (- for "
                        "stdout, the report then going to stderr)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines on stderr (one per repeat), only the report")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: tiny Llama on gloo ranks (default); cuda: a 1.1B Llama on "
                             "NCCL, one GPU per rank, against the plain unsharded model too")
    parser.add_argument("--sweep", action="store_true",
                        help="cpu only: run the bench at three model sizes (hidden x layers, "
                             "vocab: 256x4 1000, 512x8 4000, 1024x8 8000; --hidden, --layers, "
                             "--vocab and --heads are set per size) and print the ratios per "
                             "size, and which wrap and step peaks stay under one rank's cap "
                             "(--cap-mib); takes several minutes per size at the default "
                             "--steps, e.g. add --steps 4 --warmup 1 --repeats 1")
    parser.add_argument("--plot", metavar="PNG", default=None,
                        help="with --sweep: where to draw step time and peak memory against the "
                             "parameter count (default: bench_sweep.png)")
    parser.add_argument("--cap-mib", type=float, default=None, metavar="MIB",
                        help="with --sweep: one rank's memory cap in MiB (default "
                             f"{DEFAULT_CAP_MIB:g}); the largest size's unsharded fp32 weights "
                             "must exceed it, and the table and plot say which wrap and step "
                             "peaks stay under it")
    parser.add_argument("--profile", metavar="DIR",
                        help="cuda only: export a torch.profiler trace of one step of each "
                             "config to DIR and report how much communication overlaps compute")
    model = parser.add_argument_group(
        "model (defaults: on cpu the tiny Llama hidden 256, 4 layers, 4 heads, vocab 1000, seq "
        "128, batch 4; on cuda hidden 2048, 16 layers, 32 heads (8 kv), intermediate 8192, "
        "vocab 32000, seq 2048, batch 2)")
    model.add_argument("--hidden", type=int, help="hidden size")
    model.add_argument("--layers", type=int, help="decoder layers")
    model.add_argument("--heads", type=int, help="attention heads")
    model.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    model.add_argument("--intermediate", type=int, help="MLP width (default: 4 x --hidden)")
    model.add_argument("--vocab", type=int, help="vocabulary size")
    model.add_argument("--seq", type=int, help="sequence length")
    model.add_argument("--batch", type=int, help="sequences per rank")


def _check_sweep_options(args, s: dict) -> None:
    from fsdp_bridge.bench import sweep
    from fsdp_bridge.outputs import check_plot_file

    if getattr(args, "plot", None) and not args.sweep:
        raise ValueError(f"--plot {args.plot!r}: the plot is drawn from a size sweep; add "
                         "--sweep, or drop --plot")
    cap = getattr(args, "cap_mib", None)
    if cap is not None and not args.sweep:
        raise ValueError(f"--cap-mib {cap:g}: the cap is drawn against a size sweep; add --sweep, "
                         "or drop --cap-mib")
    if cap is not None and cap <= 0:
        raise ValueError(f"--cap-mib {cap:g}: must be a positive number of MiB")
    if not args.sweep:
        return
    check_plot_file("--plot", args.plot or DEFAULT_PLOT)
    sweep.check_cap(s, _cap(args))


def _cap(args) -> float:
    return DEFAULT_CAP_MIB if args.cap_mib is None else args.cap_mib


def _run_sweep(args, s: dict) -> int:
    from fsdp_bridge.bench import sweep

    cap = _cap(args)
    reports = sweep.run_sweep(s)
    text = human_stream(args.json)
    for report in reports:
        print(format_report(report), end="\n\n", file=text)
    print(sweep.format_sweep(reports), file=text)
    print(sweep.format_cap(reports, cap), file=text)
    plot = args.plot or DEFAULT_PLOT
    sweep.plot_sweep(reports, plot, cap)
    print(f"plot written to {plot}", file=text)
    write_figures(args.json, {"sweep": reports})
    return 0


def run(args) -> int:
    import sys

    from fsdp_bridge.extras import require

    # Checked here, not in the ranks: one line instead of a traceback from each of them.
    require("transformers", why="its models are Hugging Face Llamas")
    if getattr(args, "device", "cpu") == "cuda":
        from fsdp_bridge.bench import cuda

        return cuda.run(args)
    try:
        if getattr(args, "profile", None):
            raise ValueError(f"--profile {args.profile!r}: traces are taken on CUDA only; add "
                             "--device cuda, or drop --profile")
        s = settings(args)
        s["quiet"] = bool(getattr(args, "quiet", False))
        check_output_file("--json", args.json, stdout=True)
        _check_sweep_options(args, s)
    except ValueError as exc:
        print(f"fsdp-bridge bench: error: {exc}", file=sys.stderr)
        return 2
    if args.sweep:
        return _run_sweep(args, s)
    report = summarize(s, run_world(s))
    print(format_report(report), file=human_stream(args.json))
    write_figures(args.json, report)
    return 0
