"""The `fsdp-bridge` command line.

Each subcommand lives in its own module, imported only when that subcommand runs: `fsdp-bridge
--help` imports none of them (so no torch), and `fsdp-bridge migrate` imports only the migrate
command. The table below gives each subcommand's one-line help, so that the overview needs no
import. A subcommand module exposes:

    add_arguments(parser) -> None       declares its arguments
    run(args) -> int                    does the work; the return value is the exit code
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module implementing it, its line in `fsdp-bridge --help`). Add a line to add one.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("fsdp_bridge.demo", "migrate an FSDP1 script and prove the rewrites equivalent; "
             "train the YaFSDP example beside a reference"),
    "bench": ("fsdp_bridge.bench", "time native FSDP1, FSDP2 and our engine (YaFSDP and "
              "fully_shard front-ends) on a tiny Llama (CPU ranks, gloo), or on a 1B Llama on "
              "CUDA (--device cuda)"),
    "explain": ("fsdp_bridge.explain_cli", "show the front-ends' argument tables, or the plan a "
                "tiny demo model gets"),
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
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(chosen_parser=parser)
    for name, (module_name, help_line) in available().items():
        sub_parser = sub.add_parser(name, help=help_line, description=help_line)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sub_parser)
            sub_parser.set_defaults(_run=module.run)
            parser.set_defaults(chosen_parser=sub_parser)
    return parser


# The exit code of a command stopped by Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    try:
        parser = build_parser(chosen)  # imports the chosen subcommand's module
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # said with the subcommand's usage, not the overview's
            args.chosen_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if args.command is None:
            parser.print_help()
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
