# contbatch: `make demo` runs the main job, `make test` the whole suite.
# Both bootstrap .venv on first use (idempotent: re-run only when pyproject.toml changes).
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast compiled lint typecheck docs clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: the CPU build this machine type has on disk, never a CUDA download
	$(BIN)/pip install --quiet --disable-pip-version-check torch==2.13.0
	$(BIN)/pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# the scheduler core and the simulator's hot loop compiled with mypyc (src/contbatch/compiled.py):
# built on first use and whenever one of their sources changed, else a check of a few ms
compiled: $(STAMP)
	$(BIN)/python -m contbatch.compiled_build

demo: compiled
	$(BIN)/contbatch compare --trace seed --cost unit:8

lint: $(STAMP)
	$(BIN)/ruff check .

typecheck: $(STAMP)
	$(BIN)/mypy

# the documentation site (mkdocs.yml) into site/; --strict: a broken link or a missing page fails
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: compiled lint typecheck docs
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# the inner loop, under 2 minutes: ruff, then the suite without the tests marked slow, with the
# `fast` Hypothesis profile (10 examples a property; tests/conftest.py); no mypy, no docs
test-fast: compiled lint
	HYPOTHESIS_PROFILE=fast $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

clean:
	rm -rf $(VENV) src/contbatch/_compiled .pytest_cache .mypy_cache .ruff_cache .hypothesis
