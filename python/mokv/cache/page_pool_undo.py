"""How a `PagePool` undoes each of its changes: the functions its changing methods record
in the manager's undo log (`mokv.undo`), run newest first by `UndoLog.rollback`.

Each restores what its change altered: owners, hashes, tokens, the index, retention and
the counters the prefix memo reads (an undone `take` frees pages, an undone `commit_pages`
removes index entries). Pages go back to an end of the free list or of their LRU, not
necessarily to their old places, which the pool's contract allows (`page_pool.py`).
"""

from __future__ import annotations

from collections.abc import Callable

from .retention import Retention


class PagePoolUndo:
    """The undo half of `PagePool` (its base class: these read and write the pool's fields)."""

    num_pages: int
    num_evicted_retained: int
    num_freed: int
    num_unindexed: int
    _ref_count: list[int]
    _page_hash: list[int | None]
    _page_tokens: list[bytes | None]
    _free: list[int]
    _index: dict[int, int]
    _retention: Retention
    _count_unindexed: Callable[[list[int]], None]

    def _untake(
        self,
        hits: list[int],
        revived: set[int],
        pages: tuple[int, ...],
        from_free: int,
        evicted_hashes: list[int],
        evicted_tokens: list[bytes],
        num_unretained: int,
    ) -> None:
        self.num_evicted_retained -= len(evicted_hashes) - num_unretained
        self.num_freed += len(pages) + len(revived)
        for page_id in pages:
            self._ref_count[page_id] = 0
        self._free.extend(reversed(pages[:from_free]))
        evicted = pages[from_free:]
        for page_id, page_hash, data in zip(
            evicted[::-1], evicted_hashes[::-1], evicted_tokens[::-1]
        ):
            self._page_hash[page_id] = page_hash
            self._page_tokens[page_id] = data
            self._index[page_hash] = page_id
            lru = self._retention.lru(page_hash)
            lru[page_id] = None
            lru.move_to_end(page_id, last=False)  # they were the oldest
        for page_id in hits:
            self._ref_count[page_id] -= 1
        for page_id in revived:
            self._retention.lru(self._page_hash[page_id])[page_id] = None

    def _unrelease(self, page_ids: list[int]) -> None:
        for page_id in reversed(page_ids):
            ref = self._ref_count[page_id]
            if ref == 0:
                page_hash = self._page_hash[page_id]
                if page_hash is None:
                    self._free.pop()  # it was appended last
                else:
                    del self._retention.lru(page_hash)[page_id]
            self._ref_count[page_id] = ref + 1

    def _uncommit(self, page_ids: list[int]) -> None:
        page_hashes = [self._page_hash[page_id] for page_id in page_ids]
        self._count_unindexed(page_hashes)  # type: ignore[arg-type]
        for page_id, page_hash in zip(page_ids, page_hashes):
            del self._index[page_hash]  # type: ignore[arg-type]
            self._page_hash[page_id] = self._page_tokens[page_id] = None

    def _unreset(
        self,
        indexed: list[tuple[int, int, bytes | None]],
        cached: list[int],
        kept: list[int],
        retained: set[int],
        num_free: int,
    ) -> None:
        for page_id, page_hash, data in indexed:
            self._index[page_hash] = page_id
            self._page_hash[page_id] = page_hash
            self._page_tokens[page_id] = data
        del self._free[num_free:]
        self._retention.restore(cached, kept, retained)
