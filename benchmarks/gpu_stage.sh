#!/usr/bin/env bash
# Packs MAX 26.7 / Mojo 1.2 and mokv's own dependencies for a GPU machine that has Python
# 3.12 but no network (run here, in the repository root; docs/gpus.md, "Running on an NVIDIA GPU").
#
# The wheels are installed into a site-packages tree here (`pip install --target`, for
# Python 3.12), xz-compressed (650 MB -> 175 MB: xz packs the shared libraries ~30% tighter
# than the wheels' zip) and split into parts of 59 MB, one per device call (a call carries
# 64 MiB with the working tree): .gpu-stage/x1, x2, x3. On the machine,
# benchmarks/gpu_machine.sh unpacks /tmp/stage/site.tar.xz.* into /tmp/site.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
stage=.gpu-stage
mkdir -p .git/info
grep -qx "/$stage/" .git/info/exclude 2>/dev/null || echo "/$stage/" >> .git/info/exclude
mkdir -p "$stage/wheels"
platforms=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
py312=(--python-version 3.12 --implementation cp --only-binary=:all:)
python3 -m pip download -q --no-deps "${py312[@]}" "${platforms[@]}" -d "$stage/wheels" \
  max==26.7.0 max-core==26.7.0 mojo-compiler==1.2.0 max-mojo-libs==26.7.0 max-shmem-libs==26.7.0 \
  mojo-compiler-mojo-libs==1.2.0 msgspec taskgroup exceptiongroup \
  pyzmq redis hiredis pydantic pydantic-core annotated-types typing-inspection
# `max serve` and `mokv serve` (max[serve]): what the GPU image (KINDS.md's list) lacks, at the
# versions installed here, the ones this machine's suite ran against. The image's own
# transformers (5.17) is newer than max[serve]'s pin (<5.13); MAX 26.7 runs on it.
serve_deps=(asgiref av fastapi gguf googleapis-common-protos hf-transfer httpcore2 httpx2
            importlib-metadata jiter jsonschema jsonschema-specifications openai opentelemetry-api
            opentelemetry-exporter-otlp-proto-common opentelemetry-exporter-otlp-proto-grpc
            opentelemetry-exporter-otlp-proto-http opentelemetry-exporter-prometheus opentelemetry-proto
            opentelemetry-sdk opentelemetry-semantic-conventions pydantic-settings python-dotenv
            python-json-logger referencing rpds-py sniffio sse-starlette starlette truststore uvicorn)
mapfile -t serve_pins < <(python3 -c 'import sys; from importlib.metadata import version
for n in sys.argv[1:]: print(f"{n}=={version(n)}")' "${serve_deps[@]}")
python3 -m pip download -q --no-deps "${py312[@]}" "${platforms[@]}" -d "$stage/wheels" "${serve_pins[@]}"
rm -rf "$stage/site" "$stage"/x* "$stage/site.tar.xz"
python3 -m pip install -q --no-deps --no-index "${py312[@]}" "${platforms[@]}" --target "$stage/site" \
  "$stage"/wheels/*.whl
# Left out: bytecode caches and the AMD transfer plugins. The `mojo` compiler stays (30 MB
# packed): MAX finds its SDK by modular/bin/mojo, and its own Python KV-cache ops build a
# Mojo module with it on first use.
find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
rm -rf "$stage"/site/modular/lib/nixl/rocm*
# .gpu-stage/local travels with the call that runs the tests: mokv's kernel package for
# the current Mojo sources (no build there), and the suite's test plugin (Sybil).
rm -rf "$stage/local"
MOKV_CACHE_DIR="$root/$stage/local/mokv-cache" python3 -c 'import mokv.ops; print(mokv.ops.kernels_path())'
python3 -m pip install -q --no-deps --target "$stage/local/site" sybil
tar cf - -C "$stage/site" . | xz -9 -T0 > "$stage/site.tar.xz"
split -b 59000000 -d -a 1 "$stage/site.tar.xz" "$stage/site.tar.xz."
n=0
for part in "$stage"/site.tar.xz.[0-9]; do
  n=$((n + 1)); mkdir -p "$stage/x$n"; mv "$part" "$stage/x$n/"
done
echo "Staged $n parts. Device calls, back to back (the machine goes back after ~30 s idle):"
for i in $(seq 1 $((n - 1))); do
  echo "  run(carry=[\"$stage/x$i\"], command=\"mkdir -p /tmp/stage && cp $stage/x$i/* /tmp/stage/\")"
done
echo "  run(carry=[\"$stage/x$n\", \"$stage/local\"], timeout_s=590, command=\"cp $stage/x$n/* /tmp/stage/ &&" \
  "bash benchmarks/gpu_machine.sh stage-check && bash benchmarks/gpu_machine.sh all 480\")"
echo "  run(timeout_s=590, command=\"bash benchmarks/gpu_machine.sh serve 540\")   # warm: /tmp/site is still there"
echo "($stage/local: mokv's kernel package and Sybil; results come back from \$OUT)"
