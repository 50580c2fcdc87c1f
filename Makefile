# Two commands on a fresh machine (Python 3.11): `make demo` (set up + main job) and `make test` (set up + tests).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -r requirements/cpu.txt
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/python -m openflash.kernels  # builds the native kernels (or says why the PyTorch path will serve)
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/openflash demo

# One pytest worker per core (at most 8), a test file per worker at a time: module fixtures are built once. Files go
# out in the order tests/conftest.py sorts them, heaviest first (xdist would otherwise order them by test count).
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses 8 --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) runs .pytest_cache
