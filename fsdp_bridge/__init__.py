"""fsdp-bridge: one YaFSDP-style sharding engine behind every FSDP dialect.

Dialect front-ends live at paths that mirror the originals: `fsdp_bridge.ya_fsdp` (YaFSDP),
`fsdp_bridge.fsdp` (torch FSDP1/FSDP2), `fsdp_bridge.zeta`, `fsdp_bridge.torchacc`.
"""

__version__ = "0.1.0"
