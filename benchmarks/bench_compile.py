"""Compile cost: time to build and load a graph that uses mokv's kernels.

The graph is the small decoder of `graphs/` (`mokv_graphs.DecoderModel` over a paged
mokv cache, on the CPU); without it, the attention graph of `bench_attention`. Each
measurement runs in a fresh subprocess, so nothing is cached in memory:

- **cold**: empty `MODULAR_CACHE_DIR` and `MOKV_CACHE_DIR` (mokv's Mojo package is
  precompiled, then MAX compiles the whole graph);
- **warm**: the same cache directories again, as the cold run left them.

Phases: `kernels_s` (mokv's `kernels_path()`: the Mojo precompile when cold),
`build_s` (Python graph construction alone), `build_and_load_s` (graph construction
plus `session.load`: the compile, or a cache hit), `first_step_s` (first execution).
`--quick` only measures warm, with the user's own cache directories (so it is cold,
and takes minutes, the first time).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, sys, time
t = {}
t0 = time.perf_counter()
import numpy as np
from max.driver import CPU
from max.engine import InferenceSession
import mokv, mokv.ops
t["import_s"] = time.perf_counter() - t0
t0 = time.perf_counter(); mokv.ops.kernels_path(); t["kernels_s"] = time.perf_counter() - t0
session = InferenceSession(devices=[CPU()])
try:
    from mokv_graphs import DecoderConfig, DecoderModel
except ImportError:
    DecoderModel = None
if DecoderModel is not None:
    t["graph"] = "mokv_graphs.DecoderModel (paged)"
    config = DecoderConfig()
    params = config.kv_params("paged", page_size=128)
    manager = mokv.PagedKVCacheManager(params, 8, config.max_seq_len, config.num_layers, [CPU()],
                                       session, 64 * params.bytes_per_page(config.num_layers))
    import mokv_graphs.model as m
    from mokv_graphs import build_decoder_graph
    t0 = time.perf_counter()
    (symbols,) = manager.input_symbols()
    build_decoder_graph(config, params, symbols, m.DeviceRef.from_device(CPU()))
    t["build_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = DecoderModel(config, manager, session)  # builds the graph again, then loads it
    t["build_and_load_s"] = time.perf_counter() - t0
    ctx = mokv.TextContext(np.arange(16))
    manager.external_claim(ctx.request_id)
    t0 = time.perf_counter(); model.step([ctx]); t["first_step_s"] = time.perf_counter() - t0
else:
    sys.path.insert(0, sys.argv[1])
    from bench_attention import MokvSide
    t["graph"] = "bench_attention mokv-paged"
    t0 = time.perf_counter(); side = MokvSide(session, "paged")
    t["build_and_load_s"] = time.perf_counter() - t0
    args = side.inputs([64], [1])
    t0 = time.perf_counter(); side.model.execute(*args)
    t["first_step_s"] = time.perf_counter() - t0
print(json.dumps(t))
"""


def _child(env_over: dict) -> dict:
    from bench_managers import child_env

    env = {**child_env(), **env_over}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=590)
    if proc.returncode:
        return {"error": proc.stderr[-1500:]}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["total_s"] = time.perf_counter() - t0
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}


def run(quick: bool = False, progress=None) -> dict:
    out = {}
    if quick:
        out["warm"] = _child({})
        if progress:
            progress()
        return out
    with tempfile.TemporaryDirectory(prefix="mokv-bench-") as tmp:
        env = {"MODULAR_CACHE_DIR": str(Path(tmp, "modular")), "MOKV_CACHE_DIR": str(Path(tmp, "mokv"))}
        for name in ("cold", "warm"):
            out[name] = _child(env)
            if progress:
                progress()
    return out


def plan_size(quick: bool) -> int:
    return 1 if quick else 2


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=1))
