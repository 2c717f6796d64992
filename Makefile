# CPU machines: torch is pinned to the CPU build the install path expects.
# GPU machines: `make install TORCH_SPEC="torch==2.13.0"` with pip pointed at a CUDA wheel
# index (PIP_EXTRA_INDEX_URL), or install torch first and run `make install TORCH_SPEC=`.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: install run test check lint bench chaos

$(BIN)/kiln: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(if $(TORCH_SPEC),$(BIN)/pip install -q "$(TORCH_SPEC)")
	$(BIN)/pip install -q -e ".[dev,postgres]"
	touch $(BIN)/kiln

install: $(BIN)/kiln

run: install
	$(BIN)/kiln up

test: install
	$(BIN)/python -m pytest -q --durations=15

# The fast lane, for every change: lint, the import contracts, the type check ([tool.mypy] in
# pyproject.toml), and the tests that reach no server and start no process (marked unit by
# tests/conftest.py). `make test` runs them all.
check: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -m unit --durations=10

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The benchmark suite: bench/REPORT.md with its figures (JSON, PNG) under bench/results/. The
# other scripts in bench/ each measure one thing against its own baseline, run by hand.
bench: install
	$(BIN)/python bench/suite.py --out bench/results --report bench/REPORT.md

# The reliability soak (not part of `make test`): about 11 minutes on 2 cores; needs PostgreSQL
# on 127.0.0.1:5432 and redis-server on PATH (it starts a private one). Then the worker group's
# fault scenarios and whole-group tests on both database backends (`make test` runs them on
# PostgreSQL), with the slowest scenarios `make test` leaves out (marked chaos: 83 of them,
# counting parameters, some on both backends): 131 tests in all.
chaos: install
	$(BIN)/python bench/chaos.py
	KILN_CHAOS=1 KILN_FAULTS_ON_EVERY_BACKEND=1 $(BIN)/python -m pytest -q --durations=15 \
		-m "fault or group or chaos"
