"""`fsdp-bridge demo` (`make demo`): the three promises of fsdp-bridge, end to end, on 2 CPU ranks.

1. Migrate and prove it: the realistic FSDP1 script `fsdp_bridge/examples/fsdp1_train_llama.py` is rewritten
   by `fsdp-bridge migrate --to bridge` and `--to fsdp2` into a temporary directory, and each
   rewrite is compared with the original step by step by `compare-scripts` (tables and a PNG).
2. Drop-in engine: YaFSDP's Llama example (`fsdp_bridge/examples/yafsdp_llama.py`) trains
   unmodified on our engine under torchrun, beside a single process trained on the same global
   batches (it reuses the example's model and data factories), both loss columns printed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

from fsdp_bridge.harness.torchrun import run_torchrun

EXAMPLE = Path(__file__).resolve().parent / "examples" / "yafsdp_llama.py"
STEP_LINE = re.compile(r"^step (\d+) loss ([0-9.eE+-]+)$", re.MULTILINE)


def add_arguments(parser) -> None:
    parser.add_argument("--only", choices=["migrate", "yafsdp"], help="run one part of the demo")
    parser.add_argument("--steps", type=int, default=8,
                        help="steps of the YaFSDP example (default 8)")
    parser.add_argument("--migrate-steps", type=int, default=3,
                        help="steps of the FSDP1 script (default 3)")
    parser.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    parser.add_argument("--example", type=Path, default=EXAMPLE,
                        help="the YaFSDP script of part 2 (default: the one shipped, "
                             "fsdp_bridge/examples/yafsdp_llama.py)")
    parser.add_argument("--out", help="folder for the rewrites and the plot (default: a temp dir)")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress on stderr (it is drawn only on a terminal anyway)")


def _load_example(path: Path):
    spec = importlib.util.spec_from_file_location("fsdp_bridge_demo_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_losses(example, steps: int) -> list[float]:
    """One process, the whole global batch, the example's model, data and optimizer."""
    import torch

    model = example.build_model()
    optimizer = example.make_optimizer(model.parameters())
    losses = []
    for ids in example.batches(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def sharded_losses(path: Path, steps: int, nproc: int) -> list[float]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={nproc}", str(path), "--steps", str(steps),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    returncode, output, _ = run_torchrun(command, env, timeout=600)
    if returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{output[-4000:]}")
    return [float(loss) for _, loss in STEP_LINE.findall(output)]


def run(args) -> int:
    from fsdp_bridge.extras import require

    # Both examples train Hugging Face Llamas; the migration part also draws its plot.
    needs = ("transformers",) if args.only == "yafsdp" else ("transformers", "matplotlib")
    require(*needs, why="its examples train Hugging Face Llamas and draw a plot")
    codes = []
    if args.only in (None, "migrate"):
        from fsdp_bridge.harness.demo_flow import run_demo_flow

        print("== 1. fsdp-bridge migrate, then compare-scripts: the rewrites against the original ==")
        codes.append(run_demo_flow(nproc=args.nproc, steps=args.migrate_steps, out_dir=args.out,
                                   quiet=args.quiet))
    if args.only in (None, "yafsdp"):
        print("\n== 2. The YaFSDP example on our engine, beside a single-process reference ==")
        codes.append(run_yafsdp(args))
    return max(codes)


def run_yafsdp(args) -> int:
    example = _load_example(args.example)
    print(f"Training {args.example.name} through fsdp_bridge.ya_fsdp.YaFSDP on {args.nproc} "
          f"CPU ranks (gloo), and a single-process reference on the same global batches...")
    from fsdp_bridge.progress import note

    note(f"demo: training on {args.nproc} ranks ({args.steps} steps)...", args.quiet)
    ours = sharded_losses(args.example, args.steps, args.nproc)
    reference = reference_losses(example, args.steps)
    if len(ours) != args.steps:
        print(f"error: expected {args.steps} step lines from the example, got {len(ours)}")
        return 2
    # Judged as the harness judges every comparison: its fp32 tolerance, one ratio per step.
    from fsdp_bridge.harness.compare import tolerance_for

    tolerance = tolerance_for("fp32")
    from fsdp_bridge.text import table

    ratios = [tolerance.ratio(a, b) for a, b in zip(ours, reference)]
    rows = [[step, f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}", f"{ratio:.2f}"]
            for step, (a, b, ratio) in enumerate(zip(ours, reference, ratios), start=1)]
    print()
    print("\n".join(table(rows, ["step", f"YaFSDP x{args.nproc} (ours)", "reference", "|diff|",
                                 "of tolerance"], right=range(5), indent="")))
    ok = max(ratios) <= 1.0
    print(f"\nworst step at {max(ratios):.2f} of the tolerance: "
          f"{'equivalent' if ok else 'NOT equivalent'} ({tolerance.describe()})")
    return 0 if ok else 1
