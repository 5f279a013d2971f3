"""`fsdp-bridge compare-scripts A.py B.py --nproc 2 [-- ARGS]`: two training scripts, unmodified.

Exit 0 when B agrees with A step by step, 1 when it does not (naming the first diverging step),
2 on error (a script failed, printed nothing comparable, or A is not deterministic), 3 when
they agree but a 1 % learning-rate change would have agreed too (cannot tell: loss lines alone,
or a coarse tolerance; see resolution.py).
"""

from __future__ import annotations

import argparse
import sys

from fsdp_bridge.harness.names import DTYPES, TOLERANCE_GROWTH, TOLERANCE_GROWTH_HELP


class _SplitAtDoubleDash(argparse.ArgumentParser):
    """Everything after the first `--` goes to the scripts, untouched, as `script_args`.

    (argparse alone cannot take options both before and after the positionals *and* pass
    the rest through: `nargs=REMAINDER` would swallow `--nproc` too.)"""

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        split = args.index("--") if "--" in args else len(args)
        namespace, extras = super().parse_known_args(args[:split], namespace)
        namespace.script_args = args[split + 1:]
        scripts = [arg for arg in extras if not arg.startswith("-")]
        if scripts:
            self.error(f"takes exactly two scripts, A.py and B.py; also got {' '.join(scripts)}. "
                       "Arguments for the scripts go after --, e.g. A.py B.py -- --steps 5")
        return namespace, extras


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.__class__ = _SplitAtDoubleDash
    parser.usage = "%(prog)s A.py B.py [--nproc N] [options] [-- ARGS for both scripts]"
    parser.add_argument("script_a", metavar="A.py", help="the baseline script (run twice): a "
                        "file, or a module's name as python -m takes it (e.g. "
                        "fsdp_bridge.examples.accelerate_llama_native)")
    parser.add_argument("script_b", metavar="B.py", help="the script to compare with it (a file "
                        "or a module's name)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per script (default 2)")
    parser.add_argument("--loss-pattern", default=None,
                        help="regex with named groups 'step' and 'loss' (default matches "
                             "lines like 'step 3 loss 4.21', and else the Hugging Face "
                             "Trainer's {'loss': 4.21, ...} lines)")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES,
                        help="dtype whose default tolerance applies (default fp32)")
    parser.add_argument("--rtol", type=float, help="override the dtype's rtol")
    parser.add_argument("--atol", type=float, help="override the dtype's atol")
    parser.add_argument("--tolerance-growth", default="window", choices=TOLERANCE_GROWTH,
                        help=TOLERANCE_GROWTH_HELP)
    parser.add_argument("--allow-no-fsdp", action="store_true",
                        help="compare runs even when one engaged no FSDP module (by default "
                             "that is an error: its agreement would prove nothing about FSDP)")
    parser.add_argument("--allow-no-loss", action="store_true",
                        help="compare parameter digests alone when no loss line was read (by "
                             "default an error)")
    parser.add_argument("--no-determinism-check", action="store_true",
                        help="do not run A twice (faster; a non-deterministic A goes unnoticed)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per script run")
    parser.add_argument("--json", metavar="FILE", help="write the report as JSON (- for stdout, "
                        "the table then going to stderr)")
    parser.add_argument("--plot", metavar="FILE.png", help="write loss and deviation curves")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress bar (it is drawn on stderr, and only on a terminal)")


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge.harness import arguments
    from fsdp_bridge.harness.names import DEFAULT_LOSS_PATTERN

    pattern = args.loss_pattern or DEFAULT_LOSS_PATTERN
    try:  # every argument and output path, before any script runs or torch loads
        arguments.tolerances(args.rtol, args.atol)
        arguments.outputs(args.json, args.plot)
        arguments.scripts(args.script_a, [args.script_b], args.nproc, pattern, args.timeout)
    except ValueError as exc:
        print(f"fsdp-bridge compare-scripts: error: {exc}", file=sys.stderr)
        return 2
    from fsdp_bridge.harness.compare import tolerance_for
    from fsdp_bridge.harness.report import show
    from fsdp_bridge.harness.scripts import compare_scripts

    tolerance = tolerance_for(args.dtype, args.rtol, args.atol, args.tolerance_growth)
    from fsdp_bridge import progress

    runs = 2 if args.no_determinism_check else 3
    try:
        with progress.bar(runs, "compare-scripts", "run", args.quiet) as runs_done:
            def count_run(run) -> None:
                runs_done.set_postfix_str(f"{run.label} done in {run.seconds:.0f} s")
                runs_done.update(1)

            report = compare_scripts(
                args.script_a, [args.script_b], nproc=args.nproc,
                args=getattr(args, "script_args", []), tolerance=tolerance, pattern=pattern,
                check_determinism=not args.no_determinism_check, timeout=args.timeout,
                on_run=count_run, require_fsdp=not args.allow_no_fsdp,
                require_loss=not args.allow_no_loss)
    except ValueError as exc:
        print(f"fsdp-bridge compare-scripts: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fsdp-bridge compare-scripts: interrupted; torchrun and every rank it started "
              "were stopped.", file=sys.stderr)
        return 130
    show(report, args.json, args.plot, error_prefix="error: ")
    return report.exit_code
