"""Which files `migrate` looks at, and which of them it needs to parse at all.

[Note: the prefilter]
Parsing with libcst and resolving qualified names costs milliseconds per hundred lines; a large
repository has thousands of files and only a handful use FSDP. Any FSDP usage we rewrite has to
import it, and every such import spells the module path (`torch.distributed.fsdp`, `from
torch.distributed import fsdp`, `ya_fsdp`, ...) or the class name somewhere in the file. So a
byte-level regular expression decides "cannot contain FSDP usage" without parsing; the files it
lets through are then matched properly, by qualified name.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from typing import Callable, Iterator

import pathspec

from fsdp_bridge.codemods.names import NOT_FSDP1_CLIP

# Bytes that any FSDP use we translate must contain (see the note above).
_TORCH_FSDP = (
    rb"distributed\.(?:_composable\.)?fsdp"
    rb"|FullyShardedDataParallel"
    rb"|from\s+torch\.distributed(?:\._composable)?\s+import\s+\(?[^;)]*?\bfsdp\b"
)
# Hugging Face Trainer / accelerate configuration: reported, not rewritten.
_TRAINER_FLAGS = rb"|\bfsdp(?:_config)?\s*="
# `model.clip_grad_norm_(...)`: FSDP1's method, reached in files that never import FSDP.
_CLIP_METHOD = rb"|\.clip_grad_norm_\("
PREFILTER = {
    "fsdp2": re.compile(_TORCH_FSDP + _TRAINER_FLAGS + _CLIP_METHOD),
    "yafsdp": re.compile(_TORCH_FSDP + _TRAINER_FLAGS),
    "bridge": re.compile(_TORCH_FSDP + rb"|\bya_fsdp\b|\bzeta\b|\btorchacc\b"),
}
# accelerate YAML configs that turn FSDP on.
YAML_FSDP = re.compile(rb"^\s*(?:distributed_type:\s*FSDP|fsdp_config:)", re.MULTILINE)

PYTHON_SUFFIXES = (".py", ".pyi")
YAML_SUFFIXES = (".yaml", ".yml")
NOTEBOOK_SUFFIXES = (".ipynb",)  # not rewritten; reported when they mention FSDP
READ_SUFFIXES = PYTHON_SUFFIXES + YAML_SUFFIXES + NOTEBOOK_SUFFIXES


def unsupported_files(paths: list[str]) -> list[str]:
    """The files named on the command line that migrate does not read (not Python, YAML or a
    notebook): each is an error, not a silent skip."""
    return [path for path in paths if os.path.isfile(path) and not path.endswith(READ_SUFFIXES)]
ALWAYS_SKIPPED = {".git", ".hg", ".svn", "__pycache__"}
# Directories of installed or generated code, skipped by default as ruff and black skip them
# (the union of their default excludes): a virtual environment that .gitignore does not list
# would otherwise have torch's own installed files rewritten. `--no-default-excludes` keeps them.
DEFAULT_EXCLUDED = {
    ".bzr", ".direnv", ".eggs", ".git-rewrite", ".ipynb_checkpoints", ".mypy_cache", ".nox",
    ".pants.d", ".pyenv", ".pytest_cache", ".pytype", ".ruff_cache", ".tox", ".venv", ".vscode",
    "__pypackages__", "_build", "buck-out", "build", "dist", "node_modules", "site-packages",
    "venv",
}
# A directory holding this file is a virtual environment, whatever its name.
VENV_MARKER = "pyvenv.cfg"


# Stage 2 of the prefilter: module paths whose import (or dotted use) makes a file relevant.
_RELEVANT_MODULES = {
    "fsdp2": ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"),
    "yafsdp": ("torch.distributed.fsdp", "torch.distributed._composable.fsdp"),
    "bridge": ("torch.distributed.fsdp", "torch.distributed._composable.fsdp", "ya_fsdp", "zeta.training",
               "torchacc"),
}
_CONFIG_KEYWORDS = {"fsdp", "fsdp_config"}


def may_use_fsdp(data: bytes, target: str) -> bool:
    """Cheap and conservative: False only if the file cannot contain FSDP usage."""
    if PREFILTER[target].search(data) is None:
        return False
    try:  # Python's own parser is ~50x faster than libcst: confirm with real imports/uses
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return True  # let libcst report the error
    return _uses_relevant_module(tree, target)


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for a chain of names and attributes; None for anything else."""
    attributes = []
    while isinstance(node, ast.Attribute):
        attributes.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(attributes)])


def _uses_relevant_module(tree: ast.AST, target: str) -> bool:
    prefixes = _RELEVANT_MODULES[target]

    def relevant(name: str) -> bool:
        return any(name == p or name.startswith(p + ".") for p in prefixes)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(relevant(a.name) for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if relevant(node.module) or any(relevant(f"{node.module}.{a.name}") for a in node.names):
                return True
        if isinstance(node, ast.Attribute) and relevant(_dotted(node) or ""):
            return True
        if isinstance(node, ast.Call) and target == "fsdp2" and _wrapper_clip(node):
            return True
        if isinstance(node, ast.Call) and target != "bridge":
            if any(k.arg in _CONFIG_KEYWORDS for k in node.keywords):
                return True  # Trainer/accelerate configuration: reported
            if (_dotted(node.func) or "").endswith("FullyShardedDataParallelPlugin"):
                return True
    return False


def _wrapper_clip(call: ast.Call) -> bool:
    """`model.clip_grad_norm_(max_norm)`: the FSDP1 wrapper's method (not torch.nn.utils', not
    accelerate's, which takes the parameters first)."""
    func = call.func
    if not isinstance(func, ast.Attribute) or func.attr != "clip_grad_norm_":
        return False
    owner = (_dotted(func.value) or "").split(".")[-1]
    first = call.args[0] if call.args else None
    takes_parameters = isinstance(first, ast.Call) and (_dotted(first.func) or "").endswith("parameters")
    return bool(owner) and not NOT_FSDP1_CLIP.search(owner) and not takes_parameters


def decode_python(data: bytes) -> tuple[str, Callable[[str], bytes]]:
    """A Python file's text, decoded as Python reads it, and how to encode a rewrite of it.

    The encoding is the one Python itself would use (PEP 263): UTF-8, or the file's
    `# -*- coding: latin-1 -*-` declaration; a UTF-8 byte-order mark is kept. The codemods see
    the text after the mark. Raises SyntaxError for an unknown or contradictory declaration (or
    undecodable bytes in the first two lines) and UnicodeDecodeError for bytes the encoding
    cannot read further down; the encoder raises UnicodeEncodeError
    when the rewrite holds a character the declared encoding cannot write.
    """
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    if encoding == "utf-8-sig":  # the mark stays as it was, outside the text the codemods see
        return data[3:].decode("utf-8"), lambda text: data[:3] + text.encode("utf-8")
    return data.decode(encoding), lambda text: text.encode(encoding)


class _Ignores:
    """.gitignore files met on the way down, each applying below its own directory."""

    def __init__(self, root: str, excludes: list[str]) -> None:
        self.specs: list[tuple[str, pathspec.PathSpec]] = []
        if excludes:
            self.specs.append((root, pathspec.GitIgnoreSpec.from_lines(excludes)))

    def add_dir(self, directory: str) -> None:
        path = os.path.join(directory, ".gitignore")
        if os.path.isfile(path):
            with open(path, encoding="utf-8", errors="replace") as handle:
                self.specs.append((directory, pathspec.GitIgnoreSpec.from_lines(handle)))

    def ignored(self, path: str, is_dir: bool) -> bool:
        for base, spec in self.specs:
            if not (path == base or path.startswith(base.rstrip(os.sep) + os.sep)):
                continue
            relative = os.path.relpath(path, base).replace(os.sep, "/")
            if spec.match_file(relative + ("/" if is_dir else "")):
                return True
        return False


def walk(paths: list[str], excludes: list[str], default_excludes: bool = True,
         skipped: list[str] | None = None, outside: list[str] | None = None) -> Iterator[str]:
    """Python, YAML and notebook files under `paths`, honouring .gitignore files and `--exclude`,
    and (with `default_excludes`) skipping virtual environments and build directories, each
    skipped one appended to `skipped`.

    A file or directory named explicitly on the command line is always included. A file reached
    twice (a symlink and its target, or two links) is listed once, under the first path met: it
    is rewritten through the link, which stays a link. A symbolic link found in a directory that
    points outside it is not listed but appended to `outside`: migrate never writes outside the
    trees it is given.
    """
    seen: set[str] = set()
    for path in _walk(paths, excludes, default_excludes, skipped if skipped is not None else [],
                      outside if outside is not None else []):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            yield path


def is_default_excluded(directory: str) -> bool:
    """A virtual environment (by name or by its pyvenv.cfg) or a build or tool directory."""
    return (os.path.basename(directory) in DEFAULT_EXCLUDED
            or os.path.isfile(os.path.join(directory, VENV_MARKER)))


def _walk(paths: list[str], excludes: list[str], default_excludes: bool,
          skipped: list[str], outside: list[str]) -> Iterator[str]:
    for top in paths:
        if os.path.isfile(top):
            yield top
            continue
        if not os.path.isdir(top):
            raise FileNotFoundError(f"path {top!r} does not exist; pass files or directories to migrate.")
        ignores = _Ignores(top, excludes)
        root = os.path.realpath(top)
        for directory, dirnames, filenames in os.walk(top):
            ignores.add_dir(directory)
            kept = []
            for name in sorted(dirnames):
                path = os.path.join(directory, name)
                if name in ALWAYS_SKIPPED or ignores.ignored(path, True):
                    continue
                if default_excludes and is_default_excluded(path):
                    skipped.append(path)
                    continue
                kept.append(name)
            dirnames[:] = kept
            for name in sorted(filenames):
                path = os.path.join(directory, name)
                if name.endswith(READ_SUFFIXES) and not ignores.ignored(path, False):
                    if _inside(os.path.realpath(path), root):
                        yield path
                    else:
                        outside.append(path)


def _inside(real: str, root: str) -> bool:
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)
