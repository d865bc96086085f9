"""Retention: the retained and pinned hashes of a page pool, and the LRUs of unowned
hashed pages they split (the device's `PagePool`, the host tier's `HostPagePool`).

    cached   an unowned hashed page whose hash is neither retained nor pinned: evicted
             first
    kept     an unowned hashed page whose hash a session retains (and no pin holds):
             evicted only when no cached page is left (`mokv.SessionConfig`)
    pinned   an unowned hashed page whose hash a live pin holds (`mokv.PinConfig`):
             never evicted but to a tier that holds it too (the pool decides)

All are LRU orders, oldest first; a pin outranks a retention. Retention is by hash, not
by page: whichever page holds a retained hash while unowned is kept, so a page
recomputed or loaded back after an eviction is retained again. The pools own their index
and call these with it, and their undo log (`mokv.undo`): undoing a retention moves its
pages back between the LRUs (to other places in them, which the pools' contract allows).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping

from ..undo import UndoLog


class Retention:
    """Retained hashes and the cached / kept LRUs of one pool (see the module docstring)."""

    __slots__ = ("cached", "kept", "pinned", "hashes", "pinned_hashes")

    def __init__(self) -> None:
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.kept: OrderedDict[int, None] = OrderedDict()
        self.pinned: OrderedDict[int, None] = OrderedDict()
        self.hashes: set[int] = set()
        self.pinned_hashes: set[int] = set()

    def lru(self, page_hash: int | None) -> OrderedDict[int, None]:
        """The LRU an unowned page with `page_hash` belongs in."""
        if page_hash in self.pinned_hashes:
            return self.pinned
        return self.kept if page_hash in self.hashes else self.cached

    def pin(
        self, page_hashes: Iterable[int], index: Mapping[int, int], undo: UndoLog | None = None
    ) -> None:
        """Pins `page_hashes` (not pinned yet): their unowned pages move to the young end
        of the pinned LRU. Cannot fail half-way; records its undo in `undo`."""
        page_hashes = [h for h in page_hashes if h not in self.pinned_hashes]
        if undo is not None and page_hashes:
            undo.push(self.unpin, page_hashes, index)
        for page_hash in page_hashes:
            page_id = index.get(page_hash)
            if page_id is not None:
                lru = self.lru(page_hash)
                if lru.pop(page_id, self) is not self:
                    self.pinned[page_id] = None
            self.pinned_hashes.add(page_hash)

    def unpin(
        self, page_hashes: Iterable[int], index: Mapping[int, int], undo: UndoLog | None = None
    ) -> int:
        """Stops pinning `page_hashes`: their unowned pages go to the young end of the
        LRU they belong in now (a pin that ends is as if just released). Returns how many
        unowned pages became evictable. Cannot fail half-way; records its undo in
        `undo`."""
        page_hashes = [h for h in page_hashes if h in self.pinned_hashes]
        if undo is not None and page_hashes:
            undo.push(self.pin, page_hashes, index)
        moved = 0
        for page_hash in page_hashes:
            self.pinned_hashes.discard(page_hash)
            page_id = index.get(page_hash)
            if page_id is not None and self.pinned.pop(page_id, self) is not self:
                self.lru(page_hash)[page_id] = None
                moved += 1
        return moved

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
            if page_hash in self.pinned_hashes:  # its page stays pinned
                continue
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
            if page_hash in self.pinned_hashes:  # its page stays pinned
                continue
            if page_id is not None and self.kept.pop(page_id, self) is not self:
                moved.append(page_id)
        for page_id in reversed(moved) if old_end else moved:
            self.cached[page_id] = None
            if old_end:
                self.cached.move_to_end(page_id, last=False)

    def restore(
        self,
        cached: Iterable[int],
        kept: Iterable[int],
        hashes: Iterable[int],
        pinned: Iterable[int] = (),
        pinned_hashes: Iterable[int] = (),
    ) -> None:
        """Sets the LRUs (oldest first), the retained and the pinned hashes (a pool's
        undone reset)."""
        self.clear()
        self.cached.update(dict.fromkeys(cached))
        self.kept.update(dict.fromkeys(kept))
        self.pinned.update(dict.fromkeys(pinned))
        self.hashes.update(hashes)
        self.pinned_hashes.update(pinned_hashes)

    def clear(self) -> None:
        """Forgets every retained and pinned hash and the LRUs."""
        for held in (self.cached, self.kept, self.pinned, self.hashes, self.pinned_hashes):
            held.clear()

    def misfiled(self, page_hash_of: Mapping[int, int | None] | list[int | None]) -> list[int]:
        """Pages in the wrong LRU for their hash (`page_hash_of[page]`): what the pools'
        `check_invariants` report."""
        return [
            page_id
            for lru in (self.cached, self.kept, self.pinned)
            for page_id in lru
            if self.lru(page_hash_of[page_id]) is not lru
        ]
