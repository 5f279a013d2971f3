"""Injected into `fsdp-bridge compare-scripts` children through PYTHONPATH: under torchrun
(RANK is set) with FSDP_BRIDGE_HARNESS_OUT set, record a parameter digest after every optimizer
step, and pause 0.2 s at exit (see fsdp_bridge/harness/teardown.py). It changes nothing else in
the script. (It shadows any other `sitecustomize` module.)"""

import os
import sys

if os.environ.get("FSDP_BRIDGE_HARNESS_OUT") and "RANK" in os.environ:
    try:
        from fsdp_bridge.harness.step_hook import install

        from fsdp_bridge.harness.teardown import settle_at_exit

        install(os.environ["FSDP_BRIDGE_HARNESS_OUT"])
        settle_at_exit()  # [Note: gloo teardown abort]
    except Exception as exc:  # noqa: BLE001 - never break the user's script
        print(f"fsdp-bridge: could not install the optimizer step hook: {exc!r}",
              file=sys.stderr)
