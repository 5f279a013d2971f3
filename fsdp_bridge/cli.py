"""The `fsdp-bridge` command line.

Each subcommand lives in its own module, imported only when that subcommand runs: `fsdp-bridge
--help` imports none of them (so no torch), and `fsdp-bridge migrate` imports only the migrate
command. The table below gives each subcommand's one-line help, so that the overview needs no
import. A subcommand module exposes:

    add_arguments(parser) -> None       declares its arguments
    run(args) -> int                    does the work; the return value is the exit code

Every subcommand also takes `-v/--verbose`: the package logs through `logging`, under the
`fsdp_bridge` logger and its children named after the modules (`fsdp_bridge.harness.torchrun`,
`fsdp_bridge.migrate.driver`, ...), as accelerate, Lightning and torchtitan do; `-v` shows its
INFO records on stderr, `-vv` its DEBUG records too. A program using the library configures
those loggers itself.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# name -> (module implementing it, its line in `fsdp-bridge --help`). Add a line to add one.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("fsdp_bridge.demo", "migrate an FSDP1 script and prove the rewrites equivalent; "
             "train the YaFSDP example beside a reference"),
    "bench": ("fsdp_bridge.bench", "time native FSDP1, FSDP2 and our engine (YaFSDP and "
              "fully_shard front-ends) on a tiny Llama (CPU ranks, gloo), or on a 1B Llama on "
              "CUDA (--device cuda)"),
    "explain": ("fsdp_bridge.explain_cli", "show the front-ends' argument tables, or the plan "
                "your model (or a tiny demo model) gets"),
    "migrate": ("fsdp_bridge.migrate.cli", "rewrite FSDP code between dialects (FSDP1 -> bridge "
                "/ FSDP2 / YaFSDP) with libcst"),
    "compare": ("fsdp_bridge.harness.cli_compare", "train a recipe under several FSDP backends "
                "and show where they agree or first diverge"),
    "compare-scripts": ("fsdp_bridge.harness.cli_compare_scripts", "run two training scripts "
                        "under torchrun and compare their per-step losses and parameter "
                        "digests"),
    "convert-checkpoint": ("fsdp_bridge.checkpoint_cli", "convert a checkpoint between "
                           "torch.save, DCP and safetensors, offline (no ranks)"),
}

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _present(module_name: str) -> bool:
    """Whether the module's source is in this checkout, found without importing it (importing a
    parent package could pull in torch)."""
    relative = module_name.split(".")[1:]
    path = os.path.join(_PACKAGE_DIR, *relative)
    return os.path.isfile(path + ".py") or os.path.isfile(os.path.join(path, "__init__.py"))


def available() -> dict[str, tuple[str, str]]:
    """The subcommands whose module is present (a partial checkout hides the missing ones)."""
    return {name: entry for name, entry in SUBCOMMANDS.items() if _present(entry[0])}


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """Every available subcommand with its help line; only `chosen` (when given) is imported
    and gets its arguments and its run function (its parser is `parser.chosen_parser`)."""
    from fsdp_bridge import __version__

    parser = argparse.ArgumentParser(
        prog="fsdp-bridge",
        description="One sharding engine behind every FSDP dialect, codemods between "
        "dialects, and an equivalence harness.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_verbose(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(chosen_parser=parser)
    for name, (module_name, help_line) in available().items():
        sub_parser = sub.add_parser(name, help=help_line, description=help_line)
        _add_verbose(sub_parser)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
            parser.set_defaults(chosen_parser=sub_parser)
    return parser


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: given before or after the command, neither parser overwrites the other's count.
    parser.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                        help="log what the command does on stderr (the fsdp_bridge loggers' "
                             "INFO records; -vv: DEBUG too)")


def configure_logging(verbosity: int) -> None:
    """The `fsdp_bridge` loggers' records at INFO (-v) or DEBUG (-vv) on stderr; without -v, the
    library's warnings only (Python's own default)."""
    if not verbosity:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    package = logging.getLogger("fsdp_bridge")
    package.addHandler(handler)
    package.setLevel(logging.INFO if verbosity == 1 else logging.DEBUG)


# The exit code of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The command is the first argument that is not an option (`fsdp-bridge -v migrate ...`).
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    chosen = first if first in SUBCOMMANDS else None
    try:
        parser = build_parser(chosen)  # imports the chosen subcommand's module
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said with the subcommand's usage, not the overview's
            args.chosen_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        configure_logging(getattr(args, "verbose", 0))
        if args.command is None:  # the overview, then argparse's kind of error line
            parser.print_help(sys.stderr)
            print(f"{parser.prog}: error: name a command, e.g. fsdp-bridge demo (fsdp-bridge "
                  "--help describes each)", file=sys.stderr)
            return 2
        return _run(args)
    except KeyboardInterrupt:
        # Whatever the command was doing (importing torch, walking files, training): one line.
        # Commands stop the processes they started before the interrupt reaches here.
        print(f"fsdp-bridge{' ' + chosen if chosen else ''}: interrupted (Ctrl-C).",
              file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args: argparse.Namespace) -> int:
    """The subcommand's exit code; a missing optional dependency, or a file-system failure no
    command foresaw (a full disk, a read-only destination), is one line on stderr."""
    from fsdp_bridge.extras import MissingExtra, as_missing_extra
    from fsdp_bridge.outputs import is_file_system_error, os_error_line

    try:
        return int(args._run(args) or 0)
    except OSError as exc:
        if exc.filename is None and not is_file_system_error(exc):
            raise  # a socket, a timeout: not ours to summarise
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fsdp-bridge {args.command}: error: {where}{os_error_line(exc)}", file=sys.stderr)
        return 2
    except MissingExtra as exc:
        missing: MissingExtra | None = exc
    except ModuleNotFoundError as exc:  # an import of an extra that no check foresaw
        missing = as_missing_extra(exc)
        if missing is None:
            raise
    print(f"fsdp-bridge {args.command}: error: this command {missing}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
