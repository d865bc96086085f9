"""`PagePool.check_invariants`: the pool's invariants (listed in `page_pool.py`), checked
against the owners' page lists. Run by the managers' `check_invariants` and the tests;
never on a hot path."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import InvariantError
from .retention import Retention


class PagePoolChecks:
    """The checking half of `PagePool` (its base class: this reads the pool's fields)."""

    num_pages: int
    _ref_count: list[int]
    _page_hash: list[int | None]
    _free: list[int]
    _index: dict[int, int]
    _retention: Retention
    _cached: dict[int, None]
    _kept: dict[int, None]

    def check_invariants(self, owned_pages: Iterable[Iterable[int]]) -> None:
        """Raises InvariantError unless invariants 1-5 hold for these owners' page lists."""
        holders = [0] * self.num_pages
        for pages in owned_pages:
            for page_id in pages:
                holders[page_id] += 1
        free, cached, kept = set(self._free), set(self._cached), set(self._kept)
        if len(free) != len(self._free):
            raise InvariantError(f"free list holds duplicates: {sorted(self._free)}")
        for (name, a), (other, b) in (
            (("free", free), ("cached", cached)),
            (("free", free), ("kept", kept)),
            (("cached", cached), ("kept", kept)),
        ):
            if a & b:
                raise InvariantError(f"pages both {name} and {other}: {sorted(a & b)}")
        for page_id in range(self.num_pages):
            ref, h = self._ref_count[page_id], self._page_hash[page_id]
            state = (
                "free"
                if page_id in free
                else "cached"
                if page_id in cached
                else "kept"
                if page_id in kept
                else "owned"
            )
            if ref != holders[page_id]:
                raise InvariantError(
                    f"page {page_id} ({state}) has ref count {ref} but {holders[page_id]} owners"
                )
            if (state == "owned") != (ref > 0):
                raise InvariantError(f"page {page_id} is {state} with ref count {ref}")
            if state in ("cached", "kept") and h is None or state == "free" and h is not None:
                raise InvariantError(f"page {page_id} is {state} with hash {h}")
            if h is not None and self._index.get(h) != page_id:
                raise InvariantError(f"page {page_id} has hash {h} but is not indexed under it")
        misfiled = self._retention.misfiled(self._page_hash)
        if misfiled:
            raise InvariantError(
                f"unowned pages {misfiled} are kept without a retained hash or cached with one"
            )
        for h, page_id in self._index.items():
            if self._page_hash[page_id] != h:
                raise InvariantError(
                    f"index maps {h} to page {page_id}, which carries another hash"
                )
