"""What the nested configs are checked against, and the names every layer agrees on.

The config package is the ground floor: its modules import nothing of mokv's above them
(no manager, tier, event stream or store), so that every layer can import its config
without a circle. A nested config (a tier's, the events', the sessions') is checked
against the params it joins through `ParamsView`, the few facts of `KVCacheParams` it
reads, rather than by importing `KVCacheParams` back.
"""

from __future__ import annotations

from typing import Protocol

from max.dtype import DType

CACHE_DTYPES = (DType.float32, DType.bfloat16, DType.float16)
"""Element types of the cache that mokv's kernels read and write."""

PREFIX_HASH_ALGORITHMS = ("xxh3", "sha256", "builtin")
"""Names accepted by `KVCacheParams.prefix_hash`; see `mokv.cache.hashing`."""

STABLE_ALGORITHMS = ("xxh3", "sha256")
"""Algorithms whose hashes are the same in every process (required for events and the
shared tier)."""


def check_share(owner: str, share: object) -> None:
    """ValueError unless `share` (`owner`'s `max_share`) is a number in (0, 1]."""
    if share.__class__ not in (int, float) or not 0 < share <= 1:
        raise ValueError(f"{owner}.max_share must be a number in (0, 1], got {share!r}")


def check_clock(owner: str, clock: object) -> None:
    """TypeError unless `clock` (`owner`'s) is callable."""
    if not callable(clock):
        raise TypeError(f"{owner}.clock must be callable, got {clock!r}")


class ParamsView(Protocol):
    """The facts of a `KVCacheParams` that a nested config checks itself against."""

    @property
    def enable_prefix_caching(self) -> bool: ...

    @property
    def prefix_hash(self) -> str: ...

    @property
    def data_parallel_degree(self) -> int: ...

    def bytes_per_page(self, num_layers: int) -> int: ...
