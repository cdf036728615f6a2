# Two commands on a fresh machine (Python >= 3.11 and make are all it needs):
#   make demo   install everything, then run the demo: W on 4 ranks of a local cluster,
#               one rank killed mid-run, recovery in process, a replacement joining
#   make test   install everything, then run ruff, the wire-reference check and the tests
# (make up runs just the local cluster; make bench runs the benchmarks.)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo up test bench wire-doc clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# The CPU wheel first, pinned, so nothing can resolve torch to a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/phalanx demo $(ARGS)

up: install
	$(BIN)/phalanx up $(ARGS)

test: install
	$(BIN)/ruff check .
	$(BIN)/python -m phalanx.schemas.reference --check docs/wire.md
	$(BIN)/pytest

bench: install
	$(BIN)/python bench/bus.py
	$(BIN)/python bench/admission.py
	$(BIN)/python bench/detect.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/chaos.py

wire-doc: install
	$(BIN)/python -m phalanx.schemas.reference > docs/wire.md

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
