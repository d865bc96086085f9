"""Page hashes: chains, the stable definitions (native sha256 vs hashlib), seeds, salts."""

import hashlib
import warnings
from pathlib import Path

import numpy as np
import pytest

import xxhash

from mokv import TextContext, extensions
from mokv.cache import hashing
from mokv.cache.hashing import (
    encode_extra_keys,
    hash_pages,
    iter_page_hashes,
    page_hash_fn,
    page_hashes,
    root_hash,
    salted_root,
    sha256_backend,
    sha256_chain,
    token_bytes,
)

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
    digest = hashlib.sha256(data + (5).to_bytes(8, "little")).digest()
    # vLLM's 64-bit form: the last 8 bytes of the digest, big-endian
    assert page_hash_fn("sha256")(5, data) == int.from_bytes(digest[-8:], "big")
    assert page_hash_fn("xxh3")(2**64 - 1, data) == xxhash.xxh3_64_intdigest(data, 2**64 - 1)


def _hashlib_chain(tokens: np.ndarray, page_size: int, parent: int) -> list[int]:
    """The "sha256" definition, straight from hashlib."""
    data = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    out = []
    for start in range(0, len(data) // (8 * page_size) * 8 * page_size, 8 * page_size):
        digest = hashlib.sha256(data[start : start + 8 * page_size] + parent.to_bytes(8, "little"))
        parent = int.from_bytes(digest.digest()[24:], "big")
        out.append(parent)
    return out


# Message bytes = 8 * page_size + 8: 5 -> 48 (padding fits), 6 -> 56 and 14 -> 120 (the
# length spills into an extra block), 7 -> 64 and 15 -> 128 (whole blocks), 8 and 16
# (the tokens fill whole blocks, the parent starts the last), then the page sizes in use;
# odd and even page counts (pages go in pairs).
PAGE_SIZES = [1, 2, 5, 6, 7, 8, 14, 15, 16, 128, 256]


@pytest.mark.parametrize("portable", [False, True], ids=["cpu-sha", "scalar"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_native_sha256_chain_is_hashlibs(page_size, portable):
    rng = np.random.default_rng(page_size)
    parents = (0, 2**64 - 1, 2**63, int(rng.integers(0, 2**63)))
    for parent, num_pages in zip(parents, (1, 2, 7, int(rng.integers(8, 40)))):
        # num_pages, then a partial page that is not hashed
        tokens = rng.integers(-(2**63), 2**63 - 1, num_pages * page_size + page_size // 2,
                              dtype=np.int64)
        expected = _hashlib_chain(tokens, page_size, parent)
        assert len(expected) == num_pages
        assert sha256_chain(tokens, page_size, parent, portable) == expected


def test_sha256_chain_of_many_pages_and_of_none():
    tokens = np.random.default_rng(1).integers(0, 150_000, 16 * 3000 + 5)
    assert sha256_chain(tokens, 16, 7) == _hashlib_chain(tokens, 16, 7)
    assert sha256_chain(tokens[:15], 16, 7) == []


def test_sha256_page_hashes_and_ranges_use_the_same_chain():
    fn = page_hash_fn("sha256")
    tokens = np.random.default_rng(2).integers(0, 50_000, 16 * 20, dtype=np.int32)
    expected = _hashlib_chain(tokens, 16, 11)
    assert page_hashes(tokens, 16, 11, fn) == expected
    pages = list(iter_page_hashes(tokens, 16, expected[2], fn, 3, 9))
    assert [h for h, _ in pages] == expected[3:9]
    assert [d for _, d in pages] == [token_bytes(tokens[16 * i : 16 * i + 16]) for i in range(3, 9)]


def test_sha256_chains_of_four_pages_or_more_take_one_native_call(monkeypatch):
    calls = []

    def spy(tokens, page_size, parent):
        calls.append(len(tokens) // page_size)
        return sha256_chain(tokens, page_size, parent)

    monkeypatch.setattr(hashing, "sha256_chain", spy)
    fn = page_hash_fn("sha256")
    tokens = np.arange(16 * 9)
    for num_pages in range(1, 10):
        expected = _hashlib_chain(tokens[: 16 * num_pages], 16, 1)
        assert page_hashes(tokens[: 16 * num_pages], 16, 1, fn) == expected
        assert [h for h, _ in iter_page_hashes(tokens, 16, 1, fn, 0, num_pages)] == expected
    assert calls == [n for n in range(4, 10) for _ in range(2)]


def test_sha256_uses_the_cpus_sha_instructions_where_it_has_them():
    has_sha_ni = "sha_ni" in Path("/proc/cpuinfo").read_text()
    assert sha256_backend() == ("mojo+sha-ni" if has_sha_ni else "mojo-scalar")


def test_sha256_falls_back_to_hashlib_with_one_warning(monkeypatch):
    def unavailable(*args, **kwargs):
        raise RuntimeError("no mojo here")

    fn = page_hash_fn("sha256")
    tokens = np.arange(16 * 5)
    native = page_hashes(tokens, 16, 3, fn)
    monkeypatch.setattr(extensions, "load", unavailable)
    hashing._native_hash_module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="fall back to hashlib.*no mojo here"):
            assert page_hashes(tokens, 16, 3, fn) == native
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once only
            assert [h for h, _ in iter_page_hashes(tokens, 16, 3, fn)] == native
        with pytest.raises(RuntimeError, match="unavailable"):
            sha256_chain(tokens, 16, 3)
        assert sha256_backend() == "hashlib"
    finally:
        hashing._native_hash_module.cache_clear()


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
