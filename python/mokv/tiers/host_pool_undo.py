"""How a `HostPagePool` undoes each of its changes: the functions its changing methods
record in the manager's undo log (`mokv.undo`), run newest first by `UndoLog.rollback`,
and `lose`, by which the host tier names the victims a copy is about to overwrite (their
eviction cannot be undone: `host_pool.py` says what that leaves).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..cache.page_pool import PageEventSink
from ..cache.retention import Retention


class HostPagePoolUndo:
    """The undo half of `HostPagePool` (its base class: these read and write the pool's
    fields)."""

    num_evicted_unused: int
    num_evicted_retained: int
    events: PageEventSink | None
    _page_hash: list[int | None]
    _page_tokens: list[bytes | None]
    _parent: list[int | None]
    _free: list[int]
    _retention: Retention
    _index: dict[int, int]
    _children: dict[int, int]
    _loaded: list[bool]
    _lost: set[int]
    _forget: Callable[[int, int], None]

    def lose(self, page_ids: Iterable[int]) -> None:
        """Run by a rollback: these evicted pages' bytes were overwritten, so undoing
        their eviction leaves them evicted."""
        self._lost.update(page_ids)

    def _unevict(
        self, victims: list[tuple[int, tuple[int, bytes, int | None]]], unused: int, kept: int
    ) -> None:
        self.num_evicted_unused -= unused
        self.num_evicted_retained -= kept
        back = {}
        for page_hash, (page_id, data, parent) in victims:
            if page_id in self._lost:
                if self.events is not None:  # its removal was taken back with the rest
                    self.events.removed(page_hash)
                continue
            back[page_id] = (page_hash, data, parent)
        self._lost.difference_update(page_id for _, (page_id, _, _) in victims)
        self._free = [p for p in self._free if p not in back]
        for page_id, (page_hash, data, parent) in reversed(back.items()):
            self._index[page_hash] = page_id
            self._page_hash[page_id], self._page_tokens[page_id] = page_hash, data
            self._parent[page_id] = parent
            if parent is not None:
                self._children[parent] = self._children.get(parent, 0) + 1
            lru = self._retention.lru(page_hash)
            lru[page_id] = None
            lru.move_to_end(page_id, last=False)  # the victims were the oldest

    def _uninsert(self, page_ids: list[int], loaded: list[bool]) -> None:
        for page_id, was_loaded in zip(page_ids, loaded):
            page_hash = self._page_hash[page_id]
            self._forget(page_id, page_hash)  # type: ignore[arg-type]
            del self._retention.lru(page_hash)[page_id]
            self._loaded[page_id] = was_loaded
        self._free.extend(reversed(page_ids))

    def _unmark_loaded(self, flags: list[tuple[int, bool]]) -> None:
        for page_id, was_loaded in flags:
            self._loaded[page_id] = was_loaded

    def _unreset(
        self,
        stored: list[tuple[int, int | None, bytes | None, int | None]],
        cached: list[int],
        kept: list[int],
        retained: set[int],
        children: dict[int, int],
        num_free: int,
    ) -> None:
        del self._free[num_free:]
        self._retention.restore(cached, kept, retained)
        for page_id, page_hash, data, parent in stored:
            self._index[page_hash] = page_id  # type: ignore[index]
            self._page_hash[page_id], self._page_tokens[page_id] = page_hash, data
            self._parent[page_id] = parent
        self._children = children
