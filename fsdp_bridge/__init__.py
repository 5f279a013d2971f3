"""fsdp-bridge: one YaFSDP-style sharding engine behind every FSDP dialect.

Dialect front-ends live at paths that mirror the originals: `fsdp_bridge.ya_fsdp` (YaFSDP),
`fsdp_bridge.fsdp` (torch FSDP1/FSDP2), `fsdp_bridge.zeta`, `fsdp_bridge.torchacc`.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # `fsdp_bridge.explain(model)`, imported lazily so that `import fsdp_bridge` stays light.
    if name == "explain":
        from fsdp_bridge.explain import explain

        return explain
    raise AttributeError(f"module 'fsdp_bridge' has no attribute {name!r}")
