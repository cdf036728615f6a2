# Two commands on a fresh machine (Python >= 3.11 and make are all it needs):
#   make up     install everything, then run the local cluster (Ctrl-C stops it)
#   make test   install everything, then run ruff, the wire-reference check and the tests
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install up test bench wire-doc clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel first, pinned, so nothing can resolve torch to a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)

up: install
	$(BIN)/phalanx up $(ARGS)

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m phalanx.schemas.reference --check docs/wire.md
	$(BIN)/pytest

bench: install
	$(BIN)/python bench/bus.py

wire-doc: install
	$(BIN)/python -m phalanx.schemas.reference > docs/wire.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
