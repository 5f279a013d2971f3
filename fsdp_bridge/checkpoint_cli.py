"""`fsdp-bridge convert-checkpoint SRC DST --to {torch,dcp,safetensors}`.

`--help` and the checks of SRC and DST (`checkpoint.convert_checks`) run before torch is
imported, which takes seconds: a wrong argument is answered at once."""

from __future__ import annotations

import argparse
import sys
import warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="SRC", help="a torch.save file, a DCP directory, a "
                        ".safetensors file or a save_pretrained directory (detected)")
    parser.add_argument("destination", metavar="DST", help="where to write (a file for torch "
                        "and *.safetensors, a directory otherwise)")
    parser.add_argument("--to", required=True, choices=("torch", "dcp", "safetensors"),
                        help="the format to write: a torch.save file, a DCP directory, or "
                             "safetensors (flat tensors)")
    parser.add_argument("--key", default=None, help="for --to safetensors: the sub-dict whose "
                        "tensors to keep (default: 'model' when the source has one)")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    parser.add_argument("--json", metavar="FILE", help="also write what was converted (formats, "
                        "paths, tensor counts, bytes) as JSON to FILE; - for stdout (the text "
                        "then goes to stderr)")


def run(args: argparse.Namespace) -> int:
    from fsdp_bridge.checkpoint import convert_checks  # no torch
    from fsdp_bridge.outputs import check_output_file

    try:  # the --json output path, before the conversion starts
        check_output_file("--json", args.json, stdout=True)
    except ValueError as exc:
        return _error(exc)
    from fsdp_bridge.checkpoint.validate import CheckpointError

    try:
        convert_checks.detect(args.source)
        convert_checks.check_destination(args.source, args.destination, args.to, args.force)
    except CheckpointError as exc:
        return _error(exc)
    from fsdp_bridge.checkpoint.convert import convert

    try:
        with warnings.catch_warnings():
            # Offline by design: DCP's note that it assumes one process says nothing new here.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                    category=UserWarning)
            report = convert(args.source, args.destination, args.to, key=args.key,
                             force=args.force)
    except (CheckpointError, ValueError) as exc:
        return _error(exc)
    _show(report, args)
    return 0


def _error(exc: Exception) -> int:
    print(f"fsdp-bridge convert-checkpoint: error: {exc}", file=sys.stderr)
    return 2


def _show(report, args: argparse.Namespace) -> None:
    """The report's lines, and with --json the same as data."""
    import dataclasses

    from fsdp_bridge.outputs import STDOUT, human_stream, write_json

    text = human_stream(args.json)
    for line in report.lines():
        print(line, file=text)
    if args.json:
        write_json(args.json, {"source": args.source, "destination": args.destination,
                               **dataclasses.asdict(report)})
        if args.json != STDOUT:
            print(f"wrote the summary as JSON to {args.json}", file=text)
