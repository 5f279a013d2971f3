"""libcst codemods that move training code between FSDP dialects (`fsdp-bridge migrate`).

Commands: `to_bridge.ToBridgeCommand`, `to_fsdp2.ToFsdp2Command`, `to_yafsdp.ToYafsdpCommand`,
also runnable from the repository root as `python -m libcst.tool codemod to_fsdp2.ToFsdp2Command
PATH` (`.libcst.codemod.yaml` names this package). The rule codes they report are in `rules.py`;
the libcst helpers they share are in `helpers.py`.
"""
