"""Decode attention bandwidth on the CPU: bytes of K/V read per second.

    python tests/ops/bench_decode_attention.py [context] [n_kv_heads] [group] [dtype] [batch]

Not collected by pytest (no test_ prefix). Builds one paged graph with only the
collection constructor and flash_attention, fills the cache with random data, and
times `execute` (median of N runs). Each K/V byte of the batch's contexts should be
read once per step, so bandwidth = 2 * batch * context * n_kv * head_dim * size / time.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from mokv.layouts import PAGED, FetchPagedKVCacheCollection
from mokv.ops import flash_attention, kernels_path
from mokv.params import KVCacheParams


def main() -> None:
    ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    n_kv = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    group = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    dtype = DType.bfloat16 if (sys.argv[4] if len(sys.argv) > 4 else "bf16") == "bf16" else DType.float32
    batch = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    d, page = 128, 128
    params = KVCacheParams(dtype=dtype, n_kv_heads=n_kv, head_dim=d, page_size=page)
    cpu = DeviceRef.CPU()
    qt = TensorType(dtype, ["total_tokens", n_kv * group, d], device=cpu)
    ot = TensorType(DType.uint32, ["num_offsets"], device=cpu)
    with Graph("decode", input_types=[*PAGED.input_symbols(params, 1, 0, cpu), qt, ot],
               custom_extensions=[kernels_path()]) as g:
        *cache_in, q, off = g.inputs
        kv = FetchPagedKVCacheCollection(params, 1)(*cache_in)
        g.output(flash_attention(kv, q, off, 0, 1 / np.sqrt(d)))
    model = InferenceSession(devices=[CPU()]).load(g)

    pages_per_seq = -(-(ctx + 1) // page)
    n_pages = batch * pages_per_seq
    np_dtype = np.uint16 if dtype == DType.bfloat16 else np.float32
    rng = np.random.default_rng(0)
    blocks = rng.integers(0x3C00, 0x3F00, (n_pages, 2, 1, page, n_kv, d)).astype(np_dtype) \
        if dtype == DType.bfloat16 else rng.standard_normal((n_pages, 2, 1, page, n_kv, d)).astype(np.float32)
    table = rng.permutation(n_pages).astype(np.uint32).reshape(batch, pages_per_seq)
    lengths = np.full(batch, ctx, np.uint32)
    q = rng.standard_normal((batch, n_kv * group, d)).astype(np.float32)
    q = (q.view(np.uint32) >> 16).astype(np.uint16) if dtype == DType.bfloat16 else q
    bufs = [Buffer.from_numpy(blocks), Buffer.from_numpy(lengths), Buffer.from_numpy(table),
            Buffer.from_numpy(np.array([[1, ctx]], np.uint32)), Buffer.from_numpy(q),
            Buffer.from_numpy(np.arange(batch + 1, dtype=np.uint32))]
    if dtype == DType.bfloat16:
        bufs[0], bufs[4] = bufs[0].view(DType.bfloat16), bufs[4].view(DType.bfloat16)
    for _ in range(3):
        model.execute(*bufs)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        model.execute(*bufs)
        times.append(time.perf_counter() - t0)
    t = float(np.median(times))
    nbytes = 2 * batch * (ctx + 1) * n_kv * d * dtype.size_in_bytes
    print(f"ctx={ctx} batch={batch} n_kv={n_kv} group={group} {dtype}: {t * 1e3:.3f} ms, "
          f"{nbytes / 2**20:.1f} MiB K/V, {nbytes / t / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
