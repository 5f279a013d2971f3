"""`python -m libcst.tool codemod to_yafsdp.ToYafsdpCommand PATH`: the same rewrite as
`fsdp-bridge migrate PATH --to yafsdp`, one file at a time."""

from fsdp_bridge.codemods.to_yafsdp import ToYafsdpCommand

__all__ = ["ToYafsdpCommand"]
