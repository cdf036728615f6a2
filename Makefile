# Two commands on a fresh machine (Python >= 3.11 and make are all it needs):
#   make demo   install everything, then run the demo: W on 4 ranks of a local cluster,
#               one rank killed mid-run, recovery in process, a replacement joining
#   make test   install everything, then run ruff, mypy, the wire-reference check and the tests
# (make check: the same checks with only the quick tests, unit and property; make up runs
# just the local cluster; make types runs mypy; make bench runs the benchmarks.)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# Tests run in this many processes, each given whole modules (the e2e modules share a
# cluster per module). Most tests wait on processes they start (paced jobs, leases,
# recoveries): on a 2-core machine the whole suite used about one core on average with
# two, and three cut its time by 15 % (2026-11-27: 723 s -> 616 s); four loaded it to
# 656 s and made the 12,000-job burst three times slower.
WORKERS ?= 3
PYTEST := $(BIN)/pytest -n $(WORKERS) --dist loadfile --no-loadscope-reorder
# mypy reads each top-level folder as phalanx.<folder> through links here ([tool.mypy]).
TYPED  := build/typecheck/phalanx

.PHONY: install bytecode demo up typed-links types check test bench wire-doc gpu-wheels clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is the CPU wheel, pinned, that pip finds on this disk (uv does not look there,
	# and would resolve torch to a multi-GB CUDA build): pip fetches the file, uv installs
	# it with everything else (about 10 s in all here; pip alone took 85).
	$(BIN)/pip download --quiet --no-deps torch==2.13.0 -d build/wheels
	$(BIN)/pip install --quiet uv
	# Bytecode compiled now, once: where PYTHONDONTWRITEBYTECODE is set (these VMs, CI)
	# nothing is ever cached, and every process compiled torch from source again: 5 of
	# the 7 s of CPU a 10-step run took (2026-12-06), in each of the suite's hundreds.
	$(BIN)/uv pip install --quiet --compile-bytecode --python $(BIN)/python \
	    build/wheels/torch-2.13.0*.whl -e '.[dev]'
	touch $@

install: $(STAMP)

demo: install bytecode
	$(BIN)/phalanx demo $(ARGS)

up: install bytecode
	$(BIN)/phalanx up $(ARGS)

# The project's own bytecode, for the same reason as the install's; made every time
# (cheap: only files changed since are compiled again).
bytecode: install
	$(BIN)/python -m compileall -q -j 0 schemas bus runtime services bench examples tests

# Made every time (cheap): a checkout from before a folder joined the list gets its link.
typed-links:
	mkdir -p $(TYPED)
	for d in schemas bus runtime services bench examples; do ln -sfn ../../../$$d $(TYPED)/$$d; done

types: install typed-links
	$(BIN)/mypy

check: install bytecode typed-links
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m phalanx.schemas.reference --check docs/wire.md
	$(PYTEST) -m "not slow"

# mypy (about 20 s of one core on a clean clone, single-threaded) runs beside the tests
# rather than before them: its output after theirs, the target failing if either does.
test: install bytecode typed-links
	$(BIN)/ruff check .
	$(BIN)/python -m phalanx.schemas.reference --check docs/wire.md
	mkdir -p build
	$(BIN)/mypy > build/mypy.log 2>&1 & types=$$!; \
	$(PYTEST); tests=$$?; \
	wait $$types; typed=$$?; cat build/mypy.log; \
	test $$tests -eq 0 && test $$typed -eq 0

bench: install
	$(BIN)/python bench/bus.py
	$(BIN)/python bench/admission.py
	$(BIN)/python bench/detect.py
	$(BIN)/python bench/recovery.py
	$(BIN)/python bench/chaos.py

wire-doc: install
	$(BIN)/python -m phalanx.schemas.reference > docs/wire.md

# The wheels bench/gpu_run.sh installs on a GPU machine (Python 3.12, no network; docs/gpu.md).
gpu-wheels: install
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
	    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	    --platform manylinux2014_x86_64 --platform any -d build/gpu-wheels \
	    $$(grep -v -e '^#' -e '^nkeys' bench/gpu-wheels.txt)
	$(BIN)/pip wheel --quiet --no-deps -w build/gpu-wheels $$(grep '^nkeys' bench/gpu-wheels.txt)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache .hypothesis
