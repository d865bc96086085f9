"""One side of test_processes.py, in its own interpreter (its own hash seed).

argv: url namespace mode(put|get) seed num_pages. Builds the prompt's page chain with
mokv's own hashing from `seed`; `put` stores deterministic pages, `get` looks them up.
stdout: one JSON line {"hashes": [...], "found": n, "digest": sha256 of the found bytes}.
"""

import hashlib
import json
import sys

import numpy as np
from max.dtype import DType
from mokv import KVCacheParams
from mokv.cache.hashing import iter_page_hashes, page_hash_fn, salted_root
from mokv.remote import RemoteLayout, RemotePageStore

url, namespace, mode, seed, num_pages = sys.argv[1], sys.argv[2], sys.argv[3], *map(
    int, sys.argv[4:6]
)
params = KVCacheParams(DType.float32, n_kv_heads=2, head_dim=8, page_size=4)
layout = RemoteLayout.from_params(params, num_layers=2)
tokens = np.random.default_rng(seed).integers(0, 32000, num_pages * params.page_size)
root = salted_root(params.prefix_hash, params.prefix_hash_seed, "tenant-a")
links = list(iter_page_hashes(tokens, params.page_size, root, page_hash_fn(params.prefix_hash)))
with RemotePageStore(url, namespace, layout) as store:
    if mode == "put":
        rng = np.random.default_rng(seed + 1)
        found = [rng.standard_normal(layout.page_shape, dtype=np.float32).tobytes()
                 for _ in links]
        for (page_hash, token_bytes), page in zip(links, found):
            assert store.put(page_hash, token_bytes, page)
        assert store.flush(10)
    else:
        found = [bytes(p) for p in store.lookup(links)]
print(json.dumps({"hashes": [h for h, _ in links], "found": len(found),
                  "digest": hashlib.sha256(b"".join(found)).hexdigest()}), flush=True)
