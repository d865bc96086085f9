"""Page hash chains: chaining, the sha256 option's stability, and seeds that isolate caches."""

import hashlib

import numpy as np
import pytest

from mokv.cache.hashing import hash_pages, page_hash_fn, root_hash, token_bytes
from mokv import TextContext

from .conftest import make_paged


@pytest.mark.parametrize("algorithm", ["builtin", "sha256"])
def test_hash_chain_depends_on_the_whole_prefix(algorithm):
    fn = page_hash_fn(algorithm)
    root = root_hash(algorithm, 0)
    a = hash_pages(np.array([1, 2, 3, 4, 5, 6, 7]), 2, root, fn)
    b = hash_pages(np.array([9, 9, 3, 4, 5, 6]), 2, root, fn)
    assert len(a) == 3 and len(b) == 3  # the partial last page of `a` is not hashed
    assert a[1][1] == b[1][1]  # same tokens in page 1 ...
    assert a[1][0] != b[1][0]  # ... but a different parent, so a different hash
    assert a == hash_pages(np.array([1, 2, 3, 4, 5, 6, 7]), 2, root, fn)


def test_sha256_is_stable_across_processes():
    data = token_bytes(np.array([1, 2]))
    digest = hashlib.sha256((5).to_bytes(8, "little", signed=True) + data).digest()
    assert page_hash_fn("sha256")(5, data) == int.from_bytes(digest[:8], "little", signed=True)
    assert data == (1).to_bytes(8, "little") + (2).to_bytes(8, "little")


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="'md5'"):
        page_hash_fn("md5")


@pytest.mark.parametrize("algorithm", ["builtin", "sha256"])
def test_seed_separates_prefix_caches(session, algorithm):
    assert root_hash(algorithm, 1) != root_hash(algorithm, 2)
    hits = []
    for seed in (1, 2):
        m = make_paged(session, prefix_hash=algorithm, prefix_hash_seed=seed)
        a = TextContext(np.arange(9))
        m.claim(a.request_id)
        m.fetch([a])
        a.update(0)
        m.step([a])
        b = TextContext(np.arange(9))
        m.claim(b.request_id)
        m.alloc(b)
        hits.append(m.replicas[0].pool._index.keys())
        assert b.start_idx == 8
    assert not set(hits[0]) & set(hits[1])
