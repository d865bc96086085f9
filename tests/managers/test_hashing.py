"""Page hash chains: chaining, the stable options' definitions, seeds and salts that isolate caches."""

import hashlib

import numpy as np
import pytest

import xxhash

from mokv.cache.hashing import (
    encode_extra_keys,
    hash_pages,
    page_hash_fn,
    page_hashes,
    root_hash,
    salted_root,
    token_bytes,
)
from mokv import TextContext

from .conftest import make_paged


ALGORITHMS = ["xxh3", "sha256", "builtin"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_hash_chain_depends_on_the_whole_prefix(algorithm):
    fn = page_hash_fn(algorithm)
    root = root_hash(algorithm, 0)
    a = hash_pages(np.array([1, 2, 3, 4, 5, 6, 7]), 2, root, fn)
    b = hash_pages(np.array([9, 9, 3, 4, 5, 6]), 2, root, fn)
    assert len(a) == 3 and len(b) == 3  # the partial last page of `a` is not hashed
    assert a[1][1] == b[1][1]  # same tokens in page 1 ...
    assert a[1][0] != b[1][0]  # ... but a different parent, so a different hash
    assert a == hash_pages(np.array([1, 2, 3, 4, 5, 6, 7]), 2, root, fn)
    assert [h for h, _ in a] == page_hashes(np.array([1, 2, 3, 4, 5, 6, 7]), 2, root, fn)
    assert all(0 <= h < 2**64 for h, _ in a + b)


def test_stable_hashes_are_their_definitions():
    data = token_bytes(np.array([1, 2]))
    assert data == (1).to_bytes(8, "little") + (2).to_bytes(8, "little")
    digest = hashlib.sha256((5).to_bytes(8, "little") + data).digest()
    # vLLM's 64-bit form: the last 8 bytes of the digest, big-endian
    assert page_hash_fn("sha256")(5, data) == int.from_bytes(digest[-8:], "big")
    assert page_hash_fn("xxh3")(2**64 - 1, data) == xxhash.xxh3_64_intdigest(data, 2**64 - 1)


def test_extra_key_encoding_is_injective():
    assert encode_extra_keys("ab", "c") != encode_extra_keys("a", "bc")
    assert encode_extra_keys("1") != encode_extra_keys(1)
    assert encode_extra_keys(b"x") != encode_extra_keys("x")
    assert encode_extra_keys("") != encode_extra_keys()


@pytest.mark.parametrize("algorithm", ["xxh3", "sha256"])
def test_salts_separate_roots(algorithm):
    roots = {salted_root(algorithm, 0, s) for s in (None, "", "a", "b", "ab")}
    assert len(roots) == 5
    assert salted_root(algorithm, 0, None) == root_hash(algorithm, 0)
    assert salted_root(algorithm, 0, "a") == salted_root(algorithm, 0, "a")
    assert salted_root(algorithm, 0, "a") != salted_root(algorithm, 1, "a")


def test_unknown_algorithm_is_named():
    with pytest.raises(ValueError, match="'md5'"):
        page_hash_fn("md5")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
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
