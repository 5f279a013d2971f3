"""`fsdp-bridge explain`: print every front-end's argument table, or the Plan a demo model gets."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--write-docs", metavar="PATH", help="write the tables as Markdown "
                        "to PATH (docs/frontends.md) instead of printing them")
    parser.add_argument("--demo", action="store_true", help="wrap a tiny Llama with FSDP1 "
                        "(transformer policy, bf16) in a one-rank world and explain its plan")


def _demo() -> str:
    import functools
    import os
    import tempfile
    import warnings

    import torch
    import torch.distributed as dist
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from fsdp_bridge.explanation import explain
    from fsdp_bridge.fsdp import FullyShardedDataParallel, MixedPrecision
    from fsdp_bridge.fsdp.wrap import transformer_auto_wrap_policy
    from fsdp_bridge.tiny import build_llama, llama_config

    if not dist.is_initialized():
        path = os.path.join(tempfile.mkdtemp(), "init")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
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
