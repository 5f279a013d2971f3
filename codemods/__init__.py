"""The codemods as libcst's own runner sees them: one module per target, each exposing one
command (`.libcst.codemod.yaml` at the repository root points the runner here). The rewriting
itself lives in `fsdp_bridge.codemods`; these modules only name the commands.

    python -m libcst.tool list
    python -m libcst.tool codemod to_fsdp2.ToFsdp2Command PATH
"""
