"""`fsdp-bridge compare`: one recipe under several backends, step by step (with `--matrix`:
the conformance matrix, fsdp_bridge/harness/matrix/table.py).

Exit 0 when every backend agrees with the first (the baseline) within the tolerance of the
recipe's dtype, 1 when one does not (naming the first diverging step), 2 on error, 3 when they
agree but a 1 % learning-rate change would have agreed too (cannot tell; see resolution.py).
"""

from __future__ import annotations

import argparse
import math
import sys

from fsdp_bridge.harness.names import (
    BACKENDS,
    DTYPES,
    OPTIMIZERS,
    RECIPES,
    SIZE_DEFAULTS,
    STRATEGIES,
    TOLERANCE_GROWTH,
    TOLERANCE_GROWTH_HELP,
)

# The single-process reference first (the baseline), then each native torch FSDP beside our
# engine behind the same dialect.
DEFAULT_BACKENDS = "reference,torch-fsdp1,bridge-fsdp1,torch-fsdp2,bridge-fsdp2"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="tiny-llama", choices=RECIPES,
                        help="what to train: a tiny Llama, a tiny GPT-2 (tied embeddings) or an "
                             "MLP (default tiny-llama)")
    parser.add_argument("--backends", default=DEFAULT_BACKENDS,
                        help=f"comma-separated, the first is the baseline; known: "
                             f"{', '.join(BACKENDS)} (default {DEFAULT_BACKENDS})")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="gradient accumulation steps per optimizer step (default 1)")
    parser.add_argument("--mp", default="fp32", choices=DTYPES,
                        help="compute dtype; low precision gathers parameters in it and reduces "
                             "in fp32 (default fp32)")
    parser.add_argument("--strategy", default="full_shard", choices=STRATEGIES,
                        help="sharding strategy, FSDP1's names (default full_shard)")
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS,
                        help="optimizer (default adamw)")
    parser.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights and the data (default 0)")
    meaning = {"layers": "decoder layers (MLP: hidden layers)", "hidden": "hidden size",
               "vocab": "vocabulary size", "seq": "sequence length", "heads": "attention heads",
               "batch": "global batch size, split over the ranks"}
    for field, default in SIZE_DEFAULTS.items():
        parser.add_argument(f"--{field}", type=int, default=default,
                            help=f"{meaning[field]} (default {default})")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA + NCCL when there is a GPU per rank, else CPU + gloo "
                             "(default auto)")
    parser.add_argument("--rtol", type=float, help="override the dtype's rtol")
    parser.add_argument("--atol", type=float, help="override the dtype's atol")
    parser.add_argument("--tolerance-growth", default="window", choices=TOLERANCE_GROWTH,
                        help=TOLERANCE_GROWTH_HELP)
    parser.add_argument("--json", metavar="FILE", help="write the full report as JSON (- for "
                        "stdout, the table then going to stderr)")
    parser.add_argument("--plot", metavar="FILE.png", help="write loss and deviation curves")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines on stderr (what is trained, each backend done)")
    from fsdp_bridge.harness.matrix import table

    table.add_arguments(parser)


def check_light_arguments(args: argparse.Namespace) -> list[str]:
    """The backend names, after every check that needs neither torch nor transformers
    (ValueError naming the first bad option): they come at once, before those load."""
    from fsdp_bridge.extras import require
    from fsdp_bridge.harness import arguments

    for flag in ("nproc", "steps", "micro_batches"):
        arguments.positive_int(f"--{flag.replace('_', '-')}", getattr(args, flag))
    if not math.isfinite(args.lr) or args.lr < 0:
        raise ValueError(f"--lr {args.lr!r}: expected a finite learning rate >= 0, e.g. 1e-3.")
    if args.seed < 0:
        raise ValueError(f"--seed {args.seed}: expected an int >= 0.")
    arguments.outputs(args.json, args.plot)
    backends = arguments.backend_names("--backends", args.backends)
    if args.recipe != "mlp":  # the others are Hugging Face models
        require("transformers", why=f"--recipe {args.recipe} is a Hugging Face model; "
                "--recipe mlp is not")
    return backends


def checked_arguments(args: argparse.Namespace):
    """(recipe, backends) after checking every argument and output path; ValueError or
    BackendUnavailable naming the first bad one. Starts no process."""
    from fsdp_bridge.harness import arguments

    backends = check_light_arguments(args)
    from fsdp_bridge.harness.backends import get_backend
    from fsdp_bridge.harness.launcher import resolve_device
    from fsdp_bridge.harness.recipes import Size, builtin_recipe

    arguments.tolerances(args.rtol, args.atol)
    size = Size(**{field: getattr(args, field) for field in SIZE_DEFAULTS})
    recipe = builtin_recipe(args.recipe, size, steps=args.steps,
                            micro_batches=args.micro_batches, mp=args.mp,
                            strategy=args.strategy, optimizer=args.optimizer, lr=args.lr,
                            seed=args.seed)
    for name in backends:
        get_backend(name).check_available()
    recipe.check_world(args.nproc)
    resolve_device(args.device, args.nproc)
    return recipe, backends


EXIT_ERROR = 2  # compare.EXIT_ERROR, without importing torch to say it


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge import progress

    if args.matrix:
        from fsdp_bridge.harness.matrix import table

        return table.run(args)

    try:
        check_light_arguments(args)
    except ValueError as exc:
        print(f"fsdp-bridge compare: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    progress.note("fsdp-bridge compare: loading torch and the recipe's model code...",
                  args.quiet)
    from fsdp_bridge.harness.backends import BackendUnavailable
    from fsdp_bridge.harness.equivalence import check_equivalence
    from fsdp_bridge.harness.report import show

    try:
        recipe, backends = checked_arguments(args)
    except (ValueError, BackendUnavailable) as exc:
        print(f"fsdp-bridge compare: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    # One spawned world trains every backend in turn and reports at the end: say what it does.
    progress.note(f"fsdp-bridge compare: training {args.recipe} under {len(backends)} backends "
                  f"({', '.join(backends)}), {args.steps} steps on {args.nproc} ranks...",
                  args.quiet)
    try:
        report = check_equivalence(recipe, backends, nproc=args.nproc, device=args.device,
                                   rtol=args.rtol, atol=args.atol, growth=args.tolerance_growth,
                                   announce=not args.quiet)
    except (ValueError, BackendUnavailable) as exc:
        print(f"fsdp-bridge compare: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("fsdp-bridge compare: interrupted; every rank it started was stopped.",
              file=sys.stderr)
        return 130
    show(report, args.json, args.plot, error_prefix="error in ")
    from fsdp_bridge.outputs import human_stream

    print(f"({report.seconds:.1f} s)", file=human_stream(args.json))
    return report.exit_code
