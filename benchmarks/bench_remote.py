"""Shared tier on loopback: pages stored and loaded per second (and GB/s) through one
Redis and through a Redis Cluster, the latency of a chain probe, the prefill a warm
restart saves on the agent trace, and the prefix-hit rate of two managers sharing one
Redis on the trace replay (`run.py --parts remote` runs all but the last).

Starts its own redis-servers (as the tests do: free ports, no persistence, allkeys-lru):
one server, and a cluster of three masters without replicas (a replica would add its
copy traffic on the same two cores). put: `store.put` of every page, then `flush`
(encode + checksum + pipelined SET NX on the writer thread; on the cluster one pipeline
per master, one after the other). lookup: `store.lookup` of the whole chain (one EXISTS
round trip and one GET round trip per server, every value checked), best of three. probe:
`store.probe` of a 32-page chain, median. Beside them, redis-py alone: a pipelined GET
of the same values from the one server, no checks, best of three (the client's own
ceiling here), and
numpy's copy of the same bytes (the memory's). Pages of two layouts: the demo decoder's
(f32, page 16, 4 layers, 2 KV heads, head_dim 64: 64 KiB) and Llama-3.2-1B's (bf16,
page 128, 16 layers, 8 KV heads, head_dim 64: 4 MiB). On loopback every byte is copied
by the CPU several times (client buffer, kernel, server), and client and servers share
the machine's cores: these are the software's costs, not a network's.

Warm restart (the agent trace of `bench_managers.session_compare`, whole conversations
split at the median first arrival): a manager with the shared tier serves the first
half and is closed (a restart); a new manager serves the second half, with the same
shared tier (warm) or an empty namespace of it (cold). Rows: prompt tokens, prefill
tokens computed and tokens loaded from the shared tier, after the restart.

Trace replay (serving_trace.py, page_size 128, replay.py's scheduler; standalone only):
the trace's sessions split between two managers by session, replayed side by side, each
manager with `--device-pages` pages: one manager serving the whole trace (with the same
budget and twice it), the two without a shared tier, the two sharing one Redis, and the
infinite-cache bound (hit rate: prompt tokens the caches supplied at admission over
prompt tokens admitted; first-admission hit rate: over each prompt's first admission).

Usage: python benchmarks/bench_remote.py [--quick] [--trace-split] [--sessions 150]
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
import tempfile
import time

import mokv
import numpy as np
import redis
from managers import MokvPaged
from max.dtype import DType
from mokv.cache.hashing import iter_page_hashes, page_hash_fn, root_hash
from mokv.remote import RemoteLayout, RemotePageStore
from replay import replay, replay_side_by_side
from serving_trace import Request, TraceConfig, infinite_cache_bound, make_trace

LAYOUTS = {
    "decoder f32 p16 (64 KiB)": RemoteLayout(DType.float32, 16, 4, 2, 64),
    "llama-3.2-1b bf16 p128 (4 MiB)": RemoteLayout(DType.bfloat16, 128, 16, 8, 64),
}
RESTART_PAGE_SIZE = 128


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workdir: str, *extra: str) -> tuple[subprocess.Popen, int]:
    """A redis-server on a free loopback port (with `extra` arguments), once it answers."""
    port = _free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
         "127.0.0.1", "--save", "", "--appendonly", "no", "--maxmemory", "1gb",
         "--maxmemory-policy", "allkeys-lru", "--dir", workdir, *extra],
        stdout=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    return proc, port


def start_cluster(workdir: str, masters: int = 3) -> tuple[list[subprocess.Popen], tuple]:
    """`masters` cluster nodes joined by `redis-cli --cluster create`; their seed URLs."""
    nodes = [start_server(workdir, "--cluster-enabled", "yes", "--cluster-config-file",
                          f"nodes-{i}.conf", "--cluster-port", str(_free_port()))
             for i in range(masters)]
    subprocess.run([shutil.which("redis-cli") or "redis-cli", "--cluster", "create",
                    *(f"127.0.0.1:{port}" for _, port in nodes), "--cluster-yes"],
                   check=True, capture_output=True, timeout=60)
    for _, port in nodes:
        client = redis.Redis(port=port)
        while b"cluster_state:ok" not in client.execute_command("CLUSTER", "INFO"):
            time.sleep(0.05)
    return [proc for proc, _ in nodes], tuple(f"redis://127.0.0.1:{port}" for _, port in nodes)


def throughput(url, layout: RemoteLayout, total_mb: int, raw_port: int | None) -> dict:
    """put / lookup / probe of `total_mb` of pages (see the module docstring)."""
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
        assert store.flush(300)
        put = time.perf_counter() - t0
        get = min(_timed(store.lookup, links) for _ in range(3))  # the least disturbed
        assert store.metrics.hits == 3 * n, store.metrics
        probes = []
        for _ in range(100):
            t0 = time.perf_counter()
            assert store.probe(links[:32]) == 32
            probes.append(time.perf_counter() - t0)
        keys = [store.key(h) for h, _ in links]
    gb = n * store.codec.value_nbytes / 1e9
    out = {"pages": n, "put_pages_per_s": round(n / put), "put_GBps": round(gb / put, 3),
           "lookup_pages_per_s": round(n / get), "lookup_GBps": round(gb / get, 3),
           "probe_32_us": round(statistics.median(probes) * 1e6)}
    if raw_port is not None:  # redis-py alone, one server: a pipelined GET, no checks
        client = redis.Redis(port=raw_port)

        def get_all() -> None:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            assert all(v is not None for v in pipe.execute())

        out["redis_py_get_GBps"] = round(gb / min(_timed(get_all) for _ in range(3)), 3)
        client.close()
    return out


def copy_GBps(nbytes: int = 256 * 2**20) -> float:
    """numpy's copy of `nbytes` (best of 5): the memory's ceiling for one copy."""
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    best = min(_timed(np.copyto, dst, src) for _ in range(5))
    return round(nbytes / best / 1e9, 2)


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _halves(trace: list[Request]) -> tuple[list[Request], list[Request]]:
    """Whole conversations, split at the median first arrival; the second half's first
    arrivals moved to start at step 0."""
    by_rid = {r.rid: r for r in trace}

    def root(r: Request) -> Request:
        while r.parent is not None:
            r = by_rid[r.parent]
        return r

    split = statistics.median(r.arrival for r in trace if r.parent is None)
    first = [r for r in trace if root(r).arrival < split]
    second = [r if r.parent is not None else Request(**{**vars(r), "arrival": r.arrival - int(split)})
              for r in trace if root(r).arrival >= split]
    return first, second


def warm_restart(url, sessions: int, agent_sessions: int, device_pages: int) -> dict:
    """Prefill computed after a restart, warm (the same shared tier) and cold."""
    trace = make_trace(TraceConfig(num_sessions=sessions, agent_sessions=agent_sessions))
    before, after = _halves(trace)
    size = dict(max_batch=32, max_seq_len=16_384, page_size=RESTART_PAGE_SIZE)
    namespace = f"bench-restart-{time.time_ns()}"

    def server(ns: str) -> MokvPaged:
        tier = mokv.RemoteTierConfig(url=url, namespace=ns, timeout_s=5.0)
        return MokvPaged(device_pages, **size, tiers=(tier,))

    first = server(namespace)
    replay(first, before, page_size=RESTART_PAGE_SIZE)
    first.manager.close()  # sends what is queued
    out: dict = {"requests_before": len(before), "requests_after": len(after)}
    for name, ns in (("cold", f"{namespace}-empty"), ("warm", namespace)):
        restarted = server(ns)
        stats = replay(restarted, after, page_size=RESTART_PAGE_SIZE)
        out[name] = {"prefill_tokens_computed": stats.prompt_tokens_admitted - stats.tokens_skipped,
                     "prompt_tokens": stats.prompt_tokens_admitted,
                     "remote_tokens": restarted.manager.metrics.remote_cache_tokens}
        restarted.manager.close()
    out["prefill_tokens_saved"] = (out["cold"]["prefill_tokens_computed"]
                                   - out["warm"]["prefill_tokens_computed"])
    return out


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


def settings(quick: bool) -> dict:
    return dict(pages_mb=64 if quick else 256, sessions=60 if quick else 150,
                agent_sessions=4 if quick else 8, device_pages=128)


def run(quick: bool, progress=None, trace_replay: bool = False) -> dict:
    """Every measurement of the module docstring, in one run (the trace replay only with
    `trace_replay`); `progress()` after each of `plan_size(quick)` steps."""
    s = settings(quick)
    tick = progress or (lambda: None)
    procs: list[subprocess.Popen] = []
    out: dict = {"copy_GBps": copy_GBps(), "cores": os.cpu_count(), "settings": s,
                 "cluster": "3 masters, no replicas", "layouts": {}}
    with tempfile.TemporaryDirectory() as workdir:
        try:
            proc, port = start_server(workdir)
            procs.append(proc)
            nodes, seeds = start_cluster(workdir)
            procs += nodes
            url = f"redis://127.0.0.1:{port}/0"
            for name, layout in LAYOUTS.items():
                out["layouts"][name] = {
                    "one Redis": throughput(url, layout, s["pages_mb"], port),
                    "Redis Cluster": throughput(seeds, layout, s["pages_mb"], None),
                }
                tick()
            out["warm_restart"] = warm_restart(url, s["sessions"], s["agent_sessions"],
                                               s["device_pages"])
            tick()
            if trace_replay:
                out["trace_split"] = trace_split(url, s["sessions"], s["device_pages"])
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    return out


def plan_size(quick: bool) -> int:
    return len(LAYOUTS) + 1


def table(r: dict) -> list[str]:
    """The markdown tables of a run."""
    lines = [f"### Shared tier on loopback ({r['cores']} cores for client and servers, "
             f"numpy copy {r['copy_GBps']} GB/s; cluster: {r['cluster']})", "",
             "| pages | through | put pages/s | put GB/s | lookup pages/s | lookup GB/s | "
             "probe of 32 µs | redis-py GET GB/s |", "|---|---|---|---|---|---|---|---|"]
    for name, by_target in r["layouts"].items():
        for target, t in by_target.items():
            lines.append(f"| {name} | {target} | {t['put_pages_per_s']:,} | {t['put_GBps']} | "
                         f"{t['lookup_pages_per_s']:,} | {t['lookup_GBps']} | {t['probe_32_us']} | "
                         f"{t.get('redis_py_get_GBps', '-')} |")
    w = r["warm_restart"]
    lines += ["", f"### Warm restart on the agent trace ({w['requests_before']} requests "
              f"before the restart, {w['requests_after']} after)", "",
              "| after the restart | prompt tokens | prefill tokens computed | "
              "tokens from the shared tier |", "|---|---|---|---|"]
    for name in ("cold", "warm"):
        c = w[name]
        lines.append(f"| {name} | {c['prompt_tokens']:,} | {c['prefill_tokens_computed']:,} | "
                     f"{c['remote_tokens']:,} |")
    return lines + ["", f"Prefill tokens saved by the warm restart: {w['prefill_tokens_saved']:,}.", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer pages and sessions")
    parser.add_argument("--trace-split", action="store_true",
                        help="also the two-manager trace replay")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found: apt-get install redis-server")
    print(f"load average before: {os.getloadavg()}")
    result = run(args.quick, trace_replay=args.trace_split)
    print(json.dumps(result, indent=1))
    print("\n".join(table(result)))
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
