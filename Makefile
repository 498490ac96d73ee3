# Every target creates its own virtual environment; nothing is assumed installed
# but a Python >= 3.12 (found below, the newest supported one first: 3.13, then 3.12;
# override with `make PYTHON=/path/to/python3.12`).
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= $(shell for p in python3.13 python3.12 \
	$$(command -v pyenv >/dev/null 2>&1 && ls -d $$(pyenv root)/versions/3.1[23]*/bin/python3 2>/dev/null | sort -rV) python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null && { command -v $$p; break; }; done)
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: test unit demo bench lint services clean

$(STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "No Python >= 3.12 found: install one or run 'make PYTHON=/path/to/python3.12'"; exit 1; }
	scripts/system-packages.sh
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[postgres,mysql,test]'
	touch $(STAMP)

# The demo needs only the package itself (SQLite): no database drivers, no apt.
DEMO_STAMP := $(VENV)/.installed-demo
$(DEMO_STAMP): pyproject.toml
	@test -n "$(PYTHON)" || { echo "No Python >= 3.12 found: install one or run 'make PYTHON=/path/to/python3.12'"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e .
	touch $@

services:
	scripts/services.sh

# One lane per database plus one for the other Python/Django pairs (scripts/test-combos.sh):
# first every lane's tests but the `solo` ones, 2 lanes at a time (DBWORKER_TEST_LANES), then
# the solo tests one lane at a time (see scripts/test.sh).
test: $(STAMP) services lint
	PY=$(BIN)/python scripts/test.sh $(PYTEST_ARGS)

# The unit layer alone (tests/unit: the pure policies): no database server, no process,
# a few seconds. `make test` runs it too, in its SQLite runs only.
unit: $(STAMP)
	DBWORKER_TEST_DB=sqlite $(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check django_dbworker tests example_project benchmarks scripts
	@echo "ruff: clean"
	$(BIN)/mypy django_dbworker
	@echo "mypy: clean"

demo: $(DEMO_STAMP)
	@if [ -n "$$DBWORKER_DEMO_DATABASE_URL" ] && ! $(BIN)/python -c 'import psycopg' 2>/dev/null; then \
		echo "DBWORKER_DEMO_DATABASE_URL is set: installing the postgres extra (psycopg 3)"; \
		$(BIN)/pip install -q -e '.[postgres]'; fi
	$(BIN)/python example_project/demo.py

bench: $(STAMP)
	$(BIN)/pip install -q -r benchmarks/requirements.txt
	$(BIN)/python benchmarks/run.py $(ARGS)

clean:
	rm -rf $(VENV) .venv-combos .pytest_cache build dist *.egg-info
