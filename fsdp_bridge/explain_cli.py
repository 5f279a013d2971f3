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


def check_model_argument(value: str) -> tuple[str, str]:
    """(module or file, function) of MODEL; ValueError naming it unless it has that form. Checked
    before torch is imported."""
    source, _, function = value.rpartition(":")
    if not source or not function.isidentifier():
        raise ValueError(f"MODEL {value!r}: expected {MODEL_FORMS}, naming the function that "
                         "returns the model.")
    if source.endswith(".py") and not os.path.isfile(source):
        raise ValueError(f"MODEL {value!r}: the file {source!r} does not exist.")
    return source, function


def _load_function(source: str, function: str):
    import importlib
    import importlib.util

    if source.endswith(".py"):
        spec = importlib.util.spec_from_file_location("_fsdp_bridge_explained", source)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(source)
    if not callable(getattr(module, function, None)):
        raise ValueError(f"MODEL {source}:{function}: {source} has no function {function!r}.")
    return getattr(module, function)


def _one_rank_world() -> None:
    import tempfile

    import torch.distributed as dist

    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)


def _users_model(source: str, function: str) -> str:
    from fsdp_bridge.explanation import explain, find_sharded
    from fsdp_bridge.fsdp import FullyShardedDataParallel

    _one_rank_world()
    model = _load_function(source, function)()
    note = ""
    try:
        find_sharded(model)
    except ValueError:
        model = FullyShardedDataParallel(model)
        note = (f"note: {function}() returned an unwrapped {type(model.module).__name__}; it was "
                "wrapped whole with FullyShardedDataParallel(model): return your wrapped model "
                "to see the plan your settings give.\n")
    return note + explain(model)


def _demo() -> str:
    import functools
    import warnings

    import torch
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_bridge.explanation import explain
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
    return explain(wrapped)


def run(args) -> int:
    import sys

    from fsdp_bridge.outputs import check_output_file, write_text

    try:
        check_output_file("--write-docs", args.write_docs)
        model = check_model_argument(args.model) if args.model else None
        if model and (args.demo or args.write_docs):
            raise ValueError(f"MODEL {args.model!r} with --demo or --write-docs: give one.")
        if model:
            print(_users_model(*model))
            return 0
    except ValueError as exc:
        print(f"fsdp-bridge explain: error: {exc}", file=sys.stderr)
        return 2
    if args.demo:
        from fsdp_bridge.extras import require

        require("transformers", why="--demo wraps a tiny Hugging Face Llama")
        print(_demo())
        return 0
    from fsdp_bridge.explanation import render_docs

    text = render_docs()
    if args.write_docs:
        write_text(args.write_docs, text)
        print(f"wrote {args.write_docs}")
    else:
        print(text)
    return 0
