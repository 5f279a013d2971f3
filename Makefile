# Two entry points: `make demo` and `make test`. Both create or reuse .venv.
# On a machine without a GPU we install torch's CPU build first (pinned), so the
# package's own `torch>=` range is already satisfied and pip pulls no CUDA wheels.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH_CPU ?= torch==2.13.0

.PHONY: demo test bench venv clean

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

bench: $(STAMP)
	$(BIN)/python -m fsdp_bridge bench

clean:
	rm -rf $(VENV) build *.egg-info
