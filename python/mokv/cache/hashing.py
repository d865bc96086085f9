"""Chained page hashes for the prefix cache, KV-cache events and routers.

A full page is identified by `hash(parent_hash, page's token ids)`, where the parent
is the hash of the page before it (or a root for the first page). Two pages get the
same hash only if the whole prefix up to and including them is the same, so one
dictionary lookup per page finds the longest cached prefix. Hashes are unsigned
64-bit ints (what vLLM's events carry as `ExternalBlockHash`).

Algorithms (`KVCacheParams.prefix_hash`):
- "xxh3" (default): XXH3-64 of the page's token bytes, seeded with the parent hash
  (`xxhash` package). Stable across processes, restarts and machines; the fastest.
  Seeding with the parent instead of prepending it saves a concatenation per page.
  A chain of pages is hashed in one call of the Mojo extension `mokv_hash_ext` (its
  own XXH3, bit-identical to the package's): the package's per-call cost from Python
  (~0.1-0.3 us) is most of the time at 16 tokens a page. The `xxhash` package stays
  the definition, and the fallback when the extension is unavailable.
- "sha256": SHA-256 of (token bytes, parent as 8 little-endian bytes), in vLLM's
  64-bit form: the last 8 bytes of the digest read big-endian. Stable; for those
  who want a cryptographic hash. A chain of pages is hashed in one call of the Mojo
  extension `mokv_hash_ext` (x86 SHA extensions where the CPU has them): hashlib pays
  ~0.9 us of OpenSSL per call on top of the compression, most of the time at 16 tokens
  a page. The parent comes last so that the extension can compress two pages' token
  blocks side by side (only the final block depends on the chain; see the module).
  hashlib stays the definition, and the fallback (with one warning) when the
  extension cannot be built or loaded.
- "builtin": Python's `hash`, masked to 64 bits. Stable within one process only
  (Python salts it per process unless PYTHONHASHSEED is set): opt-in, and refused
  when events are published, since no router could recompute it.

Roots. The first page of a sequence chains from `root_hash(algorithm, seed)`: caches
with different `prefix_hash_seed` never share a page. A request with a `cache_salt`
chains from `salted_root(...)` instead, a hash of the salt under a separate root, so the
salt is mixed into the first page's hash only and later pages inherit it through the
chain. The salt is encoded with type tags and lengths (`encode_extra_keys`), so two
different salts never produce the same bytes (SGLang #30827's bug class). A LoRA adapter
joins the salt in the root, and an image keys the pages it overlaps
(`mokv.cache.extra_keys`: `keyed_root`, `iter_page_hashes(page_keys=...)`).

Formats. A quantized page's format (`KVCacheParams.page_format`, e.g.
"float8_e4m3fn:float32:128") is folded into every root, so an FP8 page and a bfloat16
page of the same tokens never share a hash. Unquantized pages have no format tag and keep
the hashes they always had.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import warnings
from collections.abc import Callable, Iterator, Mapping

import numpy as np
from xxhash import xxh3_64_intdigest

from .. import extensions
from ..config.base import STABLE_ALGORITHMS

PageHashFn = Callable[[int, "bytes | memoryview | np.ndarray"], int]
"""(parent hash, the page's token ids as little-endian int64 bytes) -> page hash."""

ChainHashFn = Callable[[np.ndarray, int, int], list[int]]
"""(int64 token ids of whole pages, page size, parent of the first page) -> the pages'
hashes, each page chained from the one before: what a loop over `PageHashFn` computes."""

MASK64 = (1 << 64) - 1


def _xxh3(parent: int, token_bytes) -> int:
    return xxh3_64_intdigest(token_bytes, parent)


TOKEN_BYTES = np.dtype("<i8")
"""The type of the token ids' bytes that pages hash (little-endian int64). An object, not
the string: numpy parses a dtype string at every call. A native int64 array's dtype is
this very object, so `tokens.dtype is TOKEN_BYTES` tells that no conversion is needed."""

# Copying an initialized hash object skips OpenSSL 3.0's per-constructor digest lookup
# (about a third of the cost of a 1 KiB page here).
_SHA256_INIT = hashlib.sha256()


def _sha256(parent: int, token_bytes) -> int:
    h = _SHA256_INIT.copy()
    h.update(token_bytes)
    h.update(parent.to_bytes(8, "little"))
    return int.from_bytes(h.digest()[24:], "big")


@functools.cache
def _native_hash_module():
    """`mokv_hash_ext`, or None (after one warning) when it cannot be built or loaded."""
    try:
        return extensions.load("mokv_hash_ext")
    except Exception as e:  # noqa: BLE001 - any build or load failure means: per-page calls
        warnings.warn(
            f"mokv_hash_ext unavailable, sha256 and xxh3 page hashes fall back to hashlib "
            f"and xxhash (same hashes, slower): {e}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def _address(array: np.ndarray) -> int:
    """The address of `array`'s first byte (`array` not empty). A ctypes view of it costs
    ~0.35 us, numpy's `__array_interface__` ~1.3 us (it builds a dict), but the view needs
    a writable buffer."""
    if array.flags.writeable:
        # numpy arrays have the buffer protocol; numpy's stubs do not say so to ctypes'
        return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]
    return array.__array_interface__["data"][0]


def _native_chain(function: str, tokens: np.ndarray, page_size: int, parent: int, *options):
    """The hashes of the whole pages of `tokens` (int64) from `mokv_hash_ext.<function>`
    in one call. Raises RuntimeError when the extension is unavailable."""
    module = _native_hash_module()
    if module is None:
        raise RuntimeError("mokv_hash_ext is unavailable (see the warning above)")
    data = np.ascontiguousarray(tokens, dtype=TOKEN_BYTES)
    num_pages = len(data) // page_size
    if num_pages == 0:
        return []
    out = np.empty(num_pages, dtype=np.uint64)
    parent_bits = parent - (1 << 64) if parent >> 63 else parent  # the int64 with its bits
    getattr(module, function)(
        _address(data), num_pages, page_size * 8, parent_bits, _address(out), *options
    )
    return out.tolist()


def sha256_chain(
    tokens: np.ndarray, page_size: int, parent: int, portable: bool = False
) -> list[int]:
    """The "sha256" hashes of the whole pages of `tokens` (int64) in one native call.

    `portable` selects the extension's scalar rounds even on a CPU with SHA extensions
    (for tests). Raises RuntimeError when the extension is unavailable."""
    return _native_chain("chain_sha256", tokens, page_size, parent, portable)


def xxh3_chain(tokens: np.ndarray, page_size: int, parent: int) -> list[int]:
    """The "xxh3" hashes of the whole pages of `tokens` (int64) in one native call.
    Raises RuntimeError when the extension is unavailable."""
    return _native_chain("chain_xxh3", tokens, page_size, parent)


def sha256_backend() -> str:
    """What computes "sha256" chains here: "mojo+sha-ni" (the extension with the x86 SHA
    instructions), "mojo-scalar" (the extension's portable rounds) or "hashlib"."""
    module = _native_hash_module()
    if module is None:
        return "hashlib"
    return "mojo+sha-ni" if module.uses_sha_extensions() else "mojo-scalar"


_MIN_SHA256_CHAIN_PAGES = 2
"""Fewer "sha256" pages go through the per-page function: a native call costs ~2-2.4 us
(numpy's arrays, their addresses, the list of ints), which hashlib's ~0.7-1.2 us a page
repays from 2 pages on (measured at pages of 16 and 128 tokens: 1 page level, 2 pages
2.5 / 3.3 us native vs 3.3 / 4.4 us). A decode step usually fills one page."""

_MIN_XXH3_CHAIN_PAGES = 8
"""Fewer "xxh3" pages go through the per-page function: the same ~2-2.4 us call against
the `xxhash` package's ~0.15-0.2 us a page breaks even at 6-7 pages, at pages of 16 and
128 tokens alike (measured: 6 pages 2.0 / 2.6 us native vs 2.0 / 2.6 us per page; 8 pages
2.0 / 2.7 vs 2.4 / 2.9 us)."""


def _chain_fn(hash_fn: PageHashFn, num_pages: int) -> ChainHashFn | None:
    """The batched form of `hash_fn` for `num_pages` pages when it has one that runs
    here and pays off, else None."""
    chain: ChainHashFn
    if hash_fn is _sha256:
        chain, min_pages = sha256_chain, _MIN_SHA256_CHAIN_PAGES
    elif hash_fn is _xxh3:
        chain, min_pages = xxh3_chain, _MIN_XXH3_CHAIN_PAGES
    else:
        return None
    return chain if num_pages >= min_pages and _native_hash_module() is not None else None


def _builtin(parent: int, token_bytes) -> int:
    return hash((parent, bytes(token_bytes))) & MASK64


_ALGORITHMS: dict[str, PageHashFn] = {"xxh3": _xxh3, "sha256": _sha256, "builtin": _builtin}


def page_hash_fn(algorithm: str) -> PageHashFn:
    """The page hash function called `algorithm` ("xxh3", "sha256" or "builtin").

    For an algorithm with a native chain this also loads `mokv_hash_ext` (building it on
    first use, ~15 s cold, then cached): managers and router indexes ask for their hash
    function when they are built, so a server pays the build at startup rather than
    inside its first long prompt."""
    try:
        fn = _ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown prefix hash {algorithm!r}; choose one of {sorted(_ALGORITHMS)}"
        ) from None
    if algorithm in STABLE_ALGORITHMS:
        _native_hash_module()
    return fn


def _seed_bytes(tag: bytes, seed: int, page_format: str) -> bytes:
    return tag + (seed & MASK64).to_bytes(8, "little") + page_format.encode()


def root_hash(algorithm: str, seed: int, page_format: str = "") -> int:
    """The parent hash of an unsalted sequence's first page: a function of the seed and
    the pages' format alone ("" for unquantized pages: the module docstring's Formats)."""
    return page_hash_fn(algorithm)(0, _seed_bytes(b"mokv-root", seed, page_format))


def encode_extra_keys(*keys: str | bytes | int) -> bytes:
    """Type-tagged, length-prefixed bytes of `keys`: injective, so that no two different
    key tuples (e.g. ("ab", "c") and ("a", "bc")) ever encode to the same bytes."""
    out = [b"mokv-extra-v1", len(keys).to_bytes(4, "little")]
    for key in keys:
        if isinstance(key, str):
            tag, data = b"s", key.encode("utf-8")
        elif isinstance(key, bytes):
            tag, data = b"b", key
        elif isinstance(key, int) and not isinstance(key, bool):
            tag, data = b"i", key.to_bytes(16, "little", signed=True)
        else:
            raise TypeError(f"extra keys must be str, bytes or int, got {key!r}")
        out += [tag, len(data).to_bytes(4, "little"), data]
    return b"".join(out)


def keyed_root(
    algorithm: str, seed: int, keys: tuple[str | bytes | int, ...], page_format: str = ""
) -> int:
    """The parent hash of the first page of a sequence whose every page is keyed by
    `keys` (tags and values, e.g. `("cache_salt", salt)`; see `mokv.cache.extra_keys`);
    `root_hash` for none.

    The keys are hashed under their own root (not `root_hash`), so a keyed root can never
    equal the hash of some unkeyed first page."""
    if not keys:
        return root_hash(algorithm, seed, page_format)
    fn = page_hash_fn(algorithm)
    key_domain = fn(0, _seed_bytes(b"mokv-salted-root", seed, page_format))
    return fn(key_domain, encode_extra_keys(*keys))


def salted_root(algorithm: str, seed: int, cache_salt: str | None) -> int:
    """The parent hash of the first page of a sequence with `cache_salt` (None or "":
    unsalted, as in vLLM, which salts a request only when its salt is truthy)."""
    if cache_salt is None or cache_salt == "":
        return root_hash(algorithm, seed)
    if not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {cache_salt!r}")
    return keyed_root(algorithm, seed, ("cache_salt", cache_salt))


def token_bytes(tokens: np.ndarray) -> bytes:
    """The canonical byte form of token ids that page hashes are computed over."""
    return np.ascontiguousarray(tokens, dtype=TOKEN_BYTES).tobytes()


def page_hashes(
    tokens: np.ndarray,
    page_size: int,
    parent: int,
    hash_fn: PageHashFn,
    page_keys: Mapping[int, bytes] | None = None,
) -> list[int]:
    """Hashes of the full pages of `tokens`, chained from `parent` (no token bytes kept).

    What a router computes for a query, and what the benchmark times: the pages are
    rows of one int64 array, handed to the hash function as zero-copy views. `page_keys`
    as for `iter_page_hashes`."""
    if page_keys:
        return [
            h for h, _ in iter_page_hashes(tokens, page_size, parent, hash_fn, 0, None, page_keys)
        ]
    data = np.ascontiguousarray(tokens, dtype=TOKEN_BYTES)
    num_pages = len(data) // page_size
    chain = _chain_fn(hash_fn, num_pages)
    if chain is not None:
        return chain(data, page_size, parent)
    out: list[int] = []
    append = out.append
    for row in data[: num_pages * page_size].reshape(num_pages, page_size):
        parent = hash_fn(parent, row)
        append(parent)
    return out


def iter_page_hashes(
    tokens: np.ndarray,
    page_size: int,
    parent: int,
    hash_fn: PageHashFn,
    first_page: int = 0,
    end_page: int | None = None,
    page_keys: Mapping[int, bytes] | None = None,
) -> Iterator[tuple[int, bytes]]:
    """(hash, token bytes) of full pages `first_page` to `end_page` (default: the last
    full page) of `tokens`, chained from `parent`, the hash of the page before them.

    `page_keys` maps a page index to the encoded extra keys of that page (an image it
    overlaps: `mokv.cache.extra_keys.page_keys`): such a page's hash is
    `hash_fn(hash_fn(parent, keys), tokens)`. A range with keyed pages is hashed page by
    page.

    The tokens are converted to bytes once and sliced per page. A range without keyed
    pages is hashed at once, in one call where the hash has a batched form (`_chain_fn`:
    a call costs ~2-2.4 us plus, per 128-token page, ~0.4 us for "sha256" against ~1.2 us
    a page through hashlib, or ~0.06 us for "xxh3" against ~0.2 us), and read back from
    lists: every caller reads every page, and a generator's step per page would cost
    about as much as hashing the page with "xxh3".
    """
    if end_page is None:
        end_page = len(tokens) // page_size
    pages = np.ascontiguousarray(tokens[first_page * page_size : end_page * page_size], TOKEN_BYTES)
    data = pages.tobytes()
    stride = page_size * 8
    if page_keys:
        return _keyed_page_hashes(data, stride, parent, hash_fn, first_page, page_keys)
    if len(data) == stride:  # one page, as a decoding request fills at every commit
        return iter(((hash_fn(parent, data), data),))
    chain = _chain_fn(hash_fn, end_page - first_page)
    if chain is not None:
        chunks = [data[start : start + stride] for start in range(0, len(data), stride)]
        return zip(chain(pages, page_size, parent), chunks)
    return _unbatched_page_hashes(data, stride, parent, hash_fn)


def _unbatched_page_hashes(
    data: bytes, stride: int, parent: int, hash_fn: PageHashFn
) -> Iterator[tuple[int, bytes]]:
    pages = []
    for start in range(0, len(data), stride):
        chunk = data[start : start + stride]
        parent = hash_fn(parent, chunk)
        pages.append((parent, chunk))
    return iter(pages)


def _keyed_page_hashes(
    data: bytes,
    stride: int,
    parent: int,
    hash_fn: PageHashFn,
    first_page: int,
    page_keys: Mapping[int, bytes],
) -> Iterator[tuple[int, bytes]]:
    for page_idx, start in enumerate(range(0, len(data), stride), start=first_page):
        chunk = data[start : start + stride]
        keys = page_keys.get(page_idx)
        parent = hash_fn(parent if keys is None else hash_fn(parent, keys), chunk)
        yield parent, chunk


def hash_pages(
    tokens: np.ndarray, page_size: int, parent: int, hash_fn: PageHashFn
) -> list[tuple[int, bytes]]:
    """(hash, token bytes) of each full page of `tokens`, chained from `parent`."""
    return list(iter_page_hashes(tokens, page_size, parent, hash_fn))
