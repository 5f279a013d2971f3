"""`python -m libcst.tool codemod to_fsdp2.ToFsdp2Command PATH`: the same rewrite as
`fsdp-bridge migrate PATH --to fsdp2`, one file at a time."""

from fsdp_bridge.codemods.to_fsdp2 import ToFsdp2Command

__all__ = ["ToFsdp2Command"]
