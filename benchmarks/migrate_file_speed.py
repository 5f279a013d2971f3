"""Per-file cost of `migrate --to fsdp2` against libcst's floor, on one large file.

    .venv/bin/python benchmarks/migrate_file_speed.py [FILE] [--repeats N]

FILE defaults to the installed `transformers/trainer.py` (about 4.7k lines; it mentions FSDP
through accelerate, so the prefilter lets it through). It is measured twice: as it is, and with
FSDP1 code added (three files of tests/codemods/corpus: their imports on top, their code at the
end), so that every analysis of the codemod (receivers by scope, state-dict blocks, dual-dialect
checks) runs over the whole file. The two sides run interleaved, N rounds (default 3), in this
one process, so that a machine shared with other work slows both alike:

  floor: libcst.parse_module + its scope and position metadata (ScopeProvider, PositionProvider)
         -- what a codemod that matches names by scope and reports lines must pay;
  ours:  fsdp_bridge.migrate.driver.process (read, prefilter, parse, transform, report).

Each side prints its median and spread (min-max) over the rounds; the ratio is of the medians,
target <= 1.5x; then the same in CPU seconds, which a loaded machine disturbs less. It also
prints `fsdp-bridge migrate --to fsdp2 --check FILE` end to end (a fresh interpreter: its imports
included, which the floor's are not) and what `--check` spends on a file that does not mention
FSDP (the prefilter alone).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "codemods" / "corpus"
APPENDED = ("checkpoint_handler.py", "lightning_strategy.py", "ddp_or_fsdp.py")
TARGET = 1.5


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


def _seconds(fn) -> tuple[float, float]:
    """Wall-clock and CPU seconds of one call (this process's CPU: a child's is not counted)."""
    started, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - started, time.process_time() - cpu


def _interleaved(sides: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each side once per round, in turn: wall-clock and CPU seconds by side."""
    wall: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            seconds = _seconds(fn)
            wall[name].append(seconds[0])
            cpu[name].append(seconds[1])
    return wall, cpu


def _summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} s (spread {min(values):.2f}-{max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider, ScopeProvider

    from fsdp_bridge.migrate.driver import process

    name = args.file or _default_file()
    original = open(name, encoding="utf-8").read()
    worst = 0.0
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for label, source in (("as it is", original), ("with FSDP1 code added", _with_fsdp1_code(original))):
        with tempfile.TemporaryDirectory() as tmp:  # a copy: nothing can touch the original
            path = os.path.join(tmp, "subject.py")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(source)
            result = process(path, "fsdp2")
            assert result.parsed and result.error is None, result.error

            def floor():
                wrapper = MetadataWrapper(cst.parse_module(source), unsafe_skip_copy=True)
                wrapper.resolve_many([ScopeProvider, PositionProvider])

            def cli():
                subprocess.run([sys.executable, "-m", "fsdp_bridge", "migrate", path, "--to", "fsdp2", "--check", "-q"],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)

            times, cpu = _interleaved({"floor": floor, "ours": lambda: process(path, "fsdp2"), "cli": cli},
                                      args.repeats)
        ratio = statistics.median(times["ours"]) / statistics.median(times["floor"])
        cpu_ratio = statistics.median(cpu["ours"]) / statistics.median(cpu["floor"])
        worst = max(worst, ratio)
        print(f"{name} {label}: {source.count(chr(10))} lines, {len(result.sites)} sites, {args.repeats} rounds")
        print(f"  libcst parse + scope + position:        {_summary(times['floor'])}")
        print(f"  migrate --to fsdp2 (in this process):   {_summary(times['ours'])}")
        print(f"  ratio of the medians ours / floor:      {ratio:.2f}x (target <= {TARGET}x)")
        print(f"  the same in CPU seconds:                {_summary(cpu['floor'])} / {_summary(cpu['ours'])}: "
              f"{cpu_ratio:.2f}x")
        print(f"  fsdp-bridge migrate --check (a process): {_summary(times['cli'])}")
    with tempfile.TemporaryDirectory() as tmp:
        plain = os.path.join(tmp, "plain.py")
        with open(plain, "w", encoding="utf-8") as handle:  # same size, no FSDP
            handle.write("\n".join(f"x_{i} = {i}  # filler" for i in range(original.count("\n"))) + "\n")
        plain_s = statistics.median(_interleaved({"plain": lambda: process(plain, "fsdp2")}, args.repeats)[0]["plain"])
    print(f"same size without FSDP (--check reads it, the prefilter rejects it): {plain_s * 1000:.1f} ms")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0 if worst <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
