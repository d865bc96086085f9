"""The QKV projection on the CPU: mokv's fused_qkv_matmul against MAX's matmul.

Llama-3-8B shapes (hidden 4096 -> 32 query + 2 x 8 KV heads of 128, float32): the
weights are 100 MB, so one decode token is a memory-bound pass over them and a long
prefill chunk is compute bound. mokv's op writes K and V into a paged cache as well;
MAX's side is the bare `hidden @ wqkv.T` it would need before a
separate cache write. Each timing is the median of repeated `model.execute` calls,
the two sides interleaved call by call (the minimum is kept too). `cpu_ms` is the
median process CPU time per call (both cores' work, spinning included): on a box
shared with other jobs the wall time depends on how much of the two cores the
process got, the CPU time much less so.
(mokv's op also takes no RoPE table here.)
"""

from __future__ import annotations

import time

import mokv
import mokv.ops  # noqa: F401
import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType, ops

HIDDEN, HKV, GROUP, D, PAGE = 4096, 8, 4, 128, 128
N_Q = HKV * GROUP
FEATURES = (N_Q + 2 * HKV) * D


def tokens(quick: bool) -> list[int]:
    return [1, 512] if quick else [1, 16, 128, 512]


def _mokv_graph(params, hidden_t, weight_t) -> Graph:
    cpu = DeviceRef.CPU()
    with Graph("mokv_qkv", input_types=[*mokv.PAGED.input_symbols(params, 1, 0, cpu), hidden_t, weight_t,
                                        TensorType(DType.uint32, ["batch_plus_1"], cpu)]) as g:
        *kv, h, w, offsets = g.inputs
        coll = mokv.FetchPagedKVCacheCollection(params, num_layers=1)(*kv)
        g.output(mokv.ops.fused_qkv_matmul(coll, h, w, offsets, 0, N_Q))
    return g


def _load(session, graph: Graph, portable: bool):
    """`graph` compiled on the host's own CPU paths or the portable ones."""
    with mokv.ops.portable_cpu_paths(session, portable), mokv.filter_collection_warnings():
        return session.load(graph)


def run(quick: bool = False, progress=None, portable: bool = False) -> dict:
    """`portable`: add mokv's op on the portable CPU paths (`portable_cpu_paths`: the
    kernels an AVX2 host runs), timed beside the others."""
    from max.engine import InferenceSession

    cpu = DeviceRef.CPU()
    session = InferenceSession(devices=[CPU()])
    params = mokv.KVCacheParams(DType.float32, HKV, D, page_size=PAGE)
    hidden_t = TensorType(DType.float32, ["tokens", HIDDEN], cpu)
    weight_t = TensorType(DType.float32, [FEATURES, HIDDEN], cpu)
    mokv_model = _load(session, _mokv_graph(params, hidden_t, weight_t), portable=False)
    portable_model = _load(session, _mokv_graph(params, hidden_t, weight_t), portable=True) if portable else None
    with Graph("max_qkv", input_types=[hidden_t, weight_t]) as g:
        h, w = g.inputs
        g.output(ops.matmul(h.tensor, ops.transpose(w.tensor, 0, 1)))
    max_model = session.load(g)

    rng = np.random.default_rng(0)
    weight = Buffer.from_numpy((rng.standard_normal((FEATURES, HIDDEN)) * 0.02).astype(np.float32))
    rows = []
    for t in tokens(quick):
        pages = -(-t // PAGE)
        hidden = Buffer.from_numpy(rng.standard_normal((t, HIDDEN)).astype(np.float32))
        cache = [Buffer.from_numpy(np.zeros((pages + 1, 2, 1, PAGE, HKV, D), np.float32)),
                 Buffer.from_numpy(np.zeros(1, np.uint32)),
                 Buffer.from_numpy(np.arange(1, pages + 1, dtype=np.uint32).reshape(1, pages)),
                 Buffer.from_numpy(np.array([[t, 0]], np.uint32))]
        offsets = Buffer.from_numpy(np.array([0, t], np.uint32))
        reps = 15 if t < 64 else 7
        flops = 2 * t * HIDDEN * FEATURES
        row: dict = {"tokens": t}
        fns = {
            "max-matmul": lambda: max_model.execute(hidden, weight),
            "mokv-fused_qkv": lambda: mokv_model.execute(*cache, hidden, weight, offsets),
        }
        if portable_model is not None:
            fns["mokv-fused_qkv-portable"] = lambda: portable_model.execute(
                *cache, hidden, weight, offsets
            )
        times: dict[str, list[float]] = {name: [] for name in fns}
        cpu_s: dict[str, list[float]] = {name: [] for name in fns}
        for fn in fns.values():
            fn()
        for _ in range(reps):  # interleaved, so that both sides see the same machine load
            for name, fn in fns.items():
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu_s[name].append(time.process_time() - c0)
        for name, ts in times.items():
            s = float(np.median(ts))
            row[name] = {
                "ms": s * 1e3,
                "min_ms": min(ts) * 1e3,
                "cpu_ms": float(np.median(cpu_s[name])) * 1e3,
                "GFLOPs": flops / s / 1e9,
                "weight_GBps": FEATURES * HIDDEN * 4 / s / 1e9,
            }
        rows.append(row)
        if progress:
            progress()
    return {"shape": {"hidden": HIDDEN, "n_heads": N_Q, "n_kv_heads": HKV, "head_dim": D, "dtype": "float32"},
            "rows": rows}


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run("--quick" in sys.argv, portable="--portable" in sys.argv), indent=1))
