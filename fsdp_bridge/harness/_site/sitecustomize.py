"""Injected into `fsdp-bridge compare-scripts` children through PYTHONPATH: under torchrun
(RANK is set) with FSDP_BRIDGE_HARNESS_OUT set, record a parameter digest after every optimizer
step, and pause 0.2 s at exit (see fsdp_bridge/harness/teardown.py). It changes nothing else in
the script.

Python imports one module named `sitecustomize` at start-up, the first on the path: this one,
placed first, would hide the environment's own (a virtual environment's, a cluster's). So it
first runs that one, the next `sitecustomize` on the path, as Python would have, and takes its
place in `sys.modules`."""

import os
import sys


def _run_the_shadowed_sitecustomize():
    import importlib.machinery
    import importlib.util
    import traceback

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - reported as Python's site reports it, then go on
        print(f"Error in sitecustomize ({spec.origin}):", file=sys.stderr)
        traceback.print_exc()


_run_the_shadowed_sitecustomize()

if os.environ.get("FSDP_BRIDGE_HARNESS_OUT") and "RANK" in os.environ:
    try:
        from fsdp_bridge.harness.step_hook import install

        from fsdp_bridge.harness.teardown import settle_at_exit

        install(os.environ["FSDP_BRIDGE_HARNESS_OUT"])
        settle_at_exit()  # [Note: gloo teardown abort]
    except Exception as exc:  # noqa: BLE001 - never break the user's script
        print(f"fsdp-bridge: could not install the optimizer step hook: {exc!r}",
              file=sys.stderr)
