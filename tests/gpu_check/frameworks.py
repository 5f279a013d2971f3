"""`python -m tests.gpu_check.frameworks --json FILE [--smoke]`: the framework examples at one rank.

Each framework example of fsdp_bridge/examples (HF Trainer, accelerate, Lightning) and its native
twin run under `torchrun --nproc_per_node 1`, 3 steps in bf16 with `--generate`, through
compare-scripts' runner (losses and parameter digests after every optimizer step, and which FSDP
wrapped the model). On a GPU the frameworks take their own FSDP path (accelerate's FSDP plugin
included, which it drops on a CPU-only machine). Under `--smoke`, on the CPU, the examples' CPU
switch sets the frameworks to FSDP (fsdp_bridge/examples/frameworks.py), so a smoke run checks
this command and the examples, and says nothing about CUDA.

For each pair it records both runs' losses and their largest difference, whether the pair agrees
step by step within the bf16 tolerance, which FSDP each run wrapped with, the devices of each
run's parameters after training, and the tokens each generated. A pair passes when both runs
finished, agree, generated tokens, and (on a GPU) hold their parameters on CUDA. The JSON is
rewritten after each pair, so a phase stopped at its timeout keeps the pairs it finished. The
pairs run at the same time (one small GPU job each).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import json
import math
import os
import re
import sys

EXAMPLES = ("hf_trainer_llama", "accelerate_llama", "lightning_llama")
SCRIPT_ARGS = ("--steps", "3", "--bf16", "--generate")
GENERATED = re.compile(r"generated (\[[^\]]*\]) parameters on (\[[^\]]*\])")


def _script(name: str) -> str:
    import fsdp_bridge.examples

    return os.path.join(os.path.dirname(fsdp_bridge.examples.__file__), name + ".py")


def _generated(output: str):
    """(tokens, parameter devices) from an example's `--generate` line; (None, None) without."""
    found = GENERATED.search(output)
    if not found:
        return None, None
    return ast.literal_eval(found.group(1)), ast.literal_eval(found.group(2))


def _run_record(run) -> dict:
    tokens, devices = _generated(run.output)
    record = {"script": os.path.basename(run.script), "exit_code": run.returncode,
              "seconds": round(run.seconds, 1),
              "losses": [run.losses[step] for step in sorted(run.losses)],
              "optimizer_steps": len(run.digests), "wrapped": run.wrappers,
              "generated": tokens, "parameters_on": devices}
    if run.error:
        record["error"] = run.error[-2000:]
    return record


def compare_pair(name: str, gpu: bool, timeout: float) -> dict:
    from fsdp_bridge.harness.compare import tolerance_for
    from fsdp_bridge.harness.scripts import DEFAULT_LOSS_PATTERN, compare_script_runs, run_script

    native, ours = (run_script(label, _script(script), 1, SCRIPT_ARGS, DEFAULT_LOSS_PATTERN,
                               timeout)
                    for label, script in (("native", name + "_native"), ("ours", name)))
    result = {"example": name, "native": _run_record(native), "ours": _run_record(ours)}
    runs = (result["native"], result["ours"])
    problems = [f"{run['script']} failed (exit {run['exit_code']})" for run in runs
                if "error" in run]
    if not problems:
        comparison = compare_script_runs(native, ours, tolerance_for("bf16"))
        pairs = list(zip(runs[0]["losses"], runs[1]["losses"]))
        result["losses_equal"] = bool(pairs) and all(a == b for a, b in pairs)
        result["max_loss_diff"] = max((abs(a - b) for a, b in pairs), default=math.nan)
        result["agree_within_bf16_tolerance"] = comparison.ok
        if not comparison.ok:
            problems.append(f"runs differ from step {comparison.first_diverging_step}")
        result["same_generated_tokens"] = runs[0]["generated"] == runs[1]["generated"]
    problems += [f"{run['script']} printed no generated tokens" for run in runs
                 if not run["generated"] and "error" not in run]
    on_cuda = [bool(run["parameters_on"]) and all(d.startswith("cuda") for d in
                                                  run["parameters_on"]) for run in runs]
    result["parameters_on_cuda"] = all(on_cuda)
    if gpu and not all(on_cuda):
        problems.append("parameters not on CUDA after training: "
                        f"{[run['parameters_on'] for run in runs]}")
    result["passed"] = not problems
    result["problems"] = problems
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.gpu_check.frameworks")
    parser.add_argument("--json", required=True, help="file for the results")
    parser.add_argument("--smoke", action="store_true", help="on the CPU (checks this command)")
    parser.add_argument("--examples", nargs="+", choices=EXAMPLES, default=list(EXAMPLES))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per script run")
    args = parser.parse_args(argv)
    import torch

    gpu = not args.smoke
    if gpu and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU, or pass --smoke", file=sys.stderr)
        return 2
    report = {"device": "cuda" if gpu else "cpu (smoke: the examples' CPU switch)",
              "nproc": 1, "script_args": list(SCRIPT_ARGS), "pairs": []}
    with concurrent.futures.ThreadPoolExecutor(len(args.examples)) as pool:
        futures = [pool.submit(compare_pair, name, gpu, args.timeout) for name in args.examples]
        for future in concurrent.futures.as_completed(futures):
            report["pairs"].append(future.result())
            with open(args.json, "w") as handle:
                json.dump(report, handle, indent=2)
    for pair in sorted(report["pairs"], key=lambda pair: pair["example"]):
        verdict = "passed" if pair["passed"] else "FAILED: " + "; ".join(pair["problems"])
        print(f"{pair['example']}: {verdict}; max loss difference "
              f"{pair.get('max_loss_diff')}; parameters on "
              f"{pair['ours']['parameters_on']} (ours), {pair['native']['parameters_on']} "
              f"(native); generated {pair['ours']['generated']} (ours), "
              f"{pair['native']['generated']} (native)", flush=True)
    return 0 if all(pair["passed"] for pair in report["pairs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
