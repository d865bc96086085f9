# Two entry points for a fresh machine (no pixi needed):
#   make demo   installs mokv into .venv and runs the demo on the CPU
#   make test   installs mokv and its test tools into .venv and runs every test
#               (tests/remote/ needs the redis-server binary: apt-get install redis-server)
#   make test-remote  only the shared-tier tests (each starts its own redis-server)
#   make bench  runs the benchmark suite (make bench-quick: a shorter run)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-remote bench bench-quick install

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/generate.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

test-remote: $(VENV)/.installed
	$(PY) -m pytest -q tests/remote

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/run.py

bench-quick: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/run.py --quick
