# Two entry points for a fresh machine (no pixi needed):
#   make demo   installs mokv into .venv and runs the demo on the CPU
#   make test   installs mokv and its test tools into .venv (and, as root on Debian, the
#               redis-server package that tests/remote/ starts) and runs every test
#   make test-remote  only the shared-tier tests (each starts its own redis-server)
#   make test-virtual-gpu  MAX's own layers on a mokv cache, compiled for a virtual sm_90
#               (minutes: outside make test)
#   make test-max-pipeline  MAX's own Llama pipeline generating on a mokv manager (installs
#               MAX's pipeline dependencies, the max-pipeline extra; minutes: outside make test)
#   make bench  runs the benchmark suite (make bench-quick: a shorter run)
#   make docs   builds the docs site (docs/, mkdocs.yml) into site/, warnings as errors
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-remote test-virtual-gpu test-max-pipeline bench bench-quick docs install redis-server

# The shared-tier tests start their own redis-server (only the binary is used; a service
# the package may start is never contacted). Under CI=true they fail without it.
redis-server:
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else \
	    echo "redis-server is missing: install the redis-server package (tests/remote/ skip without it)"; \
	  fi; }

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) examples/generate.py

test: $(VENV)/.installed redis-server
	$(PY) -m pytest -q

test-remote: $(VENV)/.installed redis-server
	$(PY) -m pytest -q tests/remote tests/tiers/test_remote.py

# Marked max_virtual_gpu (pyproject.toml): deselected by make test, selected here.
test-virtual-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m max_virtual_gpu tests/ops/test_virtual_gpu.py

$(VENV)/.max-pipeline: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[max-pipeline]"
	touch $@

# Marked max_pipeline (pyproject.toml): deselected by make test, selected here.
test-max-pipeline: $(VENV)/.max-pipeline
	$(PY) -m pytest -q -m max_pipeline tests/model/test_max_pipeline.py

# The test extra includes the docs extra (mkdocs-material); tests/docs/ builds it too.
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict

bench: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/run.py

bench-quick: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/run.py --quick
