"""`python -m tests.gpu_check --out DIR` (`make gpu-check GPU_CHECK_OUT=DIR`): the GPU tests and
the CUDA benchmark in one offline command, on the Python that is already there, with one summary.

What it runs, each phase a subprocess under a wall-clock timeout (a hang loses that phase only),
in order of value:

1. environment: versions (Python, torch and its CUDA, GPUs, driver, the libraries the tests use,
   the commit) and whether the package's engine and front-ends import;
2. tests-nccl: what `make test-gpu` runs first (GPU_TESTS with FSDP_BRIDGE_DEVICE=cuda);
3. tests-gloo: then GPU_GLOO_TESTS with FSDP_BRIDGE_BACKEND=gloo (ranks share one GPU);
4. bench: `python -m fsdp_bridge bench --device cuda` with few repeats;
5. offload: the device memory a model holds under CPU offload against without, and both runs'
   losses (tests/gpu_check/offload.py).
6. frameworks: the HF Trainer, accelerate and Lightning examples against their native twins at
   one rank: losses, parameters on CUDA, `generate` (tests/gpu_check/frameworks.py).

It installs nothing and reaches no network: it runs this interpreter (`sys.executable`) with
the repository first on PYTHONPATH, so a container's or a cluster's CUDA build of torch is the one
tested (the package need not be installed; libcst and pathspec, which only the codemods import,
need not be either). The summary (summary.md and summary.json) and the bounded raw logs go to the
folder named by `--out`; the summary is rewritten after every phase, so a run killed at a time
limit still leaves what it finished. `--smoke` runs the same phases on the CPU at tiny sizes (to
test this command itself without a GPU).

Why it lives under tests/ and not in the package: it runs the repository's test files and their
helpers (tests/world.py spawns the offload phase's rank), which are not installed with the wheel;
it ships with them in the sdist. pytest does not collect it (no `test_` prefix).
"""
