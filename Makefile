# Set-up, demo and tests. `make demo` and `make test` create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test lint bench head clean

setup: $(STAMP)

# torch is pinned first: 2.13.0 is the CPU build this project is measured on (a bare range
# would pull a multi-GB CUDA build on a CPU-only machine); the package itself declares a range.
# --no-cache-dir: a fresh machine gains nothing from a copy of every wheel, and disk may be short.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-cache-dir --upgrade pip
	$(PY) -m pip install --quiet --no-cache-dir "torch==2.13.0"
	$(PY) -m pip install --quiet --no-cache-dir -e ".[test,serve,bench,ray]"
	@touch $(STAMP)

demo: setup
	$(PY) -m understudy.demo

test: setup
	$(PY) -m ruff check src tests
	$(PY) -m mypy
	$(PY) -m pytest -q -rs

bench: setup
	$(PY) -m understudy.cli bench --compare hf

# method=eagle: train the default target's own prediction head (resumable; docs/eagle.md)
head: setup
	$(PY) -m understudy.cli train-head

lint: setup
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
