"""The equivalence harness: prove that a change of FSDP dialect or implementation changed
nothing numerically, within stated tolerances.

- `recipes`      what to train (model, data, optimizer, schedule); built-in tiny Llama, GPT-2, MLP
- `backends`     how to shard it: reference, torch-fsdp1/2, bridge-fsdp1/2, bridge-yafsdp
- `runner`       one backend's training loop on one rank, recording loss, grad norm, digest
- `launcher`     one spawned world (gloo / NCCL) running several backends in turn
- `world`        the one spawner of local worlds (harness, bench, tests): results back, no rank
                 outliving the call
- `teardown`     how our ranks leave without torch's gloo exit race
- `digest`       the layout-independent parameter digest
- `compare`      tolerances by dtype, first diverging step, most different parameters
- `equivalence`  check_equivalence(): the above, end to end
- `report`       terminal table, JSON, PNG
- `scripts`      compare two unmodified training scripts under torchrun (+ `step_hook`)
- `arguments`    checks of every option, made before any process starts
- `processes`    commands run in their own process group, stopped whole on timeout or Ctrl-C
- `pytest_plugin` the `fsdp_equivalence` fixture
- `matrix/`      the conformance matrix: ours against native over a covering array of settings
                 (`compare --matrix`)
"""

__all__ = ["Recipe", "Size", "builtin_recipe", "check_equivalence"]


def __getattr__(name: str):
    # Lazy, so that `fsdp-bridge --help` and the pytest plugin do not import torch.
    if name in ("Recipe", "Size", "builtin_recipe"):
        from fsdp_bridge.harness import recipes

        return getattr(recipes, name)
    if name == "check_equivalence":
        from fsdp_bridge.harness.equivalence import check_equivalence

        return check_equivalence
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
