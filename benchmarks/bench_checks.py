"""What checked mode costs: the same graphs with and without `checked=True`.

    python benchmarks/bench_checks.py [reps]

One layer of Llama-3-8B-shaped attention (32 query heads, 8 KV heads, head_dim 128,
float32, pages of 128 tokens) over hand-built paged tables. Two graphs, each built
unchecked and checked (the fetcher's `checked` flag, so `mokv.check_tables` runs
before every kernel): `store` holds store_kv alone (its kernel is a few microseconds,
so the difference is the cost of one check), `layer` holds store_kv + flash_attention
(the difference relative to a layer's attention). Calls alternate between the
unchecked and checked model (the shared VM's speed drifts); each time is the median
of `reps` calls, graph launch included, and the cost is also given from the minima.
Cases: a decode step (32 sequences x 2048 cached tokens, one new token each: 512
pages checked per op) and a prefill chunk (one sequence, 512 new tokens).
"""

from __future__ import annotations

import sys
import time

import mokv
import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType
from mokv.ops import flash_attention, store_kv

H, HKV, D, PAGE = 32, 8, 128, 128


def build(session: InferenceSession, params: mokv.KVCacheParams, kind: str, checked: bool):
    cpu = DeviceRef.CPU()
    kt = TensorType(DType.float32, ["tokens", HKV, D], cpu)
    qt = TensorType(DType.float32, ["tokens", H, D], cpu)
    ot = TensorType(DType.uint32, ["offsets"], cpu)
    symbols = mokv.PAGED.input_symbols(params, 1, 0, cpu)
    with Graph(f"checks_{kind}_{checked}", input_types=[*symbols, kt, kt, qt, ot]) as g:
        *cache, k, v, q, off = g.inputs
        kv = mokv.FetchPagedKVCacheCollection(params, num_layers=1, checked=checked)(*cache)
        store_kv(kv, k, v, off, 0)
        g.output(flash_attention(kv, q, off, 0, D**-0.5) if kind == "layer" else off)
    with mokv.filter_collection_warnings():
        return session.load(g)


def inputs(cache_lengths: list[int], new_tokens: list[int]) -> list[Buffer]:
    rng = np.random.default_rng(0)
    pages = [-(-(c + n) // PAGE) for c, n in zip(cache_lengths, new_tokens)]
    table = np.zeros((len(pages), max(pages)), np.uint32)
    ids = rng.permutation(sum(pages)).astype(np.uint32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = ids[start:start + n]
        start += n
    blocks = np.full((sum(pages), 2, 1, PAGE, HKV, D), 0.01, np.float32)
    total = sum(new_tokens)
    k = rng.standard_normal((total, HKV, D)).astype(np.float32)
    q = rng.standard_normal((total, H, D)).astype(np.float32)
    offsets = np.concatenate([[0], np.cumsum(new_tokens)]).astype(np.uint32)
    lengths = np.array(cache_lengths, np.uint32)
    ends = [c + n for c, n in zip(cache_lengths, new_tokens)]
    max_lengths = np.array([[max(new_tokens), max(ends)]], np.uint32)  # MAX's meaning
    return [Buffer.from_numpy(a) for a in (blocks, lengths, table, max_lengths, k, k, q, offsets)]


def main() -> None:
    reps = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    session = InferenceSession(devices=[CPU()])
    params = mokv.KVCacheParams(DType.float32, HKV, D, page_size=PAGE)
    print("graph  case                  unchecked ms  checked ms  per check us (median, min)")
    for kind, n_checks in (("store", 1), ("layer", 2)):
        models = {flag: build(session, params, kind, flag) for flag in (False, True)}
        for name, lengths, new in (("decode 32 x 2048 + 1", [2048] * 32, [1] * 32),
                                   ("prefill 1 x 512", [0], [512])):
            args = inputs(lengths, new)
            times: dict[bool, list[float]] = {False: [], True: []}
            for i in range(reps + 2):
                for flag in (False, True):
                    t0 = time.perf_counter()
                    models[flag].execute(*args)
                    if i >= 2:  # warm-up
                        times[flag].append(time.perf_counter() - t0)
            plain, checked = (float(np.median(times[f])) for f in (False, True))
            by_min = (min(times[True]) - min(times[False])) / n_checks
            print(f"{kind:6s} {name:22s} {plain * 1e3:12.3f} {checked * 1e3:11.3f} "
                  f"{(checked - plain) / n_checks * 1e6:12.1f} {by_min * 1e6:7.1f}", flush=True)


if __name__ == "__main__":
    main()
