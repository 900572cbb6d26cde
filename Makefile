# The README's two commands: `make demo` and `make test`. Both work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install dataset lint nvcc-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

dataset:
	@sh scripts/ensure-dataset.sh

demo: install dataset
	$(VENV)/bin/convolab classify --images 1000

test: install dataset
	$(VENV)/bin/python -m pytest -q

lint: install
	$(VENV)/bin/ruff check src tests benchmarks

nvcc-check: install
	$(VENV)/bin/python -m pytest -q tests/test_nvcc_compile.py

clean:
	rm -rf $(VENV) build *.egg-info
