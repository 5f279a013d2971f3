"""A full disk and a read-only destination under every checkpoint writer: `checkpoint.save`,
`convert-checkpoint --to dcp` and `--to torch`, and a command's output file. Each must fail in
one line naming the path, leave the previous checkpoint loadable and the user's files as they
were. Prints one JSON object.

    python file_system_faults.py tmpfs DIRECTORY    # run under `unshare -rm`: mounts a small
                                                    # tmpfs at DIRECTORY, then remounts it ro
    python file_system_faults.py limits DIRECTORY   # a file-size limit (ulimit -f) for the full
                                                    # disk; a directory without write permission
                                                    # (chmod) for read-only, when not root

Exit code 3 in tmpfs mode: the tmpfs could not be mounted (use limits mode).
"""

import contextlib
import io
import json
import os
import resource
import subprocess
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
warnings.simplefilter("ignore")

import torch  # noqa: E402

from fsdp_bridge import checkpoint  # noqa: E402
from fsdp_bridge.cli import main as cli_main  # noqa: E402
from tests.checkpoint import user_files  # noqa: E402

SMALL, BIG = 1 << 10, 1 << 20  # fp32 elements: 4 KiB fits, 4 MiB does not
TMPFS_KIB = 1024
# Room left on the full disk (or the largest file allowed): lock files and manifests fit, a
# checkpoint of BIG and explain's 16 KB of docs do not.
FREE = 8 << 10


def _state(size: int, step: int) -> dict:
    return {"w": torch.full((size,), float(step)), "step": step}


def _loads(path: str, size: int, step: int) -> bool:
    state = {"w": torch.empty(size), "step": -1}
    try:
        checkpoint.load(state, path)
    except Exception:  # noqa: BLE001 - reported as not loadable
        return False
    return state["step"] == step and torch.equal(state["w"], _state(size, step)["w"])


def _torch_file_loads(path: str, size: int, step: int) -> bool:
    try:
        return torch.equal(torch.load(path, weights_only=True)["w"], _state(size, step)["w"])
    except Exception:  # noqa: BLE001
        return False


def _api(fn) -> dict:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        return {"message": f"{type(exc).__name__}: {exc}"}
    return {"message": "no error"}


def _cli(*argv: str) -> dict:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli_main(list(argv))
    return {"code": code, "message": err.getvalue()}


def prepare(directory: str, outside: str) -> dict:
    """The previous state: a checkpoint holding the user's files, a DCP and a torch file."""
    saved = os.path.join(directory, "ckpt")
    checkpoint.save(_state(SMALL, 1), saved)
    planted = user_files.plant(saved, outside)
    source = os.path.join(outside, "big.pt")
    torch.save(_state(BIG, 2), source)
    dcp_dir, torch_file = os.path.join(directory, "dcp"), os.path.join(directory, "old.pt")
    small = os.path.join(outside, "small.pt")
    torch.save(_state(SMALL, 1), small)
    for target, to in ((dcp_dir, "dcp"), (torch_file, "torch")):
        assert _cli("convert-checkpoint", small, target, "--to", to)["code"] == 0
    return {"saved": saved, "planted": planted, "source": source, "dcp": dcp_dir,
            "torch": torch_file}


def attempts(paths: dict, directory: str) -> dict:
    """Every writer tries once; then what is left is checked."""
    out = {
        "save": _api(lambda: checkpoint.save(_state(BIG, 2), paths["saved"])),
        "to_dcp": _cli("convert-checkpoint", paths["source"], paths["dcp"], "--to", "dcp",
                       "--force"),
        "to_torch": _cli("convert-checkpoint", paths["source"], paths["torch"], "--to",
                         "torch", "--force"),
        "output": _cli("explain", "--write-docs", os.path.join(directory, "tables.md")),
    }
    out["after"] = {
        "save_loads": _loads(paths["saved"], SMALL, 1),
        "dcp_loads": _loads_dcp(paths["dcp"]),
        "torch_loads": _torch_file_loads(paths["torch"], SMALL, 1),
        "user_files_intact": user_files.intact(paths["planted"]),
        "leftovers": sorted(n for n in os.listdir(directory) if ".tmp-" in n or ".old-" in n),
    }
    return out


def _loads_dcp(path: str) -> bool:
    return _loads(path, SMALL, 1)


def fill(directory: str, leave: int) -> str:
    """A file that takes all the free space of `directory`'s file system but `leave` bytes."""
    filler = os.path.join(directory, "filler")
    with open(filler, "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * (64 << 10))
                handle.flush()
        except OSError:
            pass
    os.truncate(filler, max(0, os.path.getsize(filler) - leave))
    return filler


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Files may not grow beyond `limit` bytes meanwhile (ulimit -f; SIGXFSZ is ignored by
    Python, so such a write fails with EFBIG). The soft limit only: it can be lifted again."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def main() -> int:
    mode, directory = sys.argv[1], sys.argv[2]
    os.makedirs(directory, exist_ok=True)
    outside = directory + "_outside"
    result = {"mode": mode}
    if mode == "tmpfs":
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_KIB}k", "tmpfs",
                                  directory], capture_output=True, text=True)
        if mounted.returncode != 0:
            print(json.dumps({"mount": mounted.stderr}))
            return 3
        paths = prepare(directory, outside)
        filler = fill(directory, leave=FREE)
        result["disk_full"] = attempts(paths, directory)
        os.remove(filler)
        subprocess.run(["mount", "-o", "remount,ro", directory], check=True)
        result["read_only"] = attempts(paths, directory)
    else:
        paths = prepare(directory, outside)
        with file_size_limit(FREE):
            result["disk_full"] = attempts(paths, directory)
        if os.geteuid() != 0:  # root writes through permissions
            os.chmod(directory, 0o555)
            try:
                result["read_only"] = attempts(paths, directory)
            finally:
                os.chmod(directory, 0o755)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
