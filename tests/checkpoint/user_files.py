"""Files a user had before a test, and a SHA-256 check that they are unchanged after it."""

from __future__ import annotations

import hashlib
import os


def make(directory) -> dict:
    """A user's `outputs/`: a log, a plot folder, a notes file; returns their digests."""
    directory = str(directory)
    os.makedirs(os.path.join(directory, "plots"), exist_ok=True)
    with open(os.path.join(directory, "train.log"), "w") as handle:
        handle.write("step 1 loss 4.2\nstep 2 loss 3.9\n")
    with open(os.path.join(directory, "plots", "loss.csv"), "w") as handle:
        handle.write("1,4.2\n2,3.9\n")
    with open(os.path.join(directory, "notes.txt"), "w") as handle:
        handle.write("do not delete\n")
    return digests(directory)


def digests(directory, only=None) -> dict:
    """{relative path: SHA-256} of every file under `directory` (or of `only` of them)."""
    out = {}
    for root, _, files in os.walk(str(directory)):
        for name in files:
            file = os.path.join(root, name)
            relative = os.path.relpath(file, str(directory))
            if only is None or relative in only:
                with open(file, "rb") as handle:
                    out[relative] = hashlib.sha256(handle.read()).hexdigest()
    return out


def unchanged(directory, before: dict) -> bool:
    return digests(directory, only=set(before)) == before


def plant(directory, outside) -> dict:
    """A user's entries inside a writer's destination `directory`: a note, a file in a
    sub-directory, and a relative symbolic link to a file in `outside`. Returns what `intact`
    checks: the files' digests and inodes, the link's text, its target's digest."""
    directory, outside = str(directory), str(outside)
    os.makedirs(os.path.join(directory, "mine"), exist_ok=True)
    os.makedirs(outside, exist_ok=True)
    target = os.path.join(outside, "shared.txt")
    with open(target, "w") as handle:
        handle.write("another project's file\n")
    with open(os.path.join(directory, "NOTES.md"), "w") as handle:
        handle.write("# what this run was\n")
    with open(os.path.join(directory, "mine", "settings.yaml"), "w") as handle:
        handle.write("lr: 0.1\n")
    link = os.path.join(directory, "shared.txt")
    os.symlink(os.path.relpath(target, directory), link)
    files = ("NOTES.md", os.path.join("mine", "settings.yaml"))
    return {"directory": directory, "files": digests(directory, only=set(files)),
            "inodes": {name: os.stat(os.path.join(directory, name)).st_ino for name in files},
            "link": os.readlink(link), "target": target,
            "target_digest": digests(outside, only={"shared.txt"})}


def intact(planted: dict) -> bool:
    """The planted files hold what they held (the same files, not copies), the link is still a
    link with the same text, and its target is untouched."""
    directory = planted["directory"]
    link = os.path.join(directory, "shared.txt")
    return (digests(directory, only=set(planted["files"])) == planted["files"]
            and all(os.stat(os.path.join(directory, name)).st_ino == inode
                    for name, inode in planted["inodes"].items())
            and os.path.islink(link) and os.readlink(link) == planted["link"]
            and digests(os.path.dirname(planted["target"]), only={"shared.txt"})
            == planted["target_digest"])
