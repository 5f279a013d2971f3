"""The `fsdp-bridge` command line.

Each subcommand lives in its own module, imported only when it runs (so `fsdp-bridge migrate`
never imports the engine, and `--help` stays fast). A subcommand module exposes:

    HELP: str                           one line for `fsdp-bridge --help`
    add_arguments(parser) -> None       declares its arguments
    run(args) -> int                    does the work; the return value is the exit code
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module implementing it. Add a line here to add a subcommand.
SUBCOMMANDS: dict[str, str] = {
    "demo": "fsdp_bridge.demo",
    "bench": "fsdp_bridge.bench",
    "explain": "fsdp_bridge.explain_cli",
    "migrate": "fsdp_bridge.migrate.cli",
    "compare": "fsdp_bridge.harness.cli_compare",
    "compare-scripts": "fsdp_bridge.harness.cli_compare_scripts",
    "convert-checkpoint": "fsdp_bridge.checkpoint.cli",
}


def _available(only: str | None = None) -> dict[str, object]:
    """The subcommands whose module is present in this checkout (just `only`, when given)."""
    found = {}
    for name, module_name in SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            found[name] = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only a missing *subcommand module* hides the subcommand; a missing
            # dependency inside an existing module is a real error and surfaces.
            if exc.name is None or not module_name.startswith(exc.name):
                raise
    return found


def build_parser(modules: dict[str, object]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdp-bridge",
        description="One sharding engine behind every FSDP dialect, codemods between "
        "dialects, and an equivalence harness.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in modules.items():
        sub_parser = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(sub_parser)
        sub_parser.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A named subcommand imports only its own module: `migrate` must not pay for torch.
    modules = _available(argv[0] if argv and argv[0] in SUBCOMMANDS else None) or _available()
    parser = build_parser(modules)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
