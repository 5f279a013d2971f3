# Two entry points: `make demo` and `make test`. Both create or reuse .venv.
# On a machine without a GPU we install torch's CPU build first (pinned), so the
# package's own `torch>=` range is already satisfied and pip pulls no CUDA wheels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.0

.PHONY: demo test test-gpu bench bench-gpu venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_CPU)
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m fsdp_bridge demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The device-generic tests (engine parity, front-end parity, checkpoints, CUDA-only checks) on
# CUDA + NCCL. Needs a CUDA build of torch in .venv and at least one NVIDIA GPU; worlds larger
# than the number of GPUs are skipped by name (-rs lists them). See README "GPU".
GPU_TESTS ?= tests/test_gpu.py tests/test_engine_parity.py tests/frontends/test_parity_native.py \
	tests/checkpoint/test_checkpoints.py
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

bench: $(STAMP)
	$(BIN)/python -m fsdp_bridge bench

bench-gpu: $(STAMP)
	$(BIN)/python -m fsdp_bridge bench --device cuda

clean:
	rm -rf $(VENV) build *.egg-info
