"""`python -m tests.gpu_check.probe [FILE]`: one JSON object (on stdout, and in FILE)
describing this interpreter's machine: Python, torch and its CUDA, the GPUs, the driver (from
nvidia-smi, when it works), the versions of the libraries the GPU tests and the bench use, and
whether the package's engine and front-ends import. Run in a subprocess of the check, so a torch
that crashes or hangs on import costs that phase only. A missing library is recorded, never an
error."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import platform
import subprocess
import sys

# Distributions whose versions the summary records (None when not installed).
DISTRIBUTIONS = ("torch", "transformers", "accelerate", "lightning", "pytorch-lightning",
                 "safetensors", "tqdm", "numpy", "pytest", "pytest-timeout", "hypothesis",
                 "libcst", "pathspec", "fsdp-bridge")
# What the GPU tests and the bench import from the package (none of them needs libcst/pathspec).
PACKAGE_MODULES = ("fsdp_bridge", "fsdp_bridge.engine", "fsdp_bridge.fsdp", "fsdp_bridge.ya_fsdp",
                   "fsdp_bridge.bench.cuda")


def _version(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _torch() -> dict:
    try:
        import torch
    except Exception as exc:  # recorded: the summary says why nothing else ran
        return {"torch_import_error": f"{type(exc).__name__}: {exc}"}
    info = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cuda_available": torch.cuda.is_available(), "gpus": []}
    if info["cuda_available"]:
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["gpus"].append({"name": props.name,
                                 "memory_gib": round(props.total_memory / 2**30, 2),
                                 "capability": f"{props.major}.{props.minor}"})
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return info


def _driver():
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi did not run: {exc}"
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() \
        else f"nvidia-smi exit {done.returncode}: {done.stderr.strip()[:200]}"


def _package() -> dict:
    """Where fsdp_bridge is imported from, and the error of each module that fails to import."""
    errors = {}
    for name in PACKAGE_MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
    location = sys.modules["fsdp_bridge"].__file__ if "fsdp_bridge" in sys.modules else None
    return {"fsdp_bridge_file": location, "fsdp_bridge_import_errors": errors or None,
            "libcst_imported": "libcst" in sys.modules,
            "pathspec_imported": "pathspec" in sys.modules}


def probe() -> dict:
    info = {"python": sys.version.split()[0], "python_executable": sys.executable,
            "platform": platform.platform()}
    info.update(_torch())
    info["driver"] = _driver()
    info["versions"] = {name: _version(name) for name in DISTRIBUTIONS}
    info.update(_package())
    return info


if __name__ == "__main__":
    found = json.dumps(probe())
    print(found)
    if len(sys.argv) > 1:  # the file the check reads (the log also holds what torch printed)
        with open(sys.argv[1], "w") as handle:
            handle.write(found)
