#!/usr/bin/env bash
# Runs mokv's GPU tests and GPU benchmark on a machine that has an NVIDIA GPU but no
# network and no MAX (docs/gpus.md, "Running on an NVIDIA GPU", says how it went).
#
#   benchmarks/gpu_machine.sh stage-check      # unpack MAX (once per machine), print what MAX sees
#   benchmarks/gpu_machine.sh tests [pytest args]   # the tests that need a GPU
#   benchmarks/gpu_machine.sh bench [args]     # benchmarks/bench_gpu_attention.py
#   benchmarks/gpu_machine.sh all              # tests and every GPU benchmark, in $OUT
#   benchmarks/gpu_machine.sh serve [limit_s]  # mokv serve beside max serve (bench_serving.py --gpu)
#   benchmarks/gpu_machine.sh pipelines [arch ...]  # MAX's pipelines per cache kind on mokv vs MAX's manager
#   benchmarks/gpu_machine.sh shared-budget    # cache groups' shared device allocation (views of one buffer)
#   benchmarks/gpu_machine.sh deepseek         # MAX's deepseekV2 (MLA) pipeline on mokv vs MAX's manager
#   benchmarks/gpu_machine.sh llama_fp8        # MAX's Llama with an FP8 KV cache on mokv vs MAX's manager
#
# MAX arrives as site-packages built for Python 3.12 (`pip install --target`), xz-compressed
# and split into parts by benchmarks/gpu_stage.sh; they are unpacked into
# /tmp/site; .gpu-stage/local carries mokv's kernel package, built for the current Mojo
# sources, and the test plugin Sybil.
set -uo pipefail
SITE=/tmp/site
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ ! -d "$SITE/max" ]; then
  mkdir -p "$SITE"
  if command -v xz >/dev/null; then
    cat /tmp/stage/site.tar.xz.* | xz -dc -T0 | tar xf - -C "$SITE" || exit 1
  else
    cat /tmp/stage/site.tar.xz.* | python3 -c 'import lzma, sys, shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' \
      | tar xf - -C "$SITE" || exit 1
  fi
fi
LOCAL=$PWD/.gpu-stage/local
export PYTHONPATH=$SITE:$LOCAL/site:$PWD/python:$PWD MOKV_CACHE_DIR=$LOCAL/mokv-cache PYTHONUNBUFFERED=1
ln -sfn graphs mokv_graphs
# Every test that needs a GPU (they skip elsewhere), and the GPU page of the docs.
GPU_TESTS=(tests/ops/test_on_gpu.py tests/model/test_model_on_gpu.py
           tests/cache/test_page_copy.py::test_accelerator_round_trip_through_pinned_host_pages docs/gpus.md)
cmd=${1:-stage-check}
shift || true
case "$cmd" in
  stage-check)
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c 'import max, max.driver as d; print("MAX", max.__file__, "accelerators:", d.accelerator_count()); print(d.Accelerator())'
    ;;
  tests)  # every test that needs a GPU (they skip elsewhere)
    [ $# -gt 0 ] || set -- "${GPU_TESTS[@]}"
    python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log"
    ;;
  bench)
    python3 benchmarks/bench_gpu_attention.py "$@" --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.log"
    ;;
  all)  # the tests and the benchmarks: compiling side by side, timing one at a time
    limit=${1:-480}  # seconds for the whole, so that the results come back
    lock=/tmp/gpu-timing.lock
    mkdir -p "$OUT/json" /tmp/logs
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > /tmp/logs/0-gpu.log
    # The tests hold the lock for their whole run, so the benchmarks time after them.
    (flock "$lock" timeout "$limit" python3 -m pytest -q -p no:cacheprovider -n 3 --dist loadfile "${GPU_TESTS[@]}" \
      > "$OUT/tests.log" 2>&1; cp "$OUT/tests.log" /tmp/logs/1-tests.log) &
    sleep 3
    for g in 1 4 8; do
      timeout "$limit" python3 benchmarks/bench_gpu_attention.py --quick --bf16 --groups "$g" \
        --lock "$lock" --json "$OUT/json/gqa$g.json" > "/tmp/logs/2-gqa$g.log" 2>&1 &
    done
    timeout "$limit" python3 benchmarks/bench_gpu_attention.py --qkv --groups none --lock "$lock" \
      --json "$OUT/json/qkv.json" > /tmp/logs/3-qkv.log 2>&1 &
    timeout "$limit" python3 benchmarks/bench_gpu_serving.py --lock "$lock" \
      --json "$OUT/json/serving.json" > /tmp/logs/4-serving.log 2>&1 &
    wait
    # $OUT/tests.log has the whole test output; this summary, the end of each log.
    for f in /tmp/logs/*.log; do echo "=== $f"; grep -v -i "warning" "$f" | tail -60; done > "$OUT/all.log"
    cat "$OUT/all.log"
    ;;
  serve)  # MAX's server with its own and with mokv's KV manager, bfloat16 weights, MAX's GPU defaults
    limit=${1:-540}
    timeout "$limit" python3 benchmarks/bench_serving.py --quick --gpu --json "$OUT/serve.json" \
      > "$OUT/serve.log" 2>&1
    echo "rc=$?"; grep -v -i "warning" "$OUT/serve.log" | tail -40
    ;;
  pipelines)  # MAX's own pipelines (sliding window, ...) on mokv's manager against MAX's own
    timeout 560 python3 benchmarks/gpu/pipelines.py "$@" --limit 540 --json "$OUT/pipelines.json" \
      2>&1 | tee "$OUT/pipelines.log" | grep -v -i "warning" | tail -40
    ;;
  shared-budget)
    timeout 120 python3 benchmarks/gpu/shared_budget.py 2>&1 | tee "$OUT/shared_budget.log"
    ;;
  deepseek)
    timeout 560 python3 benchmarks/gpu/deepseek.py --json "$OUT/deepseek.json" 2>&1 | tee "$OUT/deepseek.log" \
      | grep -v -i warning | tail -40
    ;;
  llama_fp8)
    timeout 300 python3 benchmarks/gpu/llama_fp8.py --json "$OUT/llama_fp8.json" 2>&1 | tee "$OUT/llama_fp8.log" \
      | grep -v -i warning | tail -40
    ;;
esac
