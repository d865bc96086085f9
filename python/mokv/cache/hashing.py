"""Chained page hashes for the prefix cache.

A full page is identified by `hash(parent_hash, page's token ids)`, where the parent
is the hash of the page before it (or a seeded root for the first page). Two pages
get the same hash only if the whole prefix up to and including them is the same, so
one dictionary lookup per page finds the longest cached prefix.

Algorithms:
- "builtin": Python's `hash` of (parent, token bytes). Fastest; stable within one
  process only (Python salts it per process unless PYTHONHASHSEED is set).
- "sha256": the first 8 bytes of SHA-256 over (parent, token bytes), as a signed
  64-bit int. Stable across processes and machines (needed to publish cache events).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import numpy as np

PageHashFn = Callable[[int, bytes], int]
"""(parent hash, the page's token ids as little-endian int64 bytes) -> page hash."""


def _builtin(parent: int, token_bytes: bytes) -> int:
    return hash((parent, token_bytes))


def _sha256(parent: int, token_bytes: bytes) -> int:
    digest = hashlib.sha256(parent.to_bytes(8, "little", signed=True) + token_bytes).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


_ALGORITHMS: dict[str, PageHashFn] = {"builtin": _builtin, "sha256": _sha256}


def page_hash_fn(algorithm: str) -> PageHashFn:
    """The page hash function called `algorithm` ("builtin" or "sha256")."""
    try:
        return _ALGORITHMS[algorithm]
    except KeyError:
        raise ValueError(
            f"unknown prefix hash {algorithm!r}; choose one of {sorted(_ALGORITHMS)}"
        ) from None


def root_hash(algorithm: str, seed: int) -> int:
    """The parent hash of a sequence's first page: a function of the seed alone."""
    return page_hash_fn(algorithm)(0, b"mokv-root" + seed.to_bytes(8, "little", signed=True))


def token_bytes(tokens: np.ndarray) -> bytes:
    """The canonical byte form of token ids that page hashes are computed over."""
    return np.ascontiguousarray(tokens, dtype="<i8").tobytes()


def iter_page_hashes(
    tokens: np.ndarray,
    page_size: int,
    parent: int,
    hash_fn: PageHashFn,
    first_page: int = 0,
    end_page: int | None = None,
) -> Iterator[tuple[int, bytes]]:
    """(hash, token bytes) of full pages `first_page` to `end_page` (default: the last
    full page) of `tokens`, chained from `parent`, the hash of the page before them.

    The tokens are converted to bytes once and sliced per page; a caller may stop early.
    """
    if end_page is None:
        end_page = len(tokens) // page_size
    data = token_bytes(tokens[first_page * page_size : end_page * page_size])
    stride = page_size * 8
    for start in range(0, len(data), stride):
        chunk = data[start : start + stride]
        parent = hash_fn(parent, chunk)
        yield parent, chunk


def hash_pages(
    tokens: np.ndarray, page_size: int, parent: int, hash_fn: PageHashFn
) -> list[tuple[int, bytes]]:
    """(hash, token bytes) of each full page of `tokens`, chained from `parent`."""
    return list(iter_page_hashes(tokens, page_size, parent, hash_fn))
