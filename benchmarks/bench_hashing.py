"""Prefix-hash throughput: tokens per second through each page-hash algorithm.

Every prompt token is hashed once when its page fills (`commit`) and again whenever a
new request is matched against the prefix cache (and a router hashes every query), so
hashing bounds how fast a long prompt can be admitted. We time
`mokv.cache.hashing.page_hashes` (hashes only, as MAX's function returns) over a long
int64 token array for each algorithm mokv offers ("xxh3", "sha256", "builtin"), at two
page sizes ("xxh3" and "sha256" through the Mojo extension's one call per chain when
`sha256_backend` reports it, else through the xxhash / hashlib call per page), and MAX
26.7's own Rust hasher (`hash_request_tokens`, "ahash64" and "sha256") on the same tokens
in the same run, interleaved per page size. Best of `repeats` runs (least disturbed by
other load).
"""

from __future__ import annotations

import time

import numpy as np
from mokv.cache.hashing import page_hash_fn, page_hashes, root_hash, sha256_backend
from mokv.config.base import PREFIX_HASH_ALGORITHMS


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _max_hasher():
    try:
        from maxcompat import load_max_pipelines

        load_max_pipelines()
        from max.pipelines.kv_cache.paged_kv_cache.block_utils import hash_request_tokens
    except Exception:  # noqa: BLE001 - MAX's reference is optional
        return None
    return hash_request_tokens


def run(quick: bool = False, progress=None) -> dict:
    num_tokens = 1 << (18 if quick else 20)
    repeats = 3 if quick else 7
    tokens = np.random.default_rng(0).integers(0, 50_000, num_tokens, dtype=np.int64)
    out: dict = {"num_tokens": num_tokens, "sha256_backend": sha256_backend(), "mokv": {}, "max": {}}
    for page_size in (16, 128):
        for algo in PREFIX_HASH_ALGORITHMS:
            fn, root = page_hash_fn(algo), root_hash(algo, 0)
            t = _best_time(lambda: page_hashes(tokens, page_size, root, fn), repeats)
            out["mokv"][f"{algo}/page{page_size}"] = round(num_tokens / t)
        hasher = _max_hasher()
        if hasher is not None:
            for algo in ("ahash64", "sha256"):
                t = _best_time(lambda: hasher(tokens, page_size, algo=algo), repeats)
                out["max"][f"{algo}/page{page_size}"] = round(num_tokens / t)
        if progress:
            progress()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(), indent=1))
