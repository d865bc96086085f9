"""FP8 pages in the host and shared tiers: pages per second and bytes per page, FP8 against
bfloat16, in one run (issue 53).

Pages of a Llama-3.1-8B-like layer stack (page 128, 8 KV heads of head_dim 128, `LAYERS`
of its 32 layers: a bfloat16 page of 4 MiB at 8 layers) in three formats: bfloat16,
scaled FP8 (float8_e4m3fn values and a float32 scale per 128 lanes, MAX's
`KVCacheQuantizationConfig`) and unscaled FP8 (MAX's Llama `--kv-cache-format
float8_e4m3fn`). The device is the CPU device; the pages are real `Buffer`s and the
tiers mokv's own objects:

- host tier: `HostPages.offload` then `HostPages.load` of `n` scattered pages (values and
  scales, one batch per leaf), best of three each; bytes per page: `bytes_per_page`.
- shared tier: `RemoteTier.store` of the same pages into a fresh namespace of one
  redis-server on loopback (encode, checksum, pipelined SET NX; timed to the writer's
  flush), then `RemoteTier.lookup` of the chain and `load` into device pages (GET,
  every value checked, values and scales written back), best of three; bytes per page:
  `STRLEN` of a stored value on the server (header, token ids and keys digest
  included).

The formats take turns, `ROUNDS` rounds of all three, and each rate is the best of its
rounds (the store's put, once per round into an emptied server, included).

Usage: python benchmarks/bench_fp8_tiers.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import mokv
import numpy as np
import redis
from bench_remote import start_server
from max.driver import CPU, Buffer
from max.dtype import DType
from mokv.cache.hashing import iter_page_hashes, page_hash_fn, root_hash
from mokv.cache.page_copy import HostPages, numpy_view
from mokv.remote import RemoteLayout
from mokv.tiers.base import CommittedPages
from mokv.tiers.remote import RemoteTier


def llama_8b_pages(
    dtype: DType, quantization: mokv.KVCacheQuantization | None = None
) -> mokv.KVCacheParams:
    """Pages of 128 tokens of 8 KV heads of 128 (Llama-3.1-8B's) in `dtype`."""
    return mokv.KVCacheParams(
        dtype, n_kv_heads=8, head_dim=128, page_size=128, quantization=quantization
    )


FORMATS = {
    "bfloat16": llama_8b_pages(DType.bfloat16),
    "float8_e4m3fn + scales": llama_8b_pages(DType.float8_e4m3fn, mokv.KVCacheQuantization()),
    "float8_e4m3fn unscaled": llama_8b_pages(DType.float8_e4m3fn),
}


ROUNDS = 5
"""Rounds over the formats (best of each kept)."""


def settings(quick: bool) -> dict:
    return dict(layers=4 if quick else 8, pages=16 if quick else 32, repeats=2)


def device_leaves(params: mokv.KVCacheParams, layers: int, num_pages: int) -> list[Buffer]:
    """The device buffers of `num_pages` pages, random bits: values, then scales."""
    shape = [num_pages, 2, layers, params.page_size, params.n_kv_heads, params.head_dim]
    leaves = [Buffer(params.dtype, shape, device=CPU())]
    scales_shape = params.scales_shape(shape)
    if scales_shape is not None:
        leaves.append(Buffer(DType.float32, scales_shape, device=CPU()))
    rng = np.random.default_rng(0)
    for leaf in leaves:
        view = numpy_view(leaf)
        view[:] = rng.integers(0, np.iinfo(view.dtype).max, view.shape, view.dtype)
    return leaves


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def host_tier(params: mokv.KVCacheParams, s: dict) -> dict:
    """Offload and load of `pages` scattered pages through the host tier's bytes."""
    n = s["pages"]
    leaves = device_leaves(params, s["layers"], 2 * n)
    values, *scales = leaves
    host = HostPages(
        params.dtype,
        n,
        list(values.shape[1:]),
        [CPU()],
        (scales[0].dtype, list(scales[0].shape[1:])) if scales else None,
    )
    device_ids = np.random.default_rng(1).permutation(2 * n)[:n].tolist()
    host_ids = list(range(n))
    offload = _best(lambda: host.offload(leaves, device_ids, host_ids), s["repeats"])
    load = _best(lambda: host.load(host_ids, leaves, device_ids), s["repeats"])
    return {
        "bytes_per_page": host.bytes_per_page,
        "offload_pages_per_s": round(n / offload),
        "load_pages_per_s": round(n / load),
    }


def shared_tier(params: mokv.KVCacheParams, s: dict, url: str, port: int) -> dict:
    """Store, then look up and load, `pages` pages of a chain through `RemoteTier`."""
    n, layers = s["pages"], s["layers"]
    values, *scales = device_leaves(params, layers, 2 * n)
    namespace = f"bench-fp8-{time.time_ns()}"
    config = mokv.RemoteTierConfig(url=url, namespace=namespace, timeout_s=30)
    tier = RemoteTier(
        config, [RemoteLayout.from_params(params, layers)], [values], scales or None
    )
    (store,) = tier.stores
    tokens = np.arange(n * params.page_size)
    links = list(
        iter_page_hashes(tokens, params.page_size, root_hash("xxh3", 0), page_hash_fn("xxh3"))
    )
    hashes = [h for h, _ in links]
    page_ids = list(range(n))
    committed = CommittedPages(
        page_ids, hashes, [t for _, t in links], [None, *hashes[:-1]], [None] * n
    )
    try:
        t0 = time.perf_counter()
        tier.store(committed)
        assert store.flush(300)
        put = time.perf_counter() - t0

        def lookup_and_load() -> None:
            hits = tier.lookup(iter(links))
            assert len(hits) == n
            tier.load(hits, list(range(n, 2 * n)))

        get = _best(lookup_and_load, s["repeats"])
        client = redis.Redis(port=port)
        stored = client.strlen(store.key(hashes[0]))
        client.flushdb()  # the next put into an empty server, never an evicting one
    finally:
        tier.close()
    return {
        "bytes_per_page": stored,
        "put_pages_per_s": round(n / put),
        "load_pages_per_s": round(n / get),
    }


def run(quick: bool, progress=None) -> dict:
    """Both tiers for every format, one redis-server; `ROUNDS` rounds over the formats in
    turn (so that the machine's noise and warm-up fall on all of them), the best of each
    rate kept; `progress()` after each format of the last round."""
    s = settings(quick)
    tick = progress or (lambda: None)
    out: dict = {"settings": s, "rounds": ROUNDS, "formats": {}}
    with tempfile.TemporaryDirectory() as workdir:
        proc, port = start_server(workdir)
        try:
            url = f"redis://127.0.0.1:{port}/0"
            for round_ in range(ROUNDS):
                for name, params in FORMATS.items():
                    row = {
                        "host": host_tier(params, s),
                        "shared": shared_tier(params, s, url, port),
                    }
                    best = out["formats"].setdefault(name, row)
                    for tier, rates in row.items():
                        for key, value in rates.items():
                            best[tier][key] = max(best[tier][key], value)
                    if round_ == ROUNDS - 1:
                        tick()
        finally:
            proc.kill()
            proc.wait()
    base = out["formats"]["bfloat16"]
    for row in out["formats"].values():
        for tier in ("host", "shared"):
            row[tier]["bytes_vs_bf16"] = round(
                row[tier]["bytes_per_page"] / base[tier]["bytes_per_page"], 4
            )
    return out


def plan_size(quick: bool) -> int:
    return len(FORMATS)


def table(r: dict) -> list[str]:
    """The markdown table of a run."""
    s = r["settings"]
    lines = [
        f"### FP8 pages in the tiers (page 128, 8 KV heads of 128, {s['layers']} layers; "
        f"{s['pages']} pages a batch, CPU device, one redis-server on loopback)",
        "",
        "| format | host bytes/page | host offload pages/s | host load pages/s | "
        "shared bytes/page | shared put pages/s | shared lookup+load pages/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in r["formats"].items():
        h, t = row["host"], row["shared"]
        lines.append(
            f"| {name} | {h['bytes_per_page']:,} ({h['bytes_vs_bf16']}x) | "
            f"{h['offload_pages_per_s']:,} | {h['load_pages_per_s']:,} | "
            f"{t['bytes_per_page']:,} ({t['bytes_vs_bf16']}x) | {t['put_pages_per_s']:,} | "
            f"{t['load_pages_per_s']:,} |"
        )
    return [*lines, ""]


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    result = run(ap.parse_args().quick)
    print(json.dumps(result, indent=1))
    print("\n".join(table(result)))
