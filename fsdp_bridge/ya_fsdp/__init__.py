"""Drop-in for YaFSDP: `from fsdp_bridge.ya_fsdp import YaFSDP` (or `fsdp_bridge.ya_fsdp.ya_fsdp`)."""

from fsdp_bridge.ya_fsdp.ya_fsdp import YaFSDP

__all__ = ["YaFSDP"]
