"""Shared tier on loopback: page put / lookup throughput and the latency of a chain probe.

Starts its own redis-server (as the tests do: free port, no persistence, allkeys-lru).
put: `store.put` of every page, then `flush` (encode + checksum + pipelined SET NX on the
writer thread). lookup: `store.lookup` of the whole chain (one EXISTS round trip, one
MGET, every value checked). probe: `store.probe` of a 32-page chain (one round trip),
median. Pages of two layouts: the demo decoder's (f32, page 16, 4 layers, 2 KV heads,
head_dim 64: 64 KiB) and Llama-3.2-1B's (bf16, page 128, 16 layers, 8 KV heads, head_dim
64: 4 MiB). Usage: python benchmarks/bench_remote.py [--pages-mb 256]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import redis
from max.dtype import DType
from mokv.cache.hashing import iter_page_hashes, page_hash_fn, root_hash
from mokv.remote import RemoteLayout, RemotePageStore

LAYOUTS = {
    "decoder f32 p16 (64 KiB)": RemoteLayout(DType.float32, 16, 4, 2, 64),
    "llama-3.2-1b bf16 p128 (4 MiB)": RemoteLayout(DType.bfloat16, 128, 16, 8, 64),
}


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--maxmemory",
                             "1gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL)
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
    gb = n * layout.value_nbytes / 1e9
    print(f"{name}: {n} pages | put {n / put:,.0f} pages/s {gb / put:.2f} GB/s "
          f"(caller {caller / n * 1e6:.1f} us/page) | lookup {n / get:,.0f} pages/s "
          f"{gb / get:.2f} GB/s | probe of 32 pages: median "
          f"{statistics.median(probes) * 1e6:.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages-mb", type=int, default=256, help="MB of pages per layout")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found: apt-get install redis-server")
    proc, url = start_server()
    try:
        for name, layout in LAYOUTS.items():
            bench(url, name, layout, args.pages_mb)
    finally:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    main()
