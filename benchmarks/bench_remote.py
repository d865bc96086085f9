"""Shared tier on loopback: page put / lookup throughput, the latency of a chain probe,
and the prefix-hit rate of two managers sharing one Redis on the trace replay.

Starts its own redis-server (as the tests do: free port, no persistence, allkeys-lru).
put: `store.put` of every page, then `flush` (encode + checksum + pipelined SET NX on the
writer thread). lookup: `store.lookup` of the whole chain (one EXISTS round trip, one
MGET, every value checked). probe: `store.probe` of a 32-page chain (one round trip),
median. Pages of two layouts: the demo decoder's (f32, page 16, 4 layers, 2 KV heads,
head_dim 64: 64 KiB) and Llama-3.2-1B's (bf16, page 128, 16 layers, 8 KV heads, head_dim
64: 4 MiB).

Trace replay (serving_trace.py, page_size 128, replay.py's scheduler): the trace's sessions split
between two managers by session (a conversation stays on its server; system prompts
and documents are seen by both), replayed side by side, each manager with
`--device-pages` pages. Rows: one manager serving the whole trace with the same
budget (and with twice it), the two managers without a shared tier, the two sharing
one Redis, and the infinite-cache bound. Hit rate: prompt tokens the caches supplied
at admission over prompt tokens admitted (both managers together; re-admissions after a
preemption included); first-admission hit rate: the same over each prompt's first
admission only (what the bound counts); host µs per
request-step: the manager calls only (replay.py's timer), the shared tier's round
trips included.

Usage: python benchmarks/bench_remote.py [--pages-mb 256] [--sessions 150]
[--device-pages 128]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

import mokv
import numpy as np
import redis
from managers import MokvPaged
from max.dtype import DType
from mokv.cache.hashing import iter_page_hashes, page_hash_fn, root_hash
from mokv.remote import RemoteLayout, RemotePageStore
from replay import replay, replay_side_by_side
from serving_trace import TraceConfig, infinite_cache_bound, make_trace

LAYOUTS = {
    "decoder f32 p16 (64 KiB)": RemoteLayout(DType.float32, 16, 4, 2, 64),
    "llama-3.2-1b bf16 p128 (4 MiB)": RemoteLayout(DType.bfloat16, 128, 16, 8, 64),
}


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            shutil.which("redis-server") or "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            "1gb",
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    return proc, f"redis://127.0.0.1:{port}/0"


def bench(url: str, name: str, layout: RemoteLayout, total_mb: int) -> None:
    n = max(32, total_mb * 2**20 // layout.page_nbytes)
    tokens = np.arange(n * layout.page_size)
    links = list(iter_page_hashes(tokens, layout.page_size, root_hash("xxh3", 0),
                                  page_hash_fn("xxh3")))
    page = np.random.default_rng(0).bytes(layout.page_nbytes)
    with RemotePageStore(url, f"bench-{time.time_ns()}", layout, timeout_s=5,
                         max_queued_pages=n) as store:
        t0 = time.perf_counter()
        for page_hash, token_bytes in links:
            store.put(page_hash, token_bytes, page)
        caller = time.perf_counter() - t0
        assert store.flush(300)
        put = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = store.lookup(links)
        get = time.perf_counter() - t0
        assert len(got) == n, (len(got), n, store.metrics)
        probes = []
        for _ in range(200):
            t0 = time.perf_counter()
            assert store.probe(links[:32]) == 32
            probes.append(time.perf_counter() - t0)
    gb = n * store.codec.value_nbytes / 1e9
    print(f"{name}: {n} pages | put {n / put:,.0f} pages/s {gb / put:.2f} GB/s "
          f"(caller {caller / n * 1e6:.1f} us/page) | lookup {n / get:,.0f} pages/s "
          f"{gb / get:.2f} GB/s | probe of 32 pages: median "
          f"{statistics.median(probes) * 1e6:.0f} us")


def _row(name: str, runs: list, adapters: list) -> dict:
    """Hit rate and host µs per request-step of runs replayed together (summed)."""
    admitted = sum(r.prompt_tokens_admitted for r in runs)
    request_steps = sum(sum(r.batch_sizes) for r in runs) or 1
    ns = sum(sum(r.bookkeeping_ns) + sum(r.runtime_ns) for r in runs)
    metrics = [a.manager.metrics for a in adapters]
    first = sum(r.first_prompt_tokens for r in runs)
    return {"setup": name, "hit_rate": round(sum(r.tokens_skipped for r in runs) / admitted, 4),
            "first_admission_hit_rate": round(
                sum(r.first_tokens_skipped for r in runs) / first, 4),
            "remote_hit_tokens": sum(m.remote_cache_tokens for m in metrics),
            "us_per_request_step": round(ns / request_steps / 1e3, 2),
            "preemptions": sum(r.preemptions for r in runs)}


def trace_split(url: str, sessions: int, device_pages: int) -> dict:
    """The trace replay rows (see the module docstring)."""
    trace = make_trace(TraceConfig(num_sessions=sessions))
    halves = [[r for r in trace if r.seed % 2 == side] for side in (0, 1)]
    size = dict(max_batch=32, max_seq_len=16_384)
    rows = []
    for pages in (device_pages, 2 * device_pages):
        adapter = MokvPaged(pages, **size)
        rows.append(_row(f"one manager, {pages} pages, whole trace", [replay(adapter, trace)],
                         [adapter]))
    pair = [MokvPaged(device_pages, **size) for _ in halves]
    rows.append(_row(f"two managers, {device_pages} pages each, no shared tier",
                     replay_side_by_side(list(zip(pair, halves))), pair))
    namespace = f"bench-trace-{time.time_ns()}"
    tier = mokv.RemoteTierConfig(url=url, namespace=namespace, timeout_s=5.0)
    shared = [MokvPaged(device_pages, **size, tiers=(tier,)) for _ in halves]
    rows.append(_row(f"two managers, {device_pages} pages each, sharing one Redis",
                     replay_side_by_side(list(zip(shared, halves))), shared))
    remote = [a.manager.remote_metrics for a in shared]
    for adapter in shared:
        adapter.manager.close()
    return {"sessions": sessions, "requests": len(trace),
            "bound": round(infinite_cache_bound(trace, 128), 4), "rows": rows,
            "MB_written_to_redis": round(sum(m.bytes_written for m in remote) / 2**20, 1),
            "MB_read_from_redis": round(sum(m.bytes_read for m in remote) / 2**20, 1),
            "remote_metrics": {k: sum(m.as_dict()[k] for m in remote)
                               for k in ("lookups", "hits", "misses", "pages_written",
                                         "pages_present", "drops", "errors", "timeouts")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages-mb", type=int, default=256, help="MB of pages per layout")
    parser.add_argument("--sessions", type=int, default=150, help="trace sessions")
    parser.add_argument("--device-pages", type=int, default=128, help="pages per manager")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found: apt-get install redis-server")
    proc, url = start_server()
    try:
        print(f"load average before: {os.getloadavg()}")
        if not args.skip_throughput:
            for name, layout in LAYOUTS.items():
                bench(url, name, layout, args.pages_mb)
        print(json.dumps(trace_split(url, args.sessions, args.device_pages), indent=1))
        print(f"load average after: {os.getloadavg()}")
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
