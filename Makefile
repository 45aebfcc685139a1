# Two entry points: `make demo` (runs `bcg bench`) and `make test` (ruff and the test suite). Both first prepare
# .venv, a self-contained virtual environment: everything in it comes from the package registry (or a local torch
# wheel), nothing from the site-packages of the interpreter that made it.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
ARGS ?=
# torch. TORCH_SPEC is what pip installs. TORCH_INDEX, when set, is the one index pip takes it from, e.g.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu for PyTorch's CPU-only build (about 200 MB instead of the
# registry's CUDA build, about 3 GB with its NVIDIA libraries).
TORCH_SPEC ?= torch>=2.11
TORCH_INDEX ?=
# With neither set, a torch wheel that pip finds without a download (this project's development machines keep a
# CPU build of 2.13.0 in pip's find-links) is taken instead of downloading one.
TORCH_LOCAL ?= torch==2.13.0

.PHONY: setup demo test test-cuda lint clean

$(BIN)/python:
	@echo "bcg setup: creating $(VENV) with $(PY) (self-contained: no system site-packages)"
	$(PY) -m venv $(VENV)

$(VENV)/.torch: | $(BIN)/python
	@if grep -qs "include-system-site-packages = true" $(VENV)/pyvenv.cfg; then \
	  echo "bcg setup: warning: $(VENV) sees the system site-packages (made by an older Makefile); 'make clean' rebuilds it self-contained"; fi
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "bcg setup: torch is already installed in $(VENV)"; \
	elif [ -n "$(TORCH_INDEX)" ]; then \
	  echo "bcg setup: installing $(TORCH_SPEC) from $(TORCH_INDEX)"; \
	  $(BIN)/pip install --index-url "$(TORCH_INDEX)" "$(TORCH_SPEC)"; \
	elif [ "$(origin TORCH_SPEC)" = file ] && \
	     $(BIN)/pip install --dry-run --no-index --no-deps "$(TORCH_LOCAL)" >/dev/null 2>&1; then \
	  echo "bcg setup: installing $(TORCH_LOCAL) from the wheel on this machine"; \
	  $(BIN)/pip install "$(TORCH_LOCAL)"; \
	else \
	  echo "bcg setup: downloading $(TORCH_SPEC) from the package registry. On Linux that is the CUDA build, about"; \
	  echo "  3 GB with its NVIDIA libraries (5-6 GB on disk), several minutes. For the CPU-only build (~200 MB)"; \
	  echo "  instead, interrupt (Ctrl-C) and run: make $(or $(MAKECMDGOALS),demo) TORCH_INDEX=https://download.pytorch.org/whl/cpu"; \
	  $(BIN)/pip install "$(TORCH_SPEC)"; \
	fi
	touch $@

$(VENV)/.demo: pyproject.toml $(VENV)/.torch
	@echo "bcg setup: installing bcg-prefill (editable) with matplotlib for the plots"
	$(BIN)/pip install -e ".[bench]"
	touch $@

$(VENV)/.test: pyproject.toml $(VENV)/.torch
	@echo "bcg setup: installing bcg-prefill (editable) with the test tools (pytest, hypothesis, ruff, transformers)"
	$(BIN)/pip install -e ".[test]"
	touch $@

setup: $(VENV)/.test

demo: $(VENV)/.demo
	$(BIN)/bcg bench $(ARGS)
	@echo "bcg: again with other flags: .venv/bin/bcg bench --help, or make demo ARGS='--model tiny-moe --runs 40'"

test: $(VENV)/.test
	$(BIN)/python -m ruff check bcg tests benchmarks scripts
	$(BIN)/python -m pytest -q -p no:cacheprovider $(ARGS)

test-cuda: $(VENV)/.test
	$(BIN)/python -m pytest -q -m cuda $(ARGS)

lint: $(VENV)/.test
	$(BIN)/python -m ruff check bcg tests benchmarks scripts

clean:
	rm -rf $(VENV) build *.egg-info
