"""WindowRetention: what the sessions retain in a sliding-window group (`sessions.py`).

A session retains its chain so that its next turn finds it. In a cache of groups, that
turn's joint hit needs every page of the chain from a full group, but from a sliding
group only the pages its window reads before the chain's end (the hit's end): the last
`pages_in_window` of it (`SlidingWindowGroup.held_of_hit`). So a sliding group retains
only those tails, counted per hash as the session table counts whole chains, in the
group's pool and tiers; the pages before them stay ordinary cached pages, which the
window's own pressure evicts first.

Every change records its undo in the manager's log before it changes anything, and
cannot fail half-way (plain dict operations, then the pool's and tiers' own calls).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...cache.page_pool import PagePool
from ...tiers.stack import TierStack
from ...undo import UndoLog
from .chain_counts import check_counts

Change = tuple[tuple[int, ...], tuple[int, ...], bool]
"""A session's chain before and after a change, and whether what it no longer retains
goes to the old end of the LRU (an ended, expired or released session) or the young end
(a session the share cap dropped)."""


class WindowRetention:
    """The tails of the sessions' chains that one sliding group retains (module doc)."""

    def __init__(
        self, pool: PagePool, tiers: TierStack, pages_in_window: int, undo: UndoLog | None
    ) -> None:
        self.pool = pool
        self.tiers = tiers
        self.pages_in_window = pages_in_window
        self.undo = undo
        self._count: dict[int, int] = {}  # retained tail hash -> sessions retaining it

    def tail(self, chain: Sequence[int]) -> tuple[int, ...]:
        """The pages of `chain` a next turn's window reads (its last ones)."""
        return tuple(chain[-self.pages_in_window :]) if chain else ()

    def apply(self, changes: Iterable[Change]) -> None:
        """The sessions' chains changed so: retains the new tails, unretains the old."""
        delta: dict[int, int] = {}
        young: set[int] = set()
        for old, new, old_end in changes:
            for h in set(self.tail(old)):
                delta[h] = delta.get(h, 0) - 1
                if not old_end:
                    young.add(h)
            for h in set(self.tail(new)):
                delta[h] = delta.get(h, 0) + 1
        count = self._count
        if self.undo is not None:  # restores old values: pushed first, idempotent
            self.undo.push(self._restore, [(h, count.get(h)) for h in delta])
        retain: list[int] = []
        unretain: list[int] = []
        fall_back: list[int] = []
        for h, d in delta.items():
            before = count.get(h, 0)
            after = before + d
            if after:
                count[h] = after
            else:
                count.pop(h, None)
            if not before and after:
                retain.append(h)
            elif before and not after:
                (fall_back if h in young else unretain).append(h)
        for target in (self.pool, self.tiers):
            target.retain(retain)
            target.unretain(unretain, old_end=True)
            target.unretain(fall_back, old_end=False)

    def clear(self) -> None:
        """`reset_prefix_cache`: nothing is retained (the pools forget it themselves)."""
        if self.undo is not None:
            self.undo.push(self._restore, list(self._count.items()))
        self._count.clear()

    def _restore(self, counts: list[tuple[int, int | None]]) -> None:
        for h, n in counts:
            if n is None:
                self._count.pop(h, None)
            else:
                self._count[h] = n

    def check_invariants(self, chains: Iterable[tuple[int, ...]], cap: int) -> None:
        """InvariantError unless the counts are the chains' tails and the pool retains
        exactly those hashes."""
        tails = [self.tail(chain) for chain in chains]
        check_counts("sessions retain (window)", tails, self._count, self.pool.retained_hashes, cap)
