# `make demo` and `make test` do all set-up: a .venv at the repository root with the project
# installed editable, its test extras, and torch (installed first, so no dependency pulls another build).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on these machines. Elsewhere, pick the build you want, e.g.
#   make test TORCH_SPEC='torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu'
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
DEMO_OUT ?= demo

# One intra-op thread per process: on 2-core machines two threads are 5-10x slower.
export OMP_NUM_THREADS := 1

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e ".[test]"
	touch $@

demo: $(STAMP)
	$(BIN)/sapp-hook demo --out $(DEMO_OUT)

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q --benchmark-disable

bench: $(STAMP)
	$(BIN)/python -m pytest -q tests/bench --benchmark-only --benchmark-columns=min,median,max,rounds

clean:
	rm -rf $(VENV) $(DEMO_OUT) .pytest_cache .benchmarks *.egg-info
