#!/usr/bin/env bash
# Runs mokv's GPU tests and GPU benchmark on a machine that has an NVIDIA GPU but no
# network and no MAX (docs/gpus.md, "Running on an NVIDIA GPU", says how it went).
#
#   benchmarks/gpu_machine.sh stage-check      # unpack MAX (once per machine), print what MAX sees
#   benchmarks/gpu_machine.sh tests [pytest args]   # the tests that need a GPU
#   benchmarks/gpu_machine.sh bench [args]     # benchmarks/bench_gpu_attention.py
#
# MAX arrives as site-packages built for Python 3.12 (`pip install --target`), xz-compressed
# and split into parts by benchmarks/gpu_stage.sh; they are unpacked into
# /tmp/site. The `mojo` driver is a Python script, and mokv runs it with PYTHONPATH
# removed (mojo_package._clean_env), so a wrapper on PATH puts /tmp/site back for it.
set -uo pipefail
SITE=/tmp/site
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d "$SITE/max" ]; then
  mkdir -p "$SITE"
  cat /tmp/stage/site.tar.xz.* | python3 -c 'import lzma, sys, shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
    | tar xf - -C "$SITE" || exit 1
fi
mkdir -p /tmp/bin
printf '#!/bin/sh\nPYTHONPATH=%s exec python3 %s/bin/mojo "$@"\n' "$SITE" "$SITE" > /tmp/bin/mojo
chmod +x /tmp/bin/mojo
export PATH=/tmp/bin:$PATH PYTHONPATH=$SITE:$PWD/python:$PWD MOKV_CACHE_DIR=/tmp/mokv-cache PYTHONUNBUFFERED=1
ln -sfn graphs mokv_graphs
cmd=${1:-stage-check}
shift || true
case "$cmd" in
  stage-check)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c 'import max, max.driver as d; print("MAX", max.__file__, "accelerators:", d.accelerator_count()); print(d.Accelerator())'
    ;;
  tests)  # every test that needs a GPU (they skip elsewhere)
    [ $# -gt 0 ] || set -- tests/ops/test_on_gpu.py \
      tests/managers/test_host_tier.py::test_accelerator_round_trip_through_pinned_host_pages
    python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log"
    ;;
  bench)
    python3 benchmarks/bench_gpu_attention.py "$@" --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.log"
    ;;
esac
