"""fsdp-bridge: one YaFSDP-style sharding engine behind every FSDP dialect.

Dialect front-ends live at paths that mirror the originals: `fsdp_bridge.ya_fsdp` (YaFSDP),
`fsdp_bridge.fsdp` (torch FSDP1/FSDP2), `fsdp_bridge.zeta`, `fsdp_bridge.torchacc`.
"""

__version__ = "0.1.0"


def __getattr__(name):
    # `fsdp_bridge.explain(model)`, imported lazily so that `import fsdp_bridge` stays light. It
    # lives in `explanation`: a submodule named `explain` would replace this function with
    # itself on the package the moment it is imported.
    if name == "explain":
        from fsdp_bridge.explanation import explain

        globals()["explain"] = explain
        return explain
    raise AttributeError(f"module 'fsdp_bridge' has no attribute {name!r}")
