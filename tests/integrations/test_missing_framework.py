"""Importing an integration whose framework is not installed fails in one line naming the extra."""

from __future__ import annotations

import subprocess
import sys

import pytest

HIDE_AND_IMPORT = """
import importlib, sys

class NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == sys.argv[1]:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
try:
    importlib.import_module(sys.argv[2])
except Exception as error:
    print(type(error).__name__, error)
"""


@pytest.mark.parametrize("framework,module,extra", [
    ("accelerate", "fsdp_bridge.integrations.accelerate", "hf"),
    ("accelerate", "fsdp_bridge.integrations.transformers", "hf"),
    ("lightning", "fsdp_bridge.integrations.lightning", "lightning"),
])
def test_missing_framework_is_named_with_its_extra(framework, module, extra):
    done = subprocess.run([sys.executable, "-c", HIDE_AND_IMPORT, framework, module],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (f"MissingExtra {module} needs {framework}, which is not "
                                   f"installed: pip install 'fsdp-bridge[{extra}]'")
