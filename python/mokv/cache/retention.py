"""Retention: the retained hashes of a page pool, and the two LRUs of unowned hashed pages
they split (the device's `PagePool`, the host tier's `HostPagePool`).

    cached   an unowned hashed page whose hash no session retains: evicted first
    kept     an unowned hashed page whose hash a session retains: evicted only when no
             cached page is left (`mokv.SessionConfig`)

Both are LRU orders, oldest first. Retention is by hash, not by page: whichever page
holds a retained hash while unowned is kept, so a page recomputed or loaded back after an
eviction is retained again. The pools own their index and call these with it, and
their undo log (`mokv.undo`): undoing a retention moves its pages back between the LRUs
(to other places in them, which the pools' contract allows).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from ..undo import UndoLog


class Retention:
    """Retained hashes and the cached / kept LRUs of one pool (see the module docstring)."""

    __slots__ = ("cached", "kept", "hashes")

    def __init__(self) -> None:
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.kept: OrderedDict[int, None] = OrderedDict()
        self.hashes: set[int] = set()

    def lru(self, page_hash: int | None) -> OrderedDict[int, None]:
        """The LRU an unowned page with `page_hash` belongs in."""
        return self.kept if page_hash in self.hashes else self.cached

    def retain(
        self, page_hashes: Iterable[int], index: Mapping[int, int], undo: UndoLog | None = None
    ) -> None:
        """Retains `page_hashes` (not retained yet); their cached pages (`index`: hash ->
        page) move to the young end of the kept LRU in the order given, so the first is
        evicted first among them. Cannot fail half-way; records its undo in `undo`."""
        page_hashes = list(page_hashes)
        if undo is not None and page_hashes:
            undo.push(self.unretain, page_hashes, index, False)
        for page_hash in page_hashes:
            self.hashes.add(page_hash)
            page_id = index.get(page_hash)
            if page_id is not None and self.cached.pop(page_id, self) is not self:
                self.kept[page_id] = None

    def unretain(
        self,
        page_hashes: Iterable[int],
        index: Mapping[int, int],
        old_end: bool,
        undo: UndoLog | None = None,
    ) -> None:
        """Stops retaining `page_hashes`; their kept pages move to the cached LRU, the
        first given first: at its old end (`old_end`: an ended session's pages go before
        any other cached page) or its young end (a session the share cap drops falls
        back to plain LRU as if just released). Cannot fail half-way; records its undo
        in `undo`."""
        page_hashes = [h for h in page_hashes if h in self.hashes]
        if undo is not None and page_hashes:
            undo.push(self.retain, page_hashes, index)
        moved = []
        for page_hash in page_hashes:
            self.hashes.discard(page_hash)
            page_id = index.get(page_hash)
            if page_id is not None and self.kept.pop(page_id, self) is not self:
                moved.append(page_id)
        for page_id in reversed(moved) if old_end else moved:
            self.cached[page_id] = None
            if old_end:
                self.cached.move_to_end(page_id, last=False)

    def restore(self, cached: Iterable[int], kept: Iterable[int], hashes: Iterable[int]) -> None:
        """Sets both LRUs (oldest first) and the retained hashes (a pool's undone reset)."""
        self.clear()
        self.cached.update(dict.fromkeys(cached))
        self.kept.update(dict.fromkeys(kept))
        self.hashes.update(hashes)

    def clear(self) -> None:
        """Forgets every retained hash and both LRUs."""
        self.cached.clear()
        self.kept.clear()
        self.hashes.clear()

    def misfiled(self, page_hash_of: Mapping[int, int | None] | list[int | None]) -> list[int]:
        """Pages in the wrong LRU for their hash (`page_hash_of[page]`): what the pools'
        `check_invariants` report."""
        return [
            page_id
            for lru, want in ((self.cached, False), (self.kept, True))
            for page_id in lru
            if (page_hash_of[page_id] in self.hashes) != want
        ]
