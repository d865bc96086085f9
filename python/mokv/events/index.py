"""PrefixRouterIndex: what each cache holds, rebuilt from events, asked by prefix.

A source is one publisher: `(server, replica)`, a server's data-parallel replica. For
each, the index keeps the set of page hashes its events say are cached now:

    BlockStored       adds its block_hashes
    BlockRemoved      removes its block_hashes
    AllBlocksCleared  empties the source's set

A router asks `match(tokens, cache_salt)`: it hashes the full pages of `tokens` the way
the servers do (same algorithm, seed, page size and salt; see `mokv.cache.hashing`) and
counts, per source, the leading pages whose hashes the source holds. A source holding
pages 3 and 4 of a prompt but not page 0 scores 0: a cache serves prefixes only.

Invariant: after a source's events up to seq N are applied in order, its set equals
the publishing pool's `indexed_hashes()` as it was when batch N was handed over.
"""

from __future__ import annotations

import numpy as np

from ..cache.hashing import STABLE_ALGORITHMS, page_hash_fn, page_hashes, salted_root
from .format import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

Source = tuple[str, int]
"""(server name, data-parallel replica)."""


class PrefixRouterIndex:
    """Per source, the cached page hashes; per query, the leading pages each source holds.

    Args:
        page_size: the servers' page size; stores of another `block_size` are ignored
            (and counted in `num_ignored`), as their hashes cannot match.
        prefix_hash: the servers' `KVCacheParams.prefix_hash` ("xxh3" or "sha256").
        prefix_hash_seed: the servers' `KVCacheParams.prefix_hash_seed`.
    """

    def __init__(self, page_size: int, prefix_hash: str = "xxh3", prefix_hash_seed: int = 0):
        if prefix_hash not in STABLE_ALGORITHMS:
            raise ValueError(f"prefix_hash={prefix_hash!r} is not one of {STABLE_ALGORITHMS}")
        self.page_size = page_size
        self.prefix_hash = prefix_hash
        self.prefix_hash_seed = prefix_hash_seed
        self._hash_fn = page_hash_fn(prefix_hash)
        self._roots: dict[str | None, int] = {}
        self._sources: dict[Source, set[int]] = {}
        self.num_ignored = 0

    @property
    def sources(self) -> list[Source]:
        return list(self._sources)

    def hashes(self, source: Source) -> set[int]:
        """The hashes `source` holds (a copy)."""
        return set(self._sources.get(source, ()))

    def apply(self, source: Source, batch: KVEventBatch) -> None:
        """Applies one batch of `source`'s events, in order."""
        held = self._sources.setdefault(source, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                if event.block_size != self.page_size:
                    self.num_ignored += 1
                    continue
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                held.clear()

    def drop_source(self, source: Source) -> None:
        """Forgets everything about `source` (after a restart or an unrecoverable gap)."""
        self._sources.pop(source, None)

    def page_hashes(self, tokens, cache_salt: str | None = None) -> list[int]:
        """The hashes of the full pages of `tokens` with `cache_salt`, as servers compute them."""
        root = self._roots.get(cache_salt)
        if root is None:
            root = salted_root(self.prefix_hash, self.prefix_hash_seed, cache_salt)
            self._roots[cache_salt] = root
        return page_hashes(np.asarray(tokens), self.page_size, root, self._hash_fn)

    def match(self, tokens, cache_salt: str | None = None) -> dict[Source, int]:
        """For each source, how many leading full pages of `tokens` (with this salt) it holds."""
        hashes = self.page_hashes(tokens, cache_salt)
        out = {}
        for source, held in self._sources.items():
            n = 0
            for h in hashes:
                if h not in held:
                    break
                n += 1
            out[source] = n
        return out

    def best(self, tokens, cache_salt: str | None = None) -> tuple[Source | None, int]:
        """The source holding the longest prefix of `tokens` and that many pages
        ((None, 0) when no source holds its first page)."""
        scores = self.match(tokens, cache_salt)
        if not scores:
            return None, 0
        source = max(scores, key=scores.__getitem__)
        return (source, scores[source]) if scores[source] else (None, 0)
