"""The host tier: hit rate vs host size on the trace replay, host cost, copy bandwidth.

    python benchmarks/bench_host_tier.py [--sessions 150] [--device-pages 128]

1. Trace replay (serving_trace.py, page_size 128) at one small device budget, with host tiers
   of 0 (device only) to many pages: prefix-hit rate against the infinite-cache bound,
   and host µs per request-step (manager calls only, replay.py's timer).
2. Copy bandwidth of the batched offload and load (`HostPages`) on pages of a real
   model's size, against one `np.copyto` memcpy of the same bytes in the same run.
3. Startup: the time to build a large host tier.
Prints one JSON object; `--plot FILE.png` also draws hit rate vs host size.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mokv
import numpy as np
from managers import SHAPE, MokvPaged
from max.driver import CPU, Buffer
from max.dtype import DType
from mokv.cache.page_copy import HostPages, numpy_view
from replay import replay
from serving_trace import TraceConfig, infinite_cache_bound, make_trace


def with_host_tier(budget_pages: int, host_pages: int, **kw) -> MokvPaged:
    adapter = MokvPaged(budget_pages, **kw)
    if host_pages:  # rebuild the manager with the tier on (same device budget)
        p = adapter.params
        gb = host_pages * p.bytes_per_page(SHAPE["num_layers"]) / 2**30
        params = mokv.KVCacheParams(p.dtype, p.n_kv_heads, p.head_dim, page_size=p.page_size,
                                    enable_prefix_caching=True,
                                    tiers=(mokv.HostTierConfig(swap_space_gb=gb),))
        m = adapter.manager
        adapter.manager = mokv.PagedKVCacheManager(
            params, m.max_batch_size, m.max_seq_len, SHAPE["num_layers"], [CPU()], m.session,
            m.total_num_pages * p.bytes_per_page(SHAPE["num_layers"]), page_size=p.page_size)
        adapter.name = f"mokv-paged+host{host_pages}"
    return adapter


def hit_rates(sessions: int, device_pages: int, host_sizes: list[int], repeats: int = 3) -> dict:
    """One replay per host size and repeat (interleaved); host µs: the best repeat (the
    machine is shared, the minimum is the least disturbed)."""
    trace = make_trace(TraceConfig(num_sessions=sessions))
    out: dict = {
        "bound": round(infinite_cache_bound(trace, 128), 4),
        "device_pages": device_pages,
        "sessions": sessions,
        "rows": [],
    }
    runs: dict[int, list] = {h: [] for h in host_sizes}
    for _ in range(repeats):
        for host_pages in host_sizes:
            adapter = with_host_tier(device_pages, host_pages, max_batch=32, max_seq_len=16_384)
            summary = replay(adapter, trace).summary()
            runs[host_pages].append((summary, adapter.manager.metrics))
            del adapter  # frees the host tier before the next one
    for host_pages in host_sizes:
        s, metrics = min(runs[host_pages], key=lambda r: r[0]["us_per_request_step"]["mean"])
        out["rows"].append({
            "host_pages": host_pages, "hit_rate": round(s["hit_rate"], 4),
            "us_per_request_step": s["us_per_request_step"]["mean"],
            "host_hit_tokens": metrics.host_cache_tokens,
            "device_hit_tokens": metrics.device_cache_tokens,
            "MB_to_host": round(metrics.bytes_to_host / 2**20, 1),
            "MB_from_host": round(metrics.bytes_from_host / 2**20, 1),
        })
    return out


def bandwidth(num_pages: int = 32, repeats: int = 5) -> dict:
    """GB/s of offload and load of `num_pages` scattered pages, vs one memcpy."""
    page_shape = [2, 8, 128, 2, 128]  # 8 layers, 2 KV heads of 128: 2 MiB per float32 page
    device = Buffer(DType.float32, [2 * num_pages, *page_shape], device=CPU())
    numpy_view(device)[:] = 1  # touch every page once
    host = HostPages(DType.float32, 2 * num_pages, page_shape, [CPU()])
    numpy_view(host.buffers[0])[:] = 2
    rng = np.random.default_rng(0)
    dev_ids = rng.permutation(2 * num_pages)[:num_pages].tolist()
    host_ids = list(range(num_pages))  # fresh host pages come out in order: one run
    nbytes = num_pages * host.bytes_per_page
    src = np.ones(nbytes // 4, dtype=np.uint32)
    dst = np.empty_like(src)

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times) / 1e9

    memcpy = best(lambda: np.copyto(dst, src))
    offload = best(lambda: host.offload([device], dev_ids, host_ids))
    load = best(lambda: host.load(host_ids, [device], dev_ids))
    return {"MiB_per_batch": nbytes // 2**20, "memcpy_GBps": round(memcpy, 2),
            "offload_GBps": round(offload, 2), "load_GBps": round(load, 2),
            "offload_vs_memcpy": round(offload / memcpy, 2),
            "load_vs_memcpy": round(load / memcpy, 2)}


def startup(gib: float = 4.0) -> dict:
    page_shape = [2, 32, 128, 8, 128]  # a 32-layer, 8-KV-head model: 32 MiB per float32 page
    num_pages = int(gib * 2**30) // (int(np.prod(page_shape)) * 4)
    t0 = time.perf_counter()
    HostPages(DType.float32, num_pages, page_shape, [CPU()])
    return {"GiB": gib, "pages": num_pages, "seconds": round(time.perf_counter() - t0, 4)}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=150)
    ap.add_argument("--device-pages", type=int, default=160)
    ap.add_argument("--host-sizes", default="0,64,128,256,512,768,1024,2048,4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--plot", type=Path, help="write the hit-rate plot to this PNG")
    a = ap.parse_args()
    result = {"replay": hit_rates(a.sessions, a.device_pages,
                                  [int(x) for x in a.host_sizes.split(",")], a.repeats),
              "copy": bandwidth(), "startup": startup()}
    print(json.dumps(result, indent=1))
    if a.plot:
        from plots import hit_rate_vs_host_pages  # matplotlib: the bench extra

        hit_rate_vs_host_pages(result["replay"], a.plot)
