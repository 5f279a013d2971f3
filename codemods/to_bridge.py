"""`python -m libcst.tool codemod to_bridge.ToBridgeCommand PATH`: the same rewrite as
`fsdp-bridge migrate PATH --to bridge`, one file at a time."""

from fsdp_bridge.codemods.to_bridge import ToBridgeCommand

__all__ = ["ToBridgeCommand"]
