"""WindowTails: what the sessions retain, or the pins hold, in a sliding-window group
(or of the recurrent state's checkpoints).

A session retains its chain so that its next turn finds it; a pin holds a prefix so
that a later request finds it. In a cache of groups, that request's joint hit needs
every page of the chain from a full group, but from a sliding group only the pages its
window reads before the chain's end (the hit's end): the last `pages_in_window` of it
(`SlidingWindowGroup.held_of_hit`). So a sliding group holds only those tails, counted
per hash as the session and pin tables count whole chains, in the group's pool and
tiers; the pages before them stay ordinary cached pages, which the window's own
pressure evicts first.

The recurrent state's checkpoints (`groups/state.py`) are held the same way, their
tail being one hash: the chain's last boundary of `checkpoint_every` pages
(`checkpoint_tail`), where a next turn's joint hit resumes (it never passes the last
checkpoint; a checkpoint taken there later, by a decode step ending on it, is held too).

Every change records its undo in the manager's log before it changes anything, and
cannot fail half-way (plain dict operations, then the pool's and tiers' own calls).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial

from ...cache.page_pool import PagePool
from ...tiers.stack import TierStack
from ...undo import UndoLog
from .chain_counts import check_counts

TailRule = Callable[[Sequence[int]], tuple[int, ...]]
"""The hashes of a chain a group holds (a window's last pages, a state's checkpoint)."""

Change = tuple[tuple[int, ...], tuple[int, ...], bool]
"""A chain before and after a change, and whether the hashes it lets go go to the old
end of the LRU (a session that ended, expired or was released; a pin) or the young end
(a session the share cap dropped)."""


class WindowTails:
    """The tails of the chains one sliding group (or the state) holds (see the module
    docstring), as `tail` says: `hold(hashes)` and `let_go(hashes, old_end)` change its
    pool and tiers, `held()` is what its pool holds (for the checks)."""

    def __init__(
        self,
        tail: TailRule,
        undo: UndoLog | None,
        hold: Callable[[list[int]], None],
        let_go: Callable[[list[int], bool], None],
        held: Callable[[], frozenset[int]],
    ) -> None:
        self.tail = tail
        """The hashes of a chain held (`window_tail`, `checkpoint_tail`)."""
        self.undo = undo
        self._hold, self._let_go, self._held = hold, let_go, held
        self._count: dict[int, int] = {}  # tail hash -> chains holding it

    @property
    def hashes(self) -> frozenset[int]:
        """Every tail hash held."""
        return frozenset(self._count)

    def size_after(self, changes: Iterable[Change]) -> int:
        """How many distinct tail hashes would be held after `changes` (pure)."""
        delta = self._delta(changes)[0]
        count = self._count
        return len(count) + sum((count.get(h, 0) + d > 0) - (h in count) for h, d in delta.items())

    def _delta(self, changes: Iterable[Change]) -> tuple[dict[int, int], set[int]]:
        """Per tail hash, the chains holding it gained (or lost); and those let go by a
        change to the young end."""
        delta: dict[int, int] = {}
        young: set[int] = set()
        for old, new, old_end in changes:
            for h in set(self.tail(old)):
                delta[h] = delta.get(h, 0) - 1
                if not old_end:
                    young.add(h)
            for h in set(self.tail(new)):
                delta[h] = delta.get(h, 0) + 1
        return delta, young

    def apply(self, changes: Iterable[Change]) -> None:
        """The chains changed so: holds the new tails, lets the old ones go."""
        delta, young = self._delta(changes)
        count = self._count
        if self.undo is not None:  # restores old values: pushed first, idempotent
            self.undo.push(self._restore, [(h, count.get(h)) for h in delta])
        hold: list[int] = []
        let_go: list[int] = []
        fall_back: list[int] = []
        for h, d in delta.items():
            before = count.get(h, 0)
            after = before + d
            if after:
                count[h] = after
            else:
                count.pop(h, None)
            if not before and after:
                hold.append(h)
            elif before and not after:
                (fall_back if h in young else let_go).append(h)
        self._let_go(let_go, True)
        self._let_go(fall_back, False)
        self._hold(hold)

    def clear(self) -> list[int]:
        """`reset_prefix_cache`: nothing is held (the pools forget it themselves);
        returns what was."""
        if self.undo is not None:
            self.undo.push(self._restore, list(self._count.items()))
        gone = list(self._count)
        self._count.clear()
        return gone

    def _restore(self, counts: list[tuple[int, int | None]]) -> None:
        for h, n in counts:
            if n is None:
                self._count.pop(h, None)
            else:
                self._count[h] = n

    def check_invariants(self, holders: str, chains: Iterable[Sequence[int]], cap: int) -> None:
        """InvariantError unless the counts are the chains' tails and the pool holds
        exactly those hashes."""
        tails = [self.tail(chain) for chain in chains]
        check_counts(f"{holders} (window)", tails, self._count, self._held(), cap)


def window_tail(pages_in_window: int, chain: Sequence[int]) -> tuple[int, ...]:
    """The pages of `chain` a later hit's window reads (its last ones)."""
    return tuple(chain[-pages_in_window:]) if chain else ()


def checkpoint_tail(checkpoint_every: int, chain: Sequence[int]) -> tuple[int, ...]:
    """The hash of `chain`'s last boundary of `checkpoint_every` pages (none in a chain
    shorter than that): where a later joint hit on it resumes the state."""
    end = len(chain) // checkpoint_every * checkpoint_every
    return (chain[end - 1],) if end else ()


def in_both(first: Callable[..., None], second: Callable[..., None]) -> Callable[..., None]:
    """A call of `first` then `second` with the same arguments (a group's pool, then its
    tiers: `WindowTails`' `hold` and `let_go`)."""

    def both(*args: object) -> None:
        first(*args)
        second(*args)

    return both


def at_either_end(let_go: Callable[[list[int]], None]) -> Callable[[list[int], bool], None]:
    """`let_go` for holders whose let-go hashes have no LRU end to go to (pins)."""

    def call(hashes: list[int], old_end: bool) -> None:
        let_go(hashes)

    return call


Holder = Callable[[PagePool, TierStack], Callable[..., None]]
"""What holds (or lets go of) hashes in a group's pool and tiers."""


def split_groups(
    groups: Sequence[tuple[PagePool, TierStack, int | TailRule]],
    undo: UndoLog | None,
    hold: Holder,
    let_go: Holder,
    held: str,
) -> tuple[list[tuple[PagePool, TierStack]], list[tuple[WindowTails, PagePool, TierStack]]]:
    """A table's groups (`(pool, tiers, pages_in_window or a TailRule)`): those that
    hold whole chains (0), and each other's `WindowTails` (a sliding group's window,
    the state's checkpoint; `held`: the pool's property of what it holds, for the
    checks)."""
    whole = [(pool, tiers) for pool, tiers, window in groups if not window]
    windows = [
        (
            WindowTails(
                window if callable(window) else partial(window_tail, window),
                undo,
                hold(pool, tiers),
                let_go(pool, tiers),
                partial(getattr, pool, held),
            ),
            pool,
            tiers,
        )
        for pool, tiers, window in groups
        if window
    ]
    return whole, windows
