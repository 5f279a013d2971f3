"""`fsdp-bridge explain`: print every front-end's argument table, or the Plan a model gets (a
tiny demo Llama, or the user's own, built by a function they name)."""

from __future__ import annotations

import os

MODEL_FORMS = "MODULE:FUNCTION (e.g. mypkg.model:build) or FILE.py:FUNCTION"


def add_arguments(parser) -> None:
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help=f"explain your own model: {MODEL_FORMS}, a function taking no "
                        "arguments that returns the model, wrapped by one of fsdp_bridge's "
                        "front-ends (or unwrapped: it is then wrapped whole with "
                        "FullyShardedDataParallel); it runs in a one-rank world")
    parser.add_argument("--write-docs", metavar="PATH", help="write the tables as Markdown "
                        "to PATH (docs/frontends.md) instead of printing them")
    parser.add_argument("--demo", action="store_true", help="wrap a tiny Llama with FSDP1 "
                        "(transformer policy, bf16) in a one-rank world and explain its plan")
    parser.add_argument("--json", metavar="FILE", help="also write the plan (or, without a "
                        "model, the argument tables) as JSON to FILE; - for stdout (the text "
                        "then goes to stderr)")


def check_model_argument(value: str) -> tuple[str, str]:
    """(module or file, function) of MODEL; ValueError naming it unless it has that form, and,
    for a file, unless the file parses and a function of that name defined in it can be called
    without arguments. Checked before torch is imported."""
    source, _, function = value.rpartition(":")
    if not source or not function.isidentifier():
        raise ValueError(f"MODEL {value!r}: expected {MODEL_FORMS}, naming the function that "
                         "returns the model.")
    if source.endswith(".py"):
        if not os.path.isfile(source):
            raise ValueError(f"MODEL {value!r}: the file {source!r} does not exist.")
        _check_definition(value, source, function)
    return source, function


def _check_definition(value: str, path: str, function: str) -> None:
    """The file's own definition of `function`, read without running the file: it must parse,
    and a function defined there must take no required argument. (A name the file binds
    otherwise, by an import say, is checked once the file has run.)"""
    import ast

    try:
        with open(path, "rb") as handle:
            tree = ast.parse(handle.read(), path)
    except SyntaxError as exc:
        raise ValueError(f"MODEL {value!r}: {path} does not parse: {exc.msg} (line "
                         f"{exc.lineno}).") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"MODEL {value!r}: {path} cannot be read as Python ({exc}).") from None
    defined = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
               and node.name == function]
    if not defined or not isinstance(defined[-1], ast.FunctionDef):
        return
    arguments = defined[-1].args
    positional = arguments.posonlyargs + arguments.args
    required = [arg.arg for arg in positional[:len(positional) - len(arguments.defaults)]]
    required += [arg.arg for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults)
                 if default is None]
    if required:
        raise ValueError(_needs_arguments(value, function, required))


def _needs_arguments(value: str, function: str, required: list) -> str:
    return (f"MODEL {value!r}: {function}() takes arguments ({', '.join(required)}); explain "
            "calls it with none: name a function without required arguments that returns the "
            "model, e.g. one that calls yours with your settings.")


def _load_function(source: str, function: str):
    import importlib
    import importlib.util
    import inspect
    import logging

    logging.getLogger(__name__).info("importing %s to call %s()", source, function)
    if source.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_fsdp_bridge_explained", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(source)
    found = getattr(module, function, None)
    if not callable(found):
        raise ValueError(f"MODEL {source + ':' + function!r}: {source} has no function "
                         f"{function!r}.")
    try:
        parameters = inspect.signature(found).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: let the call tell
        return found
    required = [p.name for p in parameters if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise ValueError(_needs_arguments(f"{source}:{function}", function, required))
    return found


def _one_rank_world() -> None:
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def _users_model(source: str, function: str) -> dict:
    import torch

    from fsdp_bridge.explanation import find_sharded, plan_summary
    from fsdp_bridge.fsdp import FullyShardedDataParallel

    _one_rank_world()
    model = _load_function(source, function)()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"MODEL {source + ':' + function!r}: {function}() returned "
                         f"{_kind(model)}, not a torch.nn.Module: return the model (wrapped by "
                         "one of fsdp_bridge's front-ends, or not).")
    note = ""
    try:
        find_sharded(model)
    except ValueError:
        model = FullyShardedDataParallel(model)
        note = (f"note: {function}() returned an unwrapped {type(model.module).__name__}; it was "
                "wrapped whole with FullyShardedDataParallel(model): return your wrapped model "
                "to see the plan your settings give.\n")
    return {**plan_summary(model), "note": note}


def _kind(value) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def _demo() -> dict:
    import functools
    import warnings

    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_bridge.explanation import plan_summary
    from fsdp_bridge.fsdp import FullyShardedDataParallel, MixedPrecision
    from fsdp_bridge.fsdp.wrap import transformer_auto_wrap_policy
    from fsdp_bridge.tiny import build_llama, llama_config

    _one_rank_world()
    # 2048 positions: LlamaConfig's own default, which this demo has always used.
    config = llama_config(vocab=128, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                          positions=2048)
    model = build_llama(config, seed=None)  # the plan shown does not depend on the weights
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = FullyShardedDataParallel(
            model,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                               transformer_layer_cls={LlamaDecoderLayer}),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
            limit_all_gathers=False,
        )
    return plan_summary(wrapped)


def run(args) -> int:
    import sys

    from fsdp_bridge.outputs import check_output_file, write_text

    try:
        check_output_file("--write-docs", args.write_docs)
        check_output_file("--json", args.json, stdout=True)
        if sum(map(bool, (args.model, args.demo, args.write_docs))) > 1:
            raise ValueError("give one of MODEL, --demo and --write-docs.")
        model = check_model_argument(args.model) if args.model else None
        if model:
            summary = _users_model(*model)
            _show(summary, args.json)
            return 0
    except ValueError as exc:
        print(f"fsdp-bridge explain: error: {exc}", file=sys.stderr)
        return 2
    if args.demo:
        from fsdp_bridge.extras import require

        require("transformers", why="--demo wraps a tiny Hugging Face Llama")
        _show(_demo(), args.json)
        return 0
    if args.write_docs:
        from fsdp_bridge.explanation import render_docs

        write_text(args.write_docs, render_docs())  # from the code: this is how it is made
        print(f"wrote {args.write_docs}")
    elif args.json:
        from fsdp_bridge.explanation import tables_summary

        _show({"tables": tables_summary()}, args.json)
    else:
        print(shipped_tables(), end="")
    return 0


def shipped_tables() -> str:
    """The front-ends' argument tables as committed with the package (fsdp_bridge/frontends.md,
    kept equal to the code's rendering by a test): printed without importing torch."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "frontends.md")) as file:
        return file.read()


def _show(summary: dict, json_path) -> None:
    """The plan (or tables) as text on stdout, or as JSON to --json (- for stdout; the text
    then goes to stderr)."""
    import sys

    from fsdp_bridge.outputs import human_stream, write_json

    if "tables" not in summary:
        from fsdp_bridge.explanation import render_summary

        print(summary.get("note", "") + render_summary(summary), file=human_stream(json_path))
    if json_path:
        write_json(json_path, summary)
        if json_path != "-":
            print(f"wrote {json_path}", file=sys.stderr)
