"""Page hashes: chains, the stable definitions (native sha256 / xxh3 vs hashlib / xxhash),
seeds, salts."""

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
    xxh3_chain,
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


def _sha256_definition(parent: int, data: bytes) -> int:
    digest = hashlib.sha256(data + parent.to_bytes(8, "little")).digest()
    return int.from_bytes(digest[24:], "big")


DEFINITIONS = {
    "sha256": _sha256_definition,
    "xxh3": lambda parent, data: xxhash.xxh3_64_intdigest(data, parent),
}
"""The stable algorithms, straight from hashlib and the xxhash package."""


def _reference_chain(algorithm: str, tokens: np.ndarray, page_size: int, parent: int) -> list[int]:
    """The hashes of the whole pages of `tokens`, one definition call per page."""
    data = np.ascontiguousarray(tokens, dtype="<i8").tobytes()
    out = []
    for start in range(0, len(data) // (8 * page_size) * 8 * page_size, 8 * page_size):
        parent = DEFINITIONS[algorithm](parent, data[start : start + 8 * page_size])
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
        expected = _reference_chain("sha256", tokens, page_size, parent)
        assert len(expected) == num_pages
        assert sha256_chain(tokens, page_size, parent, portable) == expected


def test_sha256_chain_of_many_pages_and_of_none():
    tokens = np.random.default_rng(1).integers(0, 150_000, 16 * 3000 + 5)
    assert sha256_chain(tokens, 16, 7) == _reference_chain("sha256", tokens, 16, 7)
    assert sha256_chain(tokens[:15], 16, 7) == []


# XXH3's length classes by page bytes (8 * page_size): 8 (4-8 bytes), 16 (9-16), 24-128 in
# 16-byte rounds from both ends (one more round past 32, 64 and 96 bytes: 32, 40, 96, 104),
# 136-240 (rounds past 128 against the secret from byte 3: 136, 232, 240), and over 240:
# 64-byte stripes, blocks of 1024 bytes (248 and 256: a few stripes; 1024: 15 stripes and the
# last; 1032: one block, no stripe, the last overlapping it; 2048, 2400: scrambles between
# blocks); odd and even page counts.
XXH3_PAGE_SIZES = [1, 2, 3, 4, 5, 8, 12, 13, 15, 16, 17, 29, 30, 31, 32, 33, 64, 128, 129, 256, 300]


@pytest.mark.parametrize("page_size", XXH3_PAGE_SIZES)
def test_native_xxh3_chain_is_xxhashs(page_size):
    rng = np.random.default_rng(page_size)
    parents = (0, 1, 2**63, 2**64 - 1, int(rng.integers(0, 2**63)))
    for parent, num_pages in zip(parents, (1, 2, 7, 8, int(rng.integers(9, 40)))):
        # num_pages, then a partial page that is not hashed
        tokens = rng.integers(-(2**63), 2**63 - 1, num_pages * page_size + page_size // 2,
                              dtype=np.int64)
        expected = _reference_chain("xxh3", tokens, page_size, parent)
        assert len(expected) == num_pages
        assert xxh3_chain(tokens, page_size, parent) == expected


def test_xxh3_chain_of_many_pages_and_of_none():
    tokens = np.random.default_rng(1).integers(0, 150_000, 16 * 3000 + 5)
    assert xxh3_chain(tokens, 16, 7) == _reference_chain("xxh3", tokens, 16, 7)
    read_only = tokens.copy()
    read_only.flags.writeable = False  # no ctypes view of it: its address from numpy
    assert xxh3_chain(read_only, 16, 7) == _reference_chain("xxh3", tokens, 16, 7)
    assert xxh3_chain(tokens, 128, 2**64 - 1) == _reference_chain("xxh3", tokens, 128, 2**64 - 1)
    assert xxh3_chain(tokens[:15], 16, 7) == []


@pytest.mark.parametrize("algorithm", ["sha256", "xxh3"])
def test_page_hashes_and_ranges_use_the_same_chain(algorithm):
    fn = page_hash_fn(algorithm)
    tokens = np.random.default_rng(2).integers(0, 50_000, 16 * 40, dtype=np.int32)
    expected = _reference_chain(algorithm, tokens, 16, 11)
    assert page_hashes(tokens, 16, 11, fn) == expected
    pages = list(iter_page_hashes(tokens, 16, expected[2], fn, 3, 39))
    assert [h for h, _ in pages] == expected[3:39]
    assert [d for _, d in pages] == [token_bytes(page) for page in tokens.reshape(40, 16)[3:39]]
    one = list(iter_page_hashes(tokens, 16, expected[6], fn, 7, 8))  # a decode step's page
    assert one == [(expected[7], token_bytes(tokens[7 * 16 : 8 * 16]))]


@pytest.mark.parametrize(
    "algorithm, chain, min_pages",
    [
        ("sha256", "sha256_chain", "_MIN_SHA256_CHAIN_PAGES"),
        ("xxh3", "xxh3_chain", "_MIN_XXH3_CHAIN_PAGES"),
    ],
)
def test_chains_from_the_threshold_on_take_one_native_call(
    monkeypatch, algorithm, chain, min_pages
):
    calls = []
    native = getattr(hashing, chain)
    threshold = getattr(hashing, min_pages)

    def spy(tokens, page_size, parent):
        calls.append(len(tokens) // page_size)
        return native(tokens, page_size, parent)

    monkeypatch.setattr(hashing, chain, spy)
    fn = page_hash_fn(algorithm)
    tokens = np.arange(16 * (threshold + 5))
    for num_pages in range(1, threshold + 6):
        expected = _reference_chain(algorithm, tokens[: 16 * num_pages], 16, 1)
        assert page_hashes(tokens[: 16 * num_pages], 16, 1, fn) == expected
        assert [h for h, _ in iter_page_hashes(tokens, 16, 1, fn, 0, num_pages)] == expected
    assert calls == [n for n in range(threshold, threshold + 6) for _ in range(2)]


def test_sha256_uses_the_cpus_sha_instructions_where_it_has_them():
    has_sha_ni = "sha_ni" in Path("/proc/cpuinfo").read_text()
    assert sha256_backend() == ("mojo+sha-ni" if has_sha_ni else "mojo-scalar")


@pytest.mark.parametrize("algorithm, chain", [("sha256", sha256_chain), ("xxh3", xxh3_chain)])
def test_falls_back_to_per_page_calls_with_one_warning(monkeypatch, algorithm, chain):
    def unavailable(*args, **kwargs):
        raise RuntimeError("no mojo here")

    fn = page_hash_fn(algorithm)
    tokens = np.arange(16 * 25)  # pages enough for either native chain
    native = page_hashes(tokens, 16, 3, fn)
    assert native == _reference_chain(algorithm, tokens, 16, 3)
    monkeypatch.setattr(extensions, "load", unavailable)
    hashing._native_hash_module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="fall back to hashlib and xxhash.*no mojo here"):
            assert page_hashes(tokens, 16, 3, fn) == native
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once only
            assert [h for h, _ in iter_page_hashes(tokens, 16, 3, fn)] == native
        with pytest.raises(RuntimeError, match="unavailable"):
            chain(tokens, 16, 3)
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
    roots = {salted_root(algorithm, 0, s) for s in (None, "a", "b", "ab", " ")}
    assert len(roots) == 5
    assert salted_root(algorithm, 0, None) == root_hash(algorithm, 0)
    assert salted_root(algorithm, 0, "") == root_hash(algorithm, 0)  # no salt, as in vLLM
    assert salted_root(algorithm, 0, "a") == salted_root(algorithm, 0, "a")
    assert salted_root(algorithm, 0, "a") != salted_root(algorithm, 1, "a")


@pytest.mark.parametrize("algorithm", ["xxh3", "sha256"])
def test_a_pages_format_separates_its_hashes(algorithm):
    # Issue 53: an FP8 page and a bfloat16 page of the same tokens never share a hash;
    # unquantized pages keep the hashes they had before formats (their tag is "").
    from max.dtype import DType
    from mokv import KVCacheParams, KVCacheQuantization
    from mokv.cache.extra_keys import chain_root

    shape = dict(n_kv_heads=2, head_dim=256, page_size=4)
    formats = [KVCacheParams(DType.bfloat16, **shape).page_format,
               KVCacheParams(DType.float32, **shape).page_format,
               KVCacheParams(DType.float8_e4m3fn, quantization=KVCacheQuantization(),
                             **shape).page_format,
               KVCacheParams(DType.float8_e4m3fn, quantization=KVCacheQuantization(granularity=64),
                             **shape).page_format]
    assert formats == ["", "", "float8_e4m3fn:float32:128", "float8_e4m3fn:float32:64"]
    tokens = np.arange(12)
    fn = page_hash_fn(algorithm)
    for salt in (None, "tenant"):
        roots = [chain_root(algorithm, 7, salt, None, page_format=f) for f in formats]
        assert roots[0] == roots[1] == chain_root(algorithm, 7, salt, None)
        assert len({roots[0], roots[2], roots[3]}) == 3
        chains = [page_hashes(tokens, 4, root, fn) for root in roots]
        assert not set(chains[0]) & set(chains[2]) and not set(chains[2]) & set(chains[3])
    assert root_hash(algorithm, 7, formats[2]) == chain_root(algorithm, 7, None, None, formats[2])


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
