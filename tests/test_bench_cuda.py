"""`fsdp-bridge bench --device cuda` without a GPU: a clear error, the CPU path unchanged, and the
parts that need no GPU (settings, the 1B model's size, the profile's overlap, the report) on
made-up figures. The GPU run itself is `make bench-gpu` (README)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from fsdp_bridge import bench
from fsdp_bridge.bench import cuda as bench_cuda
from fsdp_bridge.cli import main


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_no_cuda_device_is_a_clear_error(capsys, tmp_path):
    assert main(["bench", "--device", "cuda", "--json", str(tmp_path / "x.json")]) == 2
    out = capsys.readouterr().err
    assert "--device cuda: no CUDA device" in out
    assert "use --device cpu" in out
    assert not (tmp_path / "x.json").exists()


def test_bad_options_are_refused_before_looking_for_a_gpu(capsys):
    assert main(["bench", "--device", "cuda", "--dtype", "fp16"]) == 2
    assert "--dtype 'fp16'" in capsys.readouterr().err
    assert main(["bench", "--device", "cuda", "--hidden", "100", "--heads", "32"]) == 2
    assert "--hidden 100: must split into 32 attention heads" in capsys.readouterr().err


def test_profile_is_refused_on_the_cpu(capsys):
    assert main(["bench", "--profile", "traces"]) == 2
    assert "--profile 'traces': traces are taken on CUDA only" in capsys.readouterr().err


def test_cpu_defaults_are_the_tiny_llama_and_cuda_defaults_a_1b_llama():
    cpu = bench.settings(_args())
    assert {k: cpu[k] for k in ("dtypes", "nproc", "hidden", "layers", "heads", "kv_heads",
                                "intermediate", "vocab", "seq", "batch")} == dict(
        dtypes=["fp32", "bf16"], nproc=2, hidden=256, layers=4, heads=4, kv_heads=4,
        intermediate=1024, vocab=1000, seq=128, batch=4)
    cuda = bench_cuda.settings(_args("--device", "cuda"))
    assert cuda["dtypes"] == ["bf16"] and cuda["nproc"] == 1
    assert cuda["parameters"] >= 1_000_000_000
    # Options given on the command line win over either device's defaults.
    assert bench_cuda.settings(_args("--device", "cuda", "--layers", "2"))["layers"] == 2


def _kernel(name, stream, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_comm_overlap_counts_nccl_time_under_compute_on_other_streams():
    trace = {"traceEvents": [
        _kernel("ncclDevKernel_AllGather_RING_LL", 20, 0, 100),   # 60 us under compute
        _kernel("ampere_bf16_gemm", 7, 40, 30),
        _kernel("elementwise_kernel", 7, 60, 50),                 # overlaps the gemm: counted once
        _kernel("ncclDevKernel_ReduceScatter", 7, 200, 50),      # same stream as compute: serial
        _kernel("vectorized_copy", 7, 200, 50),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},  # not a kernel
    ]}
    out = bench_cuda.comm_overlap(trace)
    assert out["comm_kernels"] == 2
    assert out["comm_ms"] == pytest.approx(0.150)
    assert out["overlapped_ms"] == pytest.approx(0.060)
    assert out["overlap_fraction"] == pytest.approx(0.4)
    assert out["comm_streams"] == ["20", "7"] and out["compute_streams"] == ["7"]
    assert bench_cuda.comm_overlap({"traceEvents": []})["overlap_fraction"] is None


def test_summary_and_report_from_rank_results(tmp_path):
    s = bench_cuda.settings(_args("--device", "cuda", "--steps", "2", "--repeats", "1"))
    trace = tmp_path / "ours.json"
    trace.write_text(json.dumps({"traceEvents": [_kernel("ncclKernel", 2, 0, 1000),
                                                 _kernel("gemm", 1, 0, 500)]}))
    step_ms = {"plain": 100.0, "fsdp1": 112.0, "fsdp2": 108.0, "ours": 104.0}
    peak_gib = {"plain": 20.0, "fsdp1": 21.0, "fsdp2": 20.5, "ours": 20.4}
    rank0 = {"bf16": {c: [{"times": [step_ms[c] / 1000] * 2, "peak_bytes": int(peak_gib[c] * 2**30),
                           "step_start_bytes": 2**34}] for c in bench_cuda.CONFIGS}}
    rank0["bf16"]["ours"][0]["trace"] = str(trace)
    report = bench_cuda.summarize(s, [rank0])
    figs, targets = report["dtypes"]["bf16"]["configs"], report["dtypes"]["bf16"]["targets"]
    assert figs["ours"]["ratio_to_plain"] == pytest.approx(1.04)
    assert targets == {"overhead_vs_plain": pytest.approx(1.04), "overhead_met": True,
                       "speed_vs_fsdp2_met": True, "memory_vs_fsdp2_met": True}
    assert figs["ours"]["profile"]["overlap_fraction"] == pytest.approx(0.5)
    text = bench_cuda.format_report(report)
    assert "Llama 1.10B" in text and "world 1 on NCCL" in text
    assert "ours <= 1.05 x plain MET (1.040)" in text and "50%" in text
    json.dumps(report)  # --json writes it as is
