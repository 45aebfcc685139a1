# Two entry points: `make demo` (main job) and `make test` (the test suite). Both prepare .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: setup demo test test-cuda lint clean

$(BIN)/python:
	$(PY) -m venv --system-site-packages $(VENV)

# torch is installed only when the interpreter cannot import it already (2.13.0 is a local CPU wheel here).
$(VENV)/.ready: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.11"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.ready

demo: setup
	$(BIN)/bcg bench $(ARGS)

test: setup
	$(BIN)/python -m ruff check bcg tests benchmarks
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)

test-cuda: setup
	$(BIN)/python -m pytest -q -m cuda $(ARGS)

lint: setup
	$(BIN)/python -m ruff check bcg tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
