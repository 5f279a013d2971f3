# Two entry points: `make demo` and `make test`. Both create or reuse .venv.
# `make test-torch TORCH_VERSION=X` runs the suite against torch X in .venv-torch-X, and
# `make test-floor` a subset against the oldest torch the package supports (see below).
#
# torch is installed only when .venv has none: a torch already there is left alone (pip keeps it
# when it meets the package's own `torch>=` floor). Otherwise torch $(TORCH_VERSION) is installed:
# on a machine with an NVIDIA GPU (a working `nvidia-smi`) the default build from the configured
# index (CUDA); without one the CPU build (`+cpu`), from the configured sources when they have it
# (e.g. a local wheel folder), else from PyTorch's CPU index, so that pip pulls no CUDA wheels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
PIP := $(BIN)/python -m pip install -q
ifeq ($(HAS_GPU),yes)
INSTALL_TORCH := $(PIP) torch==$(TORCH_VERSION)
else
INSTALL_TORCH := $(PIP) torch==$(TORCH_VERSION)+cpu 2>/dev/null \
	|| $(PIP) --extra-index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION)+cpu
endif

.PHONY: demo test test-torch test-floor test-gpu bench bench-gpu venv clean conformance

venv: $(STAMP)

# The package (editable) with every extra, and the test suite's tools (requirements-test.txt).
DEV_INSTALL := -e '.[hf,lightning,plot]' -r requirements-test.txt

$(STAMP): pyproject.toml requirements-test.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(INSTALL_TORCH)
	$(PIP) $(DEV_INSTALL)
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fsdp_bridge demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The device-generic tests (engine parity, front-end parity, checkpoints, CUDA-only checks) on
# CUDA + NCCL. Needs a CUDA build of torch in .venv and at least one NVIDIA GPU; worlds larger
# than the number of GPUs are skipped by name (-rs lists them). See README "GPU".
GPU_TESTS ?= tests/test_gpu.py tests/test_engine_parity.py tests/frontends/test_parity_native.py \
	tests/checkpoint/test_checkpoints.py tests/integrations/test_native_checkpoints_cuda.py
# Then the engine's multi-rank worlds over gloo with CUDA tensors: gloo lets ranks share a GPU,
# so one GPU runs the world-2 and world-4 cases on the multi-rank CUDA path.
GPU_GLOO_TESTS ?= tests/test_engine_parity.py
test-gpu: $(STAMP)
	@$(BIN)/python -c "import sys, torch; ok = torch.cuda.is_available(); \
	ok or sys.exit('make test-gpu: no CUDA device: it runs the tests with FSDP_BRIDGE_DEVICE=cuda, ' \
	'which needs an NVIDIA GPU and a CUDA build of torch in .venv (torch ' + torch.__version__ + \
	', CUDA build: ' + str(torch.version.cuda) + '). Install the CUDA build of torch for ' \
	'your driver into .venv (https://download.pytorch.org/whl/), or run make test (CPU + gloo).')"
	FSDP_BRIDGE_DEVICE=cuda $(BIN)/python -m pytest -q -rs $(GPU_TESTS)
	FSDP_BRIDGE_DEVICE=cuda FSDP_BRIDGE_BACKEND=gloo $(BIN)/python -m pytest -q -rs $(GPU_GLOO_TESTS)

# The same GPU tests, then the CUDA bench, the CPU-offload memory figure and the framework
# examples at one rank, offline, on the Python already there (a container's or a cluster's CUDA build of torch; PY=... to pick one):
# no .venv, nothing installed, nothing downloaded, the package not installed (the repository goes
# first on PYTHONPATH). Each phase runs under a wall-clock timeout, about 7.5 minutes in all; the
# summary (summary.md, summary.json) and bounded raw logs go to GPU_CHECK_OUT, rewritten after
# every phase. Without make: $(PY) -m tests.gpu_check --out DIR (--smoke: the same on the CPU).
GPU_CHECK_OUT ?= gpu-check
.PHONY: gpu-check
gpu-check:
	$(PY) -m tests.gpu_check --out $(GPU_CHECK_OUT)
# The suite (or TESTS=...) against another torch, in its own environment .venv-torch-X, created
# or reused: torch $(TORCH_VERSION) from the package index (PyPI's default build is the CUDA one,
# several GB, which runs on the CPU), then the package with its extras and the test tools.
TORCH_ENV = .venv-torch-$(TORCH_VERSION)
TESTS ?=
test-torch:
	test -x $(TORCH_ENV)/bin/python || $(PY) -m venv $(TORCH_ENV)
	$(TORCH_ENV)/bin/python -m pip install -q torch==$(TORCH_VERSION) $(DEV_INSTALL)
	$(TORCH_ENV)/bin/python -c "import torch; print('torch', torch.__version__)"
	$(TORCH_ENV)/bin/python -m pytest -q -rs $(TESTS)

# The oldest torch the package supports (pyproject.toml's `torch>=`, kept equal by hand): every
# module imports, and a subset runs on it: world-2 engine and front-end parity, checkpoints
# across world sizes. The whole suite passed on it when the floor was set (see README); this
# subset keeps CI short.
TORCH_FLOOR := 2.11.0
FLOOR_TESTS := tests/test_torch_range.py tests/frontends/test_import_paths.py \
	tests/test_engine_parity.py::test_fp32_parity tests/test_engine_parity.py::test_tied_weights_stay_tied \
	tests/frontends/test_parity_native.py::test_fsdp1_matches_native \
	tests/frontends/test_parity_native.py::test_fsdp2_matches_native \
	tests/checkpoint/test_checkpoints.py tests/checkpoint/test_offline.py
test-floor:
	$(MAKE) test-torch TORCH_VERSION=$(TORCH_FLOOR) TESTS="$(FLOOR_TESTS)"

bench: $(STAMP)
	$(BIN)/python -m fsdp_bridge bench

# The conformance matrix's full sweep: every front-end of ours against native torch (or its
# reference) over a covering array of every axis (README "Conformance matrix"). It starts no
# new cell after CONFORMANCE_BUDGET seconds; CONFORMANCE_ARGS adds options (--axes, --json ...).
CONFORMANCE_BUDGET ?= 5400
CONFORMANCE_ARGS ?=
conformance: $(STAMP)
	$(BIN)/python -m fsdp_bridge compare --matrix --budget $(CONFORMANCE_BUDGET) $(CONFORMANCE_ARGS)

bench-gpu: $(STAMP)
	$(BIN)/python -m fsdp_bridge bench --device cuda

clean:
	rm -rf $(VENV) .venv-torch-* build *.egg-info
