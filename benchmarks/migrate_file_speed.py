"""Per-file cost of `migrate --to fsdp2` against libcst's floor, on one large file.

    .venv/bin/python benchmarks/migrate_file_speed.py [FILE] [--repeats N]

FILE defaults to the installed `transformers/trainer.py` (about 4.7k lines; it mentions FSDP
through accelerate, so the prefilter lets it through). It is measured twice: as it is, and with
FSDP1 code added (three files of tests/codemods/corpus: their imports on top, their code at the
end), so that every analysis of the codemod
(receivers by scope, state-dict blocks, dual-dialect checks) runs over the whole file. Measured
side by side, best of N runs each:

  floor: libcst.parse_module + one metadata resolution (QualifiedNameProvider, which includes
         the scope analysis) -- what any qualified-name codemod must pay;
  ours:  fsdp_bridge.migrate.driver.process (read, prefilter, parse, transform, report).

The target is ours <= 3x the floor. It also prints what `--check` spends on a file that does not
mention FSDP (the prefilter alone).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "codemods" / "corpus"
APPENDED = ("checkpoint_handler.py", "lightning_strategy.py", "ddp_or_fsdp.py")


def _default_file() -> str:
    import transformers

    return os.path.join(os.path.dirname(transformers.__file__), "trainer.py")


def _with_fsdp1_code(original: str) -> str:
    """`original` with the corpus files' imports on top and their code at the end, as a real
    file would have them."""
    imports, bodies = [], []
    for name in APPENDED:
        lines = (CORPUS / name).read_text().splitlines()
        for line in lines:
            (imports if line.startswith(("import ", "from ")) else bodies).append(line)
    return "\n".join(imports) + "\n" + original + "\n\n" + "\n".join(bodies) + "\n"


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import libcst as cst
    from libcst.metadata import MetadataWrapper, QualifiedNameProvider

    from fsdp_bridge.migrate.driver import process

    original = open(args.file or _default_file(), encoding="utf-8").read()
    appended = _with_fsdp1_code(original)
    worst = 0.0
    for label, source in (("as it is", original), ("with FSDP1 code added", appended)):
        with tempfile.TemporaryDirectory() as tmp:  # a copy: nothing can touch the original
            path = os.path.join(tmp, "subject.py")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(source)
            result = process(path, "fsdp2")
            assert result.parsed and result.error is None, result.error

            def floor():
                MetadataWrapper(cst.parse_module(source), unsafe_skip_copy=True).resolve(QualifiedNameProvider)

            floor_s = _best(floor, args.repeats)
            ours_s = _best(lambda: process(path, "fsdp2"), args.repeats)
        worst = max(worst, ours_s / floor_s)
        print(f"{args.file or _default_file()} {label}: {source.count(chr(10))} lines, {len(result.sites)} sites")
        print(f"  libcst parse + QualifiedNameProvider: {floor_s:.3f} s")
        print(f"  migrate --to fsdp2 (one file):        {ours_s:.3f} s")
        print(f"  ratio ours / floor:                   {ours_s / floor_s:.2f}x (target <= 3x)")
    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "plain.py")
        with open(plain, "w", encoding="utf-8") as handle:  # same size, no FSDP
            handle.write("\n".join(f"x_{i} = {i}  # filler" for i in range(original.count("\n"))) + "\n")
        plain_s = _best(lambda: process(plain, "fsdp2"), args.repeats)
    print(f"same size without FSDP (--check reads it, the prefilter rejects it): {plain_s * 1000:.1f} ms")
    return 0 if worst <= 3 else 1


if __name__ == "__main__":
    sys.exit(main())
