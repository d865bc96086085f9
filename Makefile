# Two entry points for a fresh machine (no pixi needed):
#   make demo   installs mokv into .venv and runs the demo on the CPU
#   make serve  MAX's own OpenAI server with a mokv KV cache (`mokv serve`), serving a
#               tiny local Llama on 127.0.0.1:8000 (SERVE_PORT=...); Ctrl-C stops it
#   make test   installs mokv, its test tools and torch's CPU build into .venv (and, as
#               root on Debian, the redis-server package that tests/remote/ starts) and
#               runs every test (PYTEST_ARGS="--cpu-target znver3": every CPU kernel
#               compiled for AVX2)
#   make test-remote  only the shared-tier tests (each starts its own redis-server, or a
#               Redis Cluster of six; make test runs them too)
#   make test-consumers  installs vLLM's event classes and NVIDIA Dynamo's KV indexer (CPU
#               builds) and runs tests/consumers/: routers others wrote read mokv's events
#   make test-hf  only the MLA decoder's tests, Hugging Face's DeepSeek-V2 on the same
#               weights among them (make test runs them too)
#   make test-virtual-gpu  every compile for a virtual GPU (tests/ops/test_virtual_gpu.py),
#               with MAX's own Llama-style layers on a mokv cache for sm_90 (minutes:
#               the one make test leaves out)
#   make test-max-pipeline  MAX's own Llama pipeline generating on a mokv cache, against
#               MAX's own manager (minutes: outside make test)
#   make bench  runs the benchmark suite (make bench-quick: a shorter run), with vLLM's
#               KV cache manager beside mokv's and MAX's (make bench-vllm installs it)
#   make docs   builds the docs site (docs/, mkdocs.yml) into site/, warnings as errors
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo serve test test-remote test-consumers test-hf test-virtual-gpu test-max-pipeline bench bench-quick bench-vllm docs install redis-server

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

SERVE_PORT ?= 8000
serve: $(VENV)/.installed
	$(PY) examples/serve.py --port $(SERVE_PORT)

# torch for transformers' DeepSeek-V2 (the hf extra: tests/model/test_mla_decoder.py checks
# the MLA decoder against it). PyPI's Linux torch is a CUDA build (GBs of NVIDIA libraries);
# PyTorch's CPU index holds the same version as 2.13.0+cpu (190 MB), which pip prefers (a
# local version sorts above the plain one). An http(s) index is probed once (5 s at most) and left
# out, with a one-line note, where it is out of reach: pip would retry it for about a minute,
# printing a warning per try, and find the wheel elsewhere (find-links, a mirror) anyway.
# TORCH_CPU_INDEX= never uses it.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_ARGS = $(if $(TORCH_CPU_INDEX),$(shell $(PYTHON) -c \
  "import sys, urllib.request as r; u = sys.argv[1]; u.startswith('http') and r.urlopen(u + '/torch/', timeout=5)" \
  '$(TORCH_CPU_INDEX)' >/dev/null 2>&1 && echo --extra-index-url '$(TORCH_CPU_INDEX)' \
  || echo "PyTorch's CPU index $(TORCH_CPU_INDEX) is out of reach: torch from pip's other sources" >&2))
$(VENV)/.hf: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[hf]" $(TORCH_INDEX_ARGS)
	touch $@

test: $(VENV)/.hf redis-server
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-remote: $(VENV)/.installed redis-server
	$(PY) -m pytest -q tests/remote tests/tiers/test_remote.py tests/tiers/test_remote_cluster.py \
	  tests/events/test_shared_presence.py

# Routers that others wrote, fed mokv's events (tests/consumers/, pytest marker
# `consumers`): vllm's kv_events classes need torch (the CPU build from PyTorch's CPU index,
# as for .hf: PyPI's Linux torch is a multi-GB CUDA build) and vllm --no-deps with what its import chain loads;
# Dynamo's standalone indexer ships in the ai-dynamo-runtime wheel. Never part of `make test`
# (without them those tests skip, saying how to install them).
$(VENV)/.consumers: $(VENV)/.installed tests/consumers/requirements.txt
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_INDEX_ARGS)
	$(PY) -m pip install -q --no-deps -r tests/consumers/requirements.txt
	touch $@

test-consumers: $(VENV)/.consumers
	$(PY) -m pytest -q -m consumers tests/consumers

test-hf: $(VENV)/.hf
	$(PY) -m pytest -q tests/model/test_mla_decoder.py

# The whole file: its -m replaces pyproject.toml's, which deselects max_virtual_gpu.
test-virtual-gpu: $(VENV)/.installed
	$(PY) -m pytest -q -m "not max_pipeline" tests/ops/test_virtual_gpu.py

# Marked max_pipeline (pyproject.toml): deselected by make test, selected here.
test-max-pipeline: $(VENV)/.installed
	$(PY) -m pytest -q -m max_pipeline tests/model/test_max_pipeline.py

# The test extra includes the docs extra (mkdocs-material); tests/docs/ builds it too.
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict

# The benchmark's peers: MAX's manager (the bench extra) and vLLM's v1 KVCacheManager, which
# runs on the CPU from torch (CPU build) and vllm installed --no-deps with only what its
# import chain needs (benchmarks/requirements-vllm.txt). Never installed by `make test`.
$(VENV)/.bench: $(VENV)/.installed benchmarks/requirements-vllm.txt
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) -m pip install -q torch==2.13.0 $(TORCH_INDEX_ARGS)
	$(PY) -m pip install -q --no-deps -r benchmarks/requirements-vllm.txt
	touch $@

bench-vllm: $(VENV)/.bench

bench: $(VENV)/.bench
	$(PY) benchmarks/run.py

bench-quick: $(VENV)/.bench
	$(PY) benchmarks/run.py --quick
