"""`PagePool.take_fresh`: `take((), n)` with the one-page case unrolled.

Every decoding request that fills its last page takes one fresh page (at pages of 16
tokens, one step in sixteen), and the pool of a busy replica has no free page left, so
that page is the oldest cached one, evicted. `take`'s general path (revived hits, a
slice of the LRU, columns of evicted hashes and tokens) cost ~1.8 us for it; unrolled,
~0.6 us. It does exactly what `take((), 1)` does: the same page, state, counters, undo
record and event (tests/managers/test_page_pool.py holds the two side by side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..undo import UndoLog

if TYPE_CHECKING:
    from .page_pool import PageEventSink

_NO_HITS: frozenset[int] = frozenset()  # what `take` records as revived without hits


class PagePoolGrow:
    """The growing half of `PagePool` (a mixin: this reads and changes the pool's fields)."""

    _ref_count: list[int]
    _page_hash: list[int | None]
    _page_tokens: list[bytes | None]
    _free: list[int]
    _cached: dict[int, None]
    _index: dict[int, int]
    events: PageEventSink | None
    undo: UndoLog | None
    _untake: Callable[..., None]
    _count_unindexed: Callable[[list[int]], None]
    take: Callable[[Sequence[int], int], list[int] | None]

    def take_fresh(self, num_new: int) -> list[int] | None:
        """`take((), num_new)`: `num_new` fresh pages with ref count 1, or None (and no
        change) if they do not fit."""
        free, cached = self._free, self._cached
        if num_new != 1 or not (free or cached):  # kept pages, or none: the general path
            return self.take((), num_new)
        evicted_hashes: list[int] = []
        evicted_tokens: list[bytes | None] = []
        if free:
            page_id = free.pop()
        else:  # the oldest cached page, evicted (`take`'s `_evict`)
            page_id = next(iter(cached))
            del cached[page_id]
            page_hash = self._page_hash[page_id]
            evicted_hashes.append(page_hash)  # type: ignore[arg-type]
            evicted_tokens.append(self._page_tokens[page_id])
            del self._index[page_hash]  # type: ignore[arg-type]
            self._page_hash[page_id] = self._page_tokens[page_id] = None
            self._count_unindexed(evicted_hashes)
        self._ref_count[page_id] = 1
        if self.undo is not None:
            num_evicted = len(evicted_hashes)
            self.undo.push(
                self._untake,
                [],
                _NO_HITS,
                (page_id,),
                1 - num_evicted,
                evicted_hashes,
                evicted_tokens,
                num_evicted,
            )
        if self.events is not None:
            for page_hash in evicted_hashes:
                self.events.removed(page_hash)
        return [page_id]
